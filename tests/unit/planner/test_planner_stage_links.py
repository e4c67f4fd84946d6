"""The new stages that unused chip types add (:mod:`megatron_h2.planner.stage_links`): their
least link time and least number never above those of any choice of one kind and a stage count
per unused type that holds the units (each type's blocks at the lead in front of the suffix,
where its stages hold the most), every option's bound on clusters of four chip types (1F1B, and
zero-bubble with few micro-batches per replica, whose fill share falls with the stages) never
above the exact split below it, and some bound raised by them."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from megatron_h2.planner import bounds as bounds_module
from megatron_h2.planner import stage_links, suffixes
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.cost_model import CostConfig, CostModel
from megatron_h2.planner.search_options import SearchOptions
from megatron_h2.planner.stage_links import new_stage_floor
from tests.helpers.planner_models import planner_model
from tests.unit.planner.test_planner_bounds import exact_below, search_module


def four_types(seed: int) -> CostModel:
    """Four chip types of 2-6 chips with tight, uneven memory and uneven links."""
    rng = random.Random(1000 + seed)
    chips = tuple(
        ChipType(
            "ABCD"[index], "cpu", rng.choice([2, 4, 6]), rng.choice([1, 2]),
            rng.uniform(0.05, 0.5), rng.uniform(3, 12) / 1024, rng.uniform(0.5, 10),
            rng.uniform(0.05, 2),
        )
        for index in range(4)
    )  # fmt: skip
    model = planner_model(rng.choice([5, 6, 8]), 64, 176, 4, 128, 1000, 2)
    return CostModel(Cluster(chips, rng.uniform(0.05, 1)), model, CostConfig())


def least_links(shape: BatchShape, mask: int, lead: int, units: np.ndarray,
                links: bool = True) -> np.ndarray:
    """Per probe the least summed links ``n l_t`` (or stages ``n``) over every choice, per type
    in ``mask``, of none or one block of one kind and ``n`` stages in front of ``lead`` that
    hold ``units``: each block starting at any warm-up from the lead's on (more than any order
    of the blocks allows: another type's block may sit between a block and the lead)."""
    choices = []
    for t_index, chip in enumerate(shape.types):
        if mask >> t_index & 1:
            most = {0: np.zeros(len(shape.grid))}  # stages -> most held per probe
            for kind in shape.kinds_of[chip]:
                for start in range(shape.start(kind, lead), shape.depth):
                    for n in range(1, min(shape.kinds[kind].max_stages, shape.positions) + 1):
                        held = shape.block(kind, start, np.array([start + n]))[:, 0]
                        most[n] = np.maximum(most.get(n, 0.0), held)
            cost = shape.type_link[chip] if links else 1.0
            choices.append([(held, n * cost) for n, held in most.items()])
    best = np.full(len(shape.grid), np.inf)
    for pick in itertools.product(*choices):
        held = sum(h for h, _ in pick)
        total = sum(c for _, c in pick)
        best = np.where(held >= units - 1e-9, np.minimum(best, total), best)
    return best


SHAPES = [("1f1b", 1, 1), ("1f1b", 2, 1), ("zero-bubble", 1, 1), ("zero-bubble", 2, 1),
          ("interleaved", 1, 2), ("1f1b", None, 1)]  # (schedule, DP degree, chunks)


@pytest.mark.parametrize("schedule,dp,chunks", SHAPES)
@pytest.mark.parametrize("seed", range(2))
def test_the_floor_never_exceeds_the_least_links_of_any_choice(
    seed: int, schedule: str, dp: int | None, chunks: int
) -> None:
    """At every grid lead from 0 on (under zero-bubble the pipeline's last stage may hold less
    than the stage in front of it) and every number of units."""
    cost = four_types(seed)
    shape = BatchShape(cost, 8, 1, schedule, chunks, dp)
    if not shape.kinds:
        pytest.skip("nothing fits")
    shape.build_grid(shape.w_max, 64)
    checked = 0
    for mask in range(1, 1 << len(shape.types)):
        for lead in shape.leads[:4].tolist():
            for units in range(1, shape.layers + 1):
                need = np.full((len(shape.grid), 1), float(units))
                for links in (True, False):
                    floor = new_stage_floor(shape, mask, np.array([lead]), need, links)[:, 0]
                    least = least_links(shape, mask, lead, need[:, 0], links)
                    assert (floor <= least * (1 + 1e-9) + 1e-15).all(), (mask, lead, units)
                    checked += int(np.isfinite(least).sum())
    assert checked > 0


@pytest.mark.parametrize("schedule,batch,chunks", [("1f1b", 8, 1), ("zero-bubble", 8, 1),
                                                  ("zero-bubble", 4, 1), ("interleaved", 8, 2)])
@pytest.mark.parametrize("seed", [0, 1])  # seed 2 (8 layers on 18 chips) takes 10x as long
def test_bounds_of_four_types_never_exceed_the_exact_split(
    seed: int, schedule: str, batch: int, chunks: int
) -> None:
    cost = four_types(seed)
    run = search_module._Search(cost, SearchOptions(batch, top_k=10**6))
    shape = BatchShape(cost, batch, 1, schedule, chunks, 1)
    if not shape.kinds:
        pytest.skip("nothing fits (the layers do not split into equal chunks)")
    shape.build_grid(shape.w_max, 64)
    checked = [0]
    exact_below(run, shape, suffixes.root_node(shape), checked)
    assert checked[0] > 0


@pytest.mark.parametrize("schedule,batch", [("1f1b", 8), ("zero-bubble", 4)])
def test_the_new_stages_raise_some_option_bound(
    monkeypatch: pytest.MonkeyPatch, schedule: str, batch: int
) -> None:
    """Below a first block, some option is bounded higher with the per-type floors than with
    the loose count alone (every new stage at the largest capacity and cheapest link of any
    unused type, and under zero-bubble the fill share of the placed stages), none lower."""
    gains: list[float] = []
    for run, shape, node in first_blocks(schedule, batch):
        tight = {(k, c): b for b, k, c in run._options(shape, node)}
        with monkeypatch.context() as patch:
            patch.setattr(stage_links, "_floor_at", lambda s, m, index, probe, need, links:
                          np.zeros(len(need)))
            loose = {(k, c): b for b, k, c in run._options(shape, node)}
        gains += [tight[key] - loose[key] for key in tight if np.isfinite(tight[key])]
    assert min(gains) >= -1e-12 and max(gains) > 0


def first_blocks(schedule: str, batch: int) -> Iterator[tuple[Any, BatchShape, Any]]:
    """(search, shape, node) below every first block of the one-DP shapes of micro-batch
    size 1 of :func:`four_types` seeds 0-2."""
    for seed in range(3):
        cost = four_types(seed)
        run = search_module._Search(cost, SearchOptions(batch, top_k=10**6))
        shape = BatchShape(cost, batch, 1, schedule, 1, 1)
        shape.build_grid(shape.w_max, 64)
        root = suffixes.root_node(shape)
        for _, kind, count in run._options(shape, root):
            if kind >= 0:
                yield run, shape, root.child(shape, kind, count,
                                             run._block_links(shape, root, kind, count))


def test_dives_order_without_the_per_type_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dive's options (which only order and skip) are bounded as without the per-type count
    of new stages, so the dives find the plans they found before; the best-first options with
    it, higher somewhere."""
    raised = 0
    for run, shape, node in first_blocks("1f1b", 8):
        dive = run._options(shape, node, dive=True)
        tight = run._options(shape, node)
        with monkeypatch.context() as patch:
            patch.setattr(bounds_module, "raise_new_stages", lambda s, t, fill, *a: fill)
            assert run._options(shape, node) == dive
        raised += sum(a[0] > b[0] for a, b in zip(sorted(tight, key=lambda o: o[1:]),
                                                   sorted(dive, key=lambda o: o[1:])))
    assert raised > 0
