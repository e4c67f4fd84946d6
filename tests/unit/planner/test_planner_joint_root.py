"""The one-DP root bound with the fill and links joint over the chip types' blocks
(:mod:`megatron_h2.planner.joint_root`) and the fewest stages from the memory caps at a
pipeline's length (:mod:`megatron_h2.planner.length_floor`): each piece against enumerating its
choices, and the root bound against the exact split of every pipeline of the shape on small
random clusters."""

from __future__ import annotations

import importlib
import itertools
import random

import numpy as np
import pytest

from megatron_h2.planner import length_floor, suffixes
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.partition import INF, StageSlot, StageTable
from megatron_h2.planner.search_options import SearchOptions
from megatron_h2.planner.structure import solve_structure
from tests.helpers.paths import ROOT
from tests.unit.planner.test_planner_bounds import small_case

search_module = importlib.import_module("megatron_h2.planner.search")
SCHEDULES = [("1f1b", 1), ("zero-bubble", 1), ("interleaved", 2)]


def one_dp_shapes(seeds: range, schedule: str, chunks: int) -> list[BatchShape]:
    """The one-DP shapes (DP 1 and 2, micro-batch 1 and 2) of :func:`small_case` ``seeds`` with
    some stage kind."""
    shapes = [BatchShape(small_case(seed), 8, mbs, schedule, chunks, dp)
              for seed in seeds for mbs in (1, 2) for dp in (1, 2)]
    return [shape for shape in shapes if shape.kinds and shape.positions]


def closed_pipelines(shape: BatchShape) -> list[tuple[tuple[int, int], ...]]:
    """Every closed pipeline of ``shape`` (each type one block of one kind, in any order)."""
    out = []
    for order in itertools.permutations(shape.types):
        for size in range(1, len(order) + 1):
            for kinds in itertools.product(*(shape.kinds_of[t] for t in order[:size])):
                counts = [range(1, shape.kinds[k].max_stages + 1) for k in kinds]
                for stages in itertools.product(*counts):
                    if sum(stages) <= shape.positions and shape.closes(sum(stages)):
                        out.append(tuple(zip(kinds, stages)))
    return out


def split_table(shape: BatchShape, suffix: tuple[tuple[int, int], ...]) -> StageTable:
    """Stage two's table of the closed pipeline ``suffix`` (its terms per stage and unit)."""
    stages = [kind for kind, count in suffix for _ in range(count)]
    p, warmups = len(stages), shape.warmups(suffix)
    slots = [StageSlot(shape.kinds[k].costs, i == 0, i == p - 1) for i, k in enumerate(stages)]
    caps = [shape.mode_caps(k, p, i, q) for i, (k, q) in enumerate(zip(stages, warmups))]
    return StageTable(slots, shape.layers, caps, shape.schedule, shape.chunks,
                      [shape.kinds[k].micro_batches for k in stages])


def steady_and_stages(shape: BatchShape, suffix: tuple[tuple[int, int], ...]) -> tuple[float, int]:
    """The exact best split's largest folded steady term (``F w``; ``w`` where ``F = 0``) and its
    stage count (inf if nothing fits)."""
    split = solve_structure(shape, suffix)
    if split is None:
        return INF, 0
    table, p = split_table(shape, suffix), len(split.layers)
    rows, units = np.arange(p), [layers // shape.chunks for layers in split.layers]
    work = table.work[rows, units]
    if shape.factor_max == 0:  # one micro-batch per replica: the bound probes the work itself
        work = table.fill[rows, units] + table.tail[rows, units]
    return float(work.max()), p


def test_length_caps_bound_the_exact_caps_and_equal_them_on_middle_stages() -> None:
    compared = equal = 0
    for shape in one_dp_shapes(range(10), "zero-bubble", 1):
        for stages in range(2, shape.positions + 1):
            caps = length_floor.length_caps(shape, stages)
            for kind in range(len(shape.kinds)):
                for q in range(stages):
                    exact = np.minimum(shape.mode_caps(kind, stages, stages - 1 - q), shape.layers)
                    assert (exact <= caps[kind, :, q]).all(), (kind, stages, q)
                    compared += 1
                    if 0 < q < stages - 1:
                        assert (exact == caps[kind, :, q]).all()
                        equal += 1
    assert compared > 0 and equal > 0


def test_the_assignment_bound_is_at_least_every_assignment() -> None:
    rng = random.Random(7)
    tight = 0
    for _ in range(200):
        kinds, positions = rng.randint(1, 3), rng.randint(1, 5)
        values = np.array([[rng.randint(0, 9) for _ in range(positions)] for _ in range(kinds)],
                          dtype=np.float64)
        most = np.array([rng.randint(0, positions) for _ in range(kinds)], dtype=np.float64)
        best = 0.0
        for choice in itertools.product(range(-1, kinds), repeat=positions):
            if all(choice.count(k) <= most[k] for k in range(kinds)):
                best = max(best, sum(values[k, q] for q, k in enumerate(choice) if k >= 0))
        bound = length_floor.assignment_bound(values, most)
        assert bound >= best - 1e-9
        tight += bound <= best + 1e-9
    assert tight > 100  # mostly exact on these


@pytest.mark.parametrize(("schedule", "chunks"), SCHEDULES)
def test_no_pipeline_has_fewer_stages_than_the_fewest(schedule: str, chunks: int) -> None:
    """Every closed pipeline whose exact split's largest folded steady term is at most a probe
    has at least :func:`length_floor.fewest_stages` there; on some the floor is its count."""
    checked = tight = 0
    for shape in one_dp_shapes(range(8), schedule, chunks):
        for suffix in closed_pipelines(shape):
            steady, stages = steady_and_stages(shape, suffix)
            if steady == INF:
                continue
            probes = steady * np.array([1.0 + 1e-9, 1.5, 3.0])
            fewest = length_floor.fewest_stages(shape, probes)
            assert (fewest <= stages).all(), (suffix, fewest, stages)
            checked += 1
            tight += fewest[0] == stages
    assert checked > 0 and tight > 0


@pytest.mark.parametrize(("schedule", "chunks"), SCHEDULES)
def test_the_root_bound_never_exceeds_the_exact_split_and_rises(schedule: str, chunks: int) -> None:
    """Every one-DP root bound, refined (:meth:`BatchShape.refine_root`) or not, is at most the
    best exact split of its shape; on some shape the joint terms raise it, and on some the sync
    cells (:func:`joint_root.deep_root`) raise it above the joint terms."""
    checked = raised = deeper = 0
    for shape in one_dp_shapes(range(12), schedule, chunks):
        least = INF
        for suffix in closed_pipelines(shape):
            split = solve_structure(shape, suffix)
            least = min(least, split.step_time_s if split is not None else INF)
        before, joint = shape.root_bound(), shape._coupled_root(joint=True)
        shape.refine_root(INF)
        if least < INF:
            assert before <= shape.root_bound() <= least * (1 + 1e-9), (shape.root_bound(), least)
            checked += 1
            raised += joint > shape._coupled_root() * (1 + 1e-6)
            deeper += shape.root_bound() > max(before, joint) * (1 + 1e-6)
    assert checked > 0 and raised > 0 and deeper > 0


def test_the_options_of_the_search_stay_below_the_exact_splits() -> None:
    """With the refined roots, no option of a one-DP shape is bounded above a pipeline below it
    (every option's bound is at least its shape's root)."""
    from tests.unit.planner.test_planner_bounds import exact_below

    checked = [0]
    for shape in one_dp_shapes(range(6), "zero-bubble", 1):
        run = search_module._Search(shape.cost, SearchOptions(8, top_k=10**6))
        shape.refine_root(INF)
        shape.build_grid(shape.w_max, 64)
        exact_below(run, shape, suffixes.root_node(shape), checked)
    assert checked[0] > 0


def old_reach(shape: BatchShape, floor: float, cutoff: float) -> tuple[float, float]:
    """:func:`joint_root._reach` before the probes and cells reached the cutoff."""
    return min(shape.w_max, 4.0 * floor), INF


@pytest.mark.parametrize(("schedule", "chunks"), SCHEDULES)
def test_the_sync_cells_reaching_the_cutoff_stay_below_the_exact_splits(
        schedule: str, chunks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a cutoff above a shape's best exact split, :func:`joint_root.deep_root` (its probes
    and end-of-step cells up to the cutoff) is at most that split, and never below the reach
    before (the probes up to four times the floor, the cells up to the layers' largest term)."""
    from megatron_h2.planner import joint_root

    checked = 0
    for shape in one_dp_shapes(range(12), schedule, chunks):
        least = min((split.step_time_s for suffix in closed_pipelines(shape)
                     if (split := solve_structure(shape, suffix)) is not None), default=INF)
        if least == INF:
            continue
        for cutoff in (least * (1 + 1e-6), least * 1.5, least * 4.0):
            bound = joint_root.deep_root(shape, cutoff)
            assert bound <= least * (1 + 1e-9), (bound, least, cutoff)
            with monkeypatch.context() as patch:
                patch.setattr(joint_root, "_reach", old_reach)
                assert bound >= joint_root.deep_root(shape, cutoff) * (1 - 1e-9)
            checked += 1
    assert checked > 0


def test_reaching_the_cutoff_raises_the_large_zero_bubble_root(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the 100,000-chip 70B family member (seed 1) the micro-batch-1 zero-bubble shape at DP
    256, whose best plan found takes 1.19 s, is bounded at 0.77 s with the probes up to four
    times the floor (the uncoupled terms above them) and above 0.85 s with them up to the cutoff
    (the family's best plan, 0.9962 s)."""
    from megatron_h2.planner import joint_root

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    planner_family = importlib.import_module("planner_family")
    item = planner_family.member(1, 100_000)
    shape = BatchShape(item.cost, item.global_batch_size, 1, "zero-bubble", 1, 256)
    bound = joint_root.deep_root(shape, 0.9962)
    with monkeypatch.context() as patch:
        patch.setattr(joint_root, "_reach", old_reach)
        before = joint_root.deep_root(shape, 0.9962)
    assert before < 0.8 < 0.85 < bound
