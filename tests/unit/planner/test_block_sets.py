"""The search by sets of blocks (``megatron_h2.planner.block_sets``) on small random clusters:
every set node's bound is at most the exact step time of every pipeline it leads to (every
order of its blocks and of the blocks it may still take), the sets and their orders reach
every pipeline the ordered search reaches, and the whole search returns the same plans with
and without sets."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from megatron_h2.planner.block_sets import envelope_prefix, free_links
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.partition import INF
from megatron_h2.planner.search import search
from megatron_h2.planner.search_options import SearchOptions
from megatron_h2.planner.structure import solve_structure
from tests.unit.planner.test_planner_bounds import exact_below, small_case

search_module = importlib.import_module("megatron_h2.planner.search")


def exact_below_set(run, shape: BatchShape, node, checked: list[int]) -> float:
    """The least exact step time of the pipelines below the set node ``node`` (its closed sets'
    orders searched as the search does), asserting that no option's bound exceeds it."""
    best = INF
    for bound, kind, count in run._options(shape, node):
        if kind == -3:  # the closed set: every order of its middle blocks
            value = exact_below(run, shape, node.orders(shape), checked)
        elif kind < 0:
            split = solve_structure(shape, node.suffix)
            value = split.step_time_s if split is not None else INF
        elif node.suffix:
            links = free_links(shape, kind, count)
            child = node.set_child(shape, kind, count, links, run.sets.envelope(shape))
            value = exact_below_set(run, shape, child, checked)
        else:  # the last block
            links = run._block_links(shape, node, kind, count)
            value = exact_below_set(run, shape, node.child(shape, kind, count, links), checked)
        if value < INF:
            assert bound <= value * (1 + 1e-9), (node.suffix, kind, count, bound, value)
            checked[0] += 1
        best = min(best, value)
    return best


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble", "interleaved"])
@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_set_bounds_never_exceed_the_exact_split(seed: int, dp: int, schedule: str) -> None:
    cost = small_case(seed)
    run = search_module._Search(cost, SearchOptions(8, top_k=10**6))
    checked = [0]
    for mbs in (1, 2):
        shape = BatchShape(cost, 8, mbs, schedule, 2 if schedule == "interleaved" else 1, dp)
        if not shape.kinds:
            continue
        shape.build_grid(shape.w_max, 64)
        by_sets = exact_below_set(run, shape, search_module._root(shape, True), checked)
        by_orders = exact_below(run, shape, search_module._root(shape), [0])
        assert by_sets == by_orders  # the sets' orders reach every pipeline
    assert checked[0] > 0 or schedule == "interleaved"


def test_a_set_bounds_a_block_anywhere_behind_the_last_one() -> None:
    """The envelope makes a block's capacity from a warm-up at least that of the same block
    from any later warm-up, whatever the table (here one that rises)."""
    caps = np.array([[[1.0, 3.0, 2.0, 0.0]]])  # kind x probe x warm-up
    prefix = np.concatenate((np.zeros((1, 1, 1)), caps.cumsum(axis=2)), axis=2)
    envelope = envelope_prefix(prefix)
    assert np.diff(envelope, axis=2).tolist() == [[[3.0, 3.0, 2.0, 0.0]]]


@pytest.mark.parametrize("seed", range(4))
def test_sets_find_the_same_plans_as_orders(seed: int) -> None:
    cost = small_case(seed)
    values = []
    for sets in (True, False):
        options = SearchOptions(8, top_k=3, own_dp="none", block_sets=sets, time_limit_s=600)
        result = search(cost, options)
        assert result.stats.exhaustive
        values.append([c.estimate.step_time_s for c in result.candidates])
    assert values[0] == pytest.approx(values[1], rel=1e-12)
