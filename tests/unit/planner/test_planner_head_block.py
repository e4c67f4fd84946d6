"""The roots' knapsacks with the block that ends the pipeline among the choices
(:mod:`megatron_h2.planner.head_block`), with a block's links to itself:
the knapsacks against enumerating every choice, the head stage's units against the exact stage
terms, and the roots, which the knapsacks raise on some small random clusters (the tests of
:mod:`.test_planner_uniform_root` and :mod:`.test_planner_own_root` check them against the
exact split of every pipeline)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from megatron_h2.planner import head_block, own_root, uniform_root
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.partition import INF, StageSlot, StageTable
from tests.unit.planner.test_planner_bounds import small_case
from tests.unit.planner.test_planner_own_root import own_shapes
from tests.unit.planner.test_planner_uniform_root import uniform_shapes


def _block_cost(shape: BatchShape, kind: int, stages: int, units: int, last: bool) -> float:
    """Fill and links of a block, ``last`` if it ends the pipeline (its head fill, no link on)."""
    chip = shape.kinds[kind].chip
    cost = units * float(shape.fill_unit[kind]) + (stages - 1) * shape.inner_link[chip]
    return cost + (float(shape.head_time[kind]) if last else shape.outer_link[chip])


def enumerated(shape: BatchShape, blocks: dict[int, list[tuple[int, int, bool]]]) -> float:
    """The least cost over one choice per chip type (none, or a kind's ``blocks`` entry:
    (stages, units, whether it may end the pipeline)), exactly one block the last, the layers
    all held; plus the least embedding fill."""
    best = INF
    options = [[None, *shape.kinds_of[chip]] for chip in shape.types]
    for choice in itertools.product(*options):
        kinds = [kind for kind in choice if kind is not None]
        for picks in itertools.product(*(blocks[kind] for kind in kinds)):
            if sum(units for _, units, _ in picks) != shape.layers:
                continue
            for end, (_, _, may) in enumerate(picks):
                if may:
                    cost = sum(_block_cost(shape, kind, n, x, index == end)
                               for index, (kind, (n, x, _)) in enumerate(zip(kinds, picks)))
                    best = min(best, cost)
    return best + float(shape.embedding_time.min())


def uniform_blocks(shape: BatchShape, caps: np.ndarray, heads: np.ndarray,
                   probe: int) -> dict[int, list[tuple[int, int, bool]]]:
    """Per kind its blocks at one probe: ``n`` stages hold the ``n`` largest capacities, or,
    ending the pipeline, the head stage's units and warm-ups ``1 .. n - 1``."""
    blocks: dict[int, list[tuple[int, int, bool]]] = {}
    for kind in range(len(shape.kinds)):
        row = caps[kind, probe]
        most = min(shape.kinds[kind].max_stages, shape.positions)
        largest = sorted(row, reverse=True)
        blocks[kind] = [(n, x, False) for n in range(1, most + 1)
                        for x in range(1, int(sum(largest[:n])) + 1)]
        if heads[kind, probe] >= 1:
            blocks[kind] += [(n, x, True) for n in range(1, most + 1)
                             for x in range(1, int(heads[kind, probe] + sum(row[1:n])) + 1)]
    return blocks


def own_blocks(shape: BatchShape, caps: np.ndarray, heads: np.ndarray,
               probe: int) -> dict[int, list[tuple[int, int, bool]]]:
    """Per kind its own-DP block at one probe (every stage of the type): up to its stages'
    capacities, or, ending the pipeline, with its warm-up-0 stage's the head stage's units."""
    most, first = shape._most_layers(caps), caps[:, :, 0]
    blocks: dict[int, list[tuple[int, int, bool]]] = {}
    for kind, k in enumerate(shape.kinds):
        n, top = k.max_stages, int(most[kind, probe])
        blocks[kind] = [(n, x, False) for x in range(n, top + 1)]
        if heads[kind, probe] >= 1:
            end = int(top - first[kind, probe] + heads[kind, probe])
            blocks[kind] += [(n, x, True) for x in range(n, end + 1)]
    return blocks


def _matched(shapes: list[BatchShape], points: int, joint_of: Any, blocks_of: Any) -> int:
    """Assert that ``joint_of(shape, caps, probes)`` is the enumeration over ``blocks_of`` at
    every probe of every shape; how many of those were finite."""
    finite = 0
    for shape in shapes:
        probes = np.geomspace(max(shape.w_floor, 1e-12), shape.w_max, points)
        caps = shape.capacity(probes)
        joint = joint_of(shape, caps, probes)
        heads = head_block.head_units(shape, probes, caps[:, :, 0])
        for probe in range(len(probes)):
            expected = enumerated(shape, blocks_of(shape, caps, heads, probe))
            assert joint[probe] == pytest.approx(expected, rel=1e-12) or joint[probe] == expected
            finite += expected < INF
    return finite


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_the_one_dp_knapsack_with_the_last_block_is_the_least_over_every_choice(
        schedule: str) -> None:
    assert _matched(uniform_shapes(range(4), schedule), 4, uniform_root.uniform_fill_links,
                    uniform_blocks) > 0


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_the_own_dp_knapsack_with_the_last_block_is_the_least_over_every_choice(
        schedule: str) -> None:
    def joint(shape: BatchShape, caps: np.ndarray, probes: np.ndarray) -> np.ndarray:
        return own_root.own_fill_links(shape, shape._most_layers(caps), probes, caps[:, :, 0])

    assert _matched(own_shapes(range(8), schedule), 6, joint, own_blocks) > 0


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_the_head_stage_holds_no_more_than_its_units(schedule: str) -> None:
    """A last stage (with the head) whose exact folded steady term is at most the probe and
    whose end-of-step term is at most the top holds at most :func:`head_block.head_units`
    units, and with one unit more than those it breaks one of the two (where its memory holds
    them and the top is finite)."""
    seen, cut = 0, 0
    for seed in range(6):
        for dp in (1, 2):
            shape = BatchShape(small_case(seed), 8, 1, schedule, 1, dp)
            if not shape.kinds or not shape.positions:
                continue
            probes = np.geomspace(max(shape.w_floor, 1e-12), shape.w_max, 5)
            for top in (0.0, float(shape.head_tail.max()), INF):
                free = np.full((len(shape.kinds), len(probes)), float(shape.layers))
                heads = head_block.head_units(shape, probes, free, np.full(len(probes), top))
                for kind, k in enumerate(shape.kinds):
                    slots = [StageSlot(k.costs, False, False), StageSlot(k.costs, False, True)]
                    table = StageTable(slots, shape.layers, [(shape.layers,) * 3] * 2, schedule,
                                       1, k.micro_batches)
                    work, tail = table.work[1], table.tail[1]  # units 0 .. L, the last stage
                    slack = 1 + 1e-9
                    for probe, g in enumerate(probes):
                        fits = [u for u in range(1, shape.layers + 1)
                                if work[u] <= g * slack and tail[u] <= top * slack]
                        most = max(fits, default=0)
                        assert most <= heads[kind, probe], (kind, g, top, most)
                        seen += most > 0
                        cut += heads[kind, probe] < shape.layers and most == heads[kind, probe]
    assert seen > 0 and cut > 0


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_the_last_block_raises_some_root(schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the last block's head stage and links the roots (with the end-of-step levels) rise
    above those whose knapsacks take every block as sending onwards, on some small shape."""
    raised = 0
    shapes = uniform_shapes(range(10), schedule) + own_shapes(range(10), schedule)
    for shape in shapes:
        tight = shape._coupled_root(levels=True)
        with monkeypatch.context() as patch:
            for module in (uniform_root, own_root):  # no heads: every block sends onwards
                patch.setattr(module, "head_units", lambda *args: None)
            loose = shape._coupled_root(levels=True)
        assert loose <= tight * (1 + 1e-9)
        raised += tight > loose * (1 + 1e-6)
    assert raised > 0
