"""The refined cells of the one-DP deep root (:mod:`megatron_h2.planner.sync_cells`): a cell's
parts cover it, and the refined root stays at most the best exact split of its shape on small
random clusters while rising above the unrefined cells on some."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest

from megatron_h2.planner import joint_root, last_cells, sync_cells
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.cost_model import CostConfig, CostModel
from megatron_h2.planner.partition import INF, Split
from megatron_h2.planner.structure import Suffix, solve_structure
from megatron_h2.planner.uniform_root import least_over_types
from tests.helpers.planner_models import planner_model
from tests.unit.planner.test_planner_joint_root import (
    closed_pipelines,
    one_dp_shapes,
    split_table,
    steady_and_stages,
)


def test_the_parts_of_a_cell_cover_it() -> None:
    shape = one_dp_shapes(range(1), "1f1b", 1)[0]
    floor = shape.tail_floor
    for lo, hi, z_lo, z_hi in [(0, 6, 0.0, 3 * floor + 1), (3, 4, floor, 2 * floor + 1),
                               (2, 9, floor + 1, INF), (5, 6, 0.0, floor)]:
        parts = sync_cells._split(shape, lo, hi, z_lo, z_hi)
        if not parts:
            assert hi - lo < 2 and not (z_hi < INF and z_hi > max(z_lo, floor) * 1.001)
            continue
        probes = sorted({(a, b) for a, b, _, _ in parts})
        syncs = sorted({(c, d) for _, _, c, d in parts})
        assert len(parts) == len(probes) * len(syncs)
        assert probes[0][0] == lo and probes[-1][1] == hi
        assert all(a[1] == b[0] for a, b in zip(probes, probes[1:]))
        assert syncs[0][0] == z_lo and syncs[-1][1] == z_hi
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(syncs, syncs[1:]))


def largest_tail(shape: BatchShape, suffix: tuple[tuple[int, int], ...],
                 layers: tuple[int, ...]) -> float:
    """The largest end-of-step term ``z`` of a split (:class:`StageTable`'s ``tail``)."""
    table = split_table(shape, suffix)
    return float(table.tail[np.arange(len(layers)), list(layers)].max())


def long_case(seed: int) -> CostModel:
    """Two chip types of 6-8 chips (one per node), a 12-layer model: pipelines of more stages
    than zero-bubble's slots at two micro-batches per replica."""
    rng = random.Random(seed)
    chips = tuple(
        ChipType("AB"[index], "cpu", rng.choice([6, 8]), 1, rng.uniform(0.05, 0.5),
                 rng.uniform(3, 9) / 1024, rng.uniform(1, 10), rng.uniform(0.2, 2))
        for index in range(2)
    )  # fmt: skip
    model = planner_model(12, 64, 176, 4, 128, 1000, 2)
    return CostModel(Cluster(chips, rng.uniform(0.1, 1)), model, CostConfig())


def cases(schedule: str, counted: bool) -> list[BatchShape]:
    """The small random shapes, and with ``counted`` also long ones (global batch 2, DP 1)."""
    shapes = one_dp_shapes(range(6), schedule, 1)
    if counted:
        shapes += [BatchShape(long_case(seed), 2, 1, schedule, 1, 1) for seed in range(5)]
    return [shape for shape in shapes if shape.kinds and shape.positions]


def cells_around_splits(
    shapes: list[BatchShape],
) -> Iterator[tuple[joint_root.CellBounds, Suffix, Split, int, float]]:
    """Per closed pipeline of each shape with a deep root's probes and an exact split: the
    shape's cell bounds, the pipeline, its split, the probe index just above its slowest
    steady term and its largest end-of-step term."""
    for shape in shapes:
        if (grid := joint_root.deep_probes(shape)) is None:
            continue
        probes = grid[0]
        bounds = joint_root.CellBounds(shape, probes)
        for suffix in closed_pipelines(shape):
            split = solve_structure(shape, suffix)
            steady, _ = steady_and_stages(shape, suffix)
            hi = int(np.searchsorted(probes, steady))
            if split is not None and 0 < hi < len(probes):
                yield bounds, suffix, split, hi, largest_tail(shape, suffix, split.layers)


@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_no_cell_is_bounded_above_a_plan_in_it(schedule: str, counted: bool) -> None:
    """The narrowest cell around every exact split's slowest steady term and largest
    end-of-step term (one probe step by a 1e-9 wide interval) bounds it, with the stage count
    kept (:mod:`megatron_h2.planner.stage_count`) or not; on some the bound is within 5% of
    it (the cells are not trivially low), and under zero-bubble keeping the count raises some."""
    checked = close = raised = 0
    for bounds, suffix, split, hi, z in cells_around_splits(cases(schedule, counted)):
        cell = [np.array([v]) for v in (hi - 1, hi, z * (1 - 1e-9), z)]
        bound = float(bounds(*cell, counted=counted)[0])
        assert bound <= split.step_time_s * (1 + 1e-9), (suffix, bound, split.step_time_s)
        checked += 1
        close += bound >= 0.95 * split.step_time_s
        raised += counted and bound > float(bounds(*cell)[0]) * (1 + 1e-9)
    assert checked > 0 and close > 0 and (raised > 0 or not counted or schedule == "1f1b")


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_the_refined_root_stays_below_the_exact_split_and_rises(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked = raised = 0
    for shape in one_dp_shapes(range(12), schedule, 1):
        least = INF
        for suffix in closed_pipelines(shape):
            split = solve_structure(shape, suffix)
            least = min(least, split.step_time_s if split is not None else INF)
        if least == INF:
            continue
        refined = joint_root.deep_root(shape, INF)
        with monkeypatch.context() as patch:
            patch.setattr(sync_cells, "CELLS", 0)
            coarse = joint_root.deep_root(shape, INF)
        assert coarse <= refined * (1 + 1e-12) and refined <= least * (1 + 1e-9), (refined, least)
        checked += 1
        raised += refined > coarse * (1 + 1e-6)
    assert checked > 0 and raised > 0



def fewest_length_widths(
    shape: BatchShape, probes: np.ndarray, per_stage: np.ndarray, stages: np.ndarray,
    heads: np.ndarray | None, low: np.ndarray, high: np.ndarray,
) -> np.ndarray:
    """:func:`last_cells.placed_widths` at the fewest stages' length whatever the block's."""
    return PLACED_WIDTHS(shape, probes, per_stage, stages, heads, np.ones_like(low), high)


PLACED_WIDTHS = last_cells.placed_widths


@pytest.mark.parametrize("without", ["length", "head"])
def test_places_by_length_and_the_head_block_raise_zero_bubble_cells(
    without: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under zero-bubble the cells' knapsack (:mod:`megatron_h2.planner.last_cells`) bounds
    some cells around exact splits above the same knapsack with every block at the places of a
    pipeline of the fewest stages (``length``), or with no block ending the pipeline with the
    head (``head``); both stay below the splits (the test above)."""
    raised = 0
    for bounds, _, _, hi, z in cells_around_splits(cases("zero-bubble", True)):
        with np.errstate(invalid="ignore"):  # as CellBounds: no DP sync, no cap
            per_stage = np.floor(bounds.rates * z * (1 + 1e-9))[None, :]
        per_stage = np.where(np.isinf(bounds.rates)[None, :], np.inf, per_stage)
        args = (bounds.shape, bounds.probes[hi:hi + 1], per_stage, bounds.stages[hi:hi + 1],
                np.array([z]))
        full = last_cells.placed_fill_links(*args)[0]
        with monkeypatch.context() as patch:
            if without == "length":
                patch.setattr(last_cells, "placed_widths", fewest_length_widths)
            else:
                patch.setattr(last_cells, "least_with_last",
                              lambda shape, tables, _: least_over_types(shape, tables))
            less = last_cells.placed_fill_links(*args)[0]
        raised += full > less * (1 + 1e-6)
    assert raised > 0
