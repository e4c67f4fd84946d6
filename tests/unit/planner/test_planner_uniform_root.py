"""The one-DP root bound with the fill and links joint over the chip types' kinds
(:mod:`megatron_h2.planner.uniform_root`): its knapsack against enumerating every choice, and
the root bound against the exact split of every pipeline of the shape on small random clusters
(every schedule, zero-bubble's micro-batch-1 shapes among them)."""

from __future__ import annotations

import importlib
import itertools

import numpy as np
import pytest

from megatron_h2.planner import own_root, suffixes, uniform_root
from megatron_h2.planner.block_links import block_links, last_link
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.partition import INF
from megatron_h2.planner.search_options import SearchOptions
from tests.unit.planner.test_planner_bounds import exact_below, small_case

search_module = importlib.import_module("megatron_h2.planner.search")


def uniform_shapes(seeds: range, schedule: str) -> list[BatchShape]:
    """The one-DP shapes (DP 1 and 2, micro-batch size 1) of :func:`small_case` ``seeds`` with
    some stage kind."""
    chunks = 2 if schedule == "interleaved" else 1
    shapes = [BatchShape(small_case(seed), 8, 1, schedule, chunks, dp)
              for seed in seeds for dp in (1, 2)]
    return [shape for shape in shapes if shape.kinds and shape.positions]


def enumerated(shape: BatchShape, caps: np.ndarray, probe: int) -> float:
    """:func:`uniform_root.uniform_fill_links` at one probe by trying every kind (or none) per
    type, every stage count of its block and every layer count those stages hold."""
    best = INF
    options = [[None, *shape.kinds_of[chip]] for chip in shape.types]
    for choice in itertools.product(*options):
        kinds = [kind for kind in choice if kind is not None]
        blocks = []
        for kind in kinds:
            largest = sorted(caps[kind, probe], reverse=True)
            most = min(shape.kinds[kind].max_stages, shape.positions)
            blocks.append([(n, x) for n in range(1, most + 1)
                           for x in range(1, int(sum(largest[:n])) + 1)])
        for picks in itertools.product(*blocks):
            if sum(x for _, x in picks) != shape.layers:
                continue
            cost = sum(x * float(shape.fill_unit[k]) + block_links(shape, shape.kinds[k].chip, n)
                       for k, (n, x) in zip(kinds, picks))
            best = min(best, cost)
    edges = float(shape.head_time.min() + shape.embedding_time.min())
    return best - last_link(shape) + edges


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_the_knapsack_is_the_least_over_every_choice(schedule: str) -> None:
    finite = 0
    for shape in uniform_shapes(range(4), schedule):
        probes = np.geomspace(max(shape.w_floor, 1e-12), shape.w_max, 4)
        caps = shape.capacity(probes)
        joint = uniform_root.uniform_fill_links(shape, caps)
        for probe in range(len(probes)):
            expected = enumerated(shape, caps, probe)
            assert joint[probe] == pytest.approx(expected, rel=1e-12) or joint[probe] == expected
            finite += expected < INF
    assert finite > 0


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble", "interleaved"])
def test_the_one_dp_root_bound_never_exceeds_the_exact_split_and_rises(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every one-DP root bound, also raised by the end-of-step levels, is at most the best exact
    split below the root (and every option's bound, which is at least it, at most the exact
    split of every pipeline below that option); on some shape the joint terms raise it above
    the root bound without them, and the levels raise it further."""
    checked, raised, levelled = 0, 0, 0
    for shape in uniform_shapes(range(16), schedule):
        run = search_module._Search(shape.cost, SearchOptions(8, top_k=10**6))
        shape.build_grid(shape.w_max, 64)
        joint = shape.root_coupled
        shape.tighten()
        least = exact_below(run, shape, suffixes.root_node(shape), [0])
        if least < INF:
            assert shape.root_bound() <= least * (1 + 1e-9), (shape.root_bound(), least)
            checked += 1
        with monkeypatch.context() as patch:
            patch.setattr(own_root, "uniform_fill_links",
                          lambda s, caps: np.zeros(caps.shape[1]))
            loose = shape._coupled_root()
        raised += joint > loose * (1 + 1e-6)
        levelled += shape.root_coupled > joint * (1 + 1e-6)
    assert checked > 0 and raised > 0 and levelled > 0


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_the_levels_hold_what_a_stage_holds_under_each_level(schedule: str) -> None:
    """A stage's end-of-step term (the exact split's, without the edges) with the units
    :func:`uniform_root.sync_levels` lets it hold at a level is at most that level's top, and
    with one unit more above it."""
    from megatron_h2.planner.partition import StageSlot, StageTable

    found = 0
    for shape in uniform_shapes(range(6), schedule):
        levels = uniform_root.sync_levels(shape)
        if levels is None:
            continue
        tops, held = np.append(levels[0][1:], INF), levels[1]
        for index, kind in enumerate(shape.kinds):
            m = kind.micro_batches
            table = StageTable([StageSlot(kind.costs, False, False)] * shape.positions,
                               shape.layers, [(shape.layers,) * 3] * shape.positions, schedule,
                               1, m)
            tail = table.tail[0]  # units 0 .. L (the longest pipeline: the least share)
            for level, top in enumerate(tops):
                units = int(held[index, level])
                assert units == shape.layers or tail[units + 1] > top * (1 + 1e-12)
                assert units == 0 or tail[units] <= top * (1 + 1e-9)
                found += 0 < units < shape.layers
    assert found > 0
