"""The own-DP root bound with the fill and links joint over the chip types' kinds
(:mod:`megatron_h2.planner.own_root`): its knapsack against enumerating every choice, and the
root bound against the exact split of every pipeline of the shape on small random clusters."""

from __future__ import annotations

import importlib
import itertools

import numpy as np
import pytest

from megatron_h2.planner import own_root, suffixes
from megatron_h2.planner.block_links import block_links, last_link
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.partition import INF
from megatron_h2.planner.search_options import SearchOptions
from tests.unit.planner.test_planner_bounds import exact_below, small_case

search_module = importlib.import_module("megatron_h2.planner.search")


def own_shapes(seeds: range, schedule: str) -> list[BatchShape]:
    """The own-DP shapes of micro-batch sizes 1 and 2 of :func:`small_case` ``seeds`` with
    some stage kind."""
    shapes = [BatchShape(small_case(seed), 8, mbs, schedule, 1, None)
              for seed in seeds for mbs in (1, 2)]
    return [shape for shape in shapes if shape.kinds and shape.positions]


def enumerated(shape: BatchShape, most: np.ndarray, probe: int) -> float:
    """:func:`own_root.own_fill_links` at one probe by trying every kind (or none) per type
    and every layer count of each chosen block."""
    best = INF
    options = [[None, *shape.kinds_of[chip]] for chip in shape.types]
    for choice in itertools.product(*options):
        kinds = [kind for kind in choice if kind is not None]
        ranges = [range(shape.kinds[k].max_stages, int(most[k, probe]) + 1) for k in kinds]
        for units in itertools.product(*ranges):
            if sum(units) != shape.layers:
                continue
            cost = sum(x * float(shape.fill_unit[k])
                       + block_links(shape, shape.kinds[k].chip, shape.kinds[k].max_stages)
                       for k, x in zip(kinds, units))
            best = min(best, cost)
    edges = float(shape.head_time.min() + shape.embedding_time.min())
    return best - last_link(shape) + edges


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_the_knapsack_is_the_least_over_every_choice(schedule: str) -> None:
    shapes = own_shapes(range(8), schedule)
    finite = 0
    for shape in shapes:
        probes = np.geomspace(max(shape.w_floor, 1e-12), shape.w_max, 6)
        most = shape._most_layers(shape.capacity(probes))
        joint = own_root.own_fill_links(shape, most)
        for probe in range(len(probes)):
            expected = enumerated(shape, most, probe)
            assert joint[probe] == pytest.approx(expected, rel=1e-12) or joint[probe] == expected
            finite += expected < INF
    assert finite > 0


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_the_own_dp_root_bound_never_exceeds_the_exact_split_and_rises(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every own-DP root bound is at most the best exact split below the root, and on some
    shape the joint terms raise it above the root bound without them."""
    checked, raised = 0, 0
    for shape in own_shapes(range(12), schedule):
        run = search_module._Search(shape.cost, SearchOptions(8, top_k=10**6))
        shape.build_grid(shape.w_max, 64)
        shape.tighten()  # the end-of-step levels too (uniform_root.sync_levels)
        least = exact_below(run, shape, suffixes.root_node(shape), [0])
        if least < INF:
            assert shape.root_bound() <= least * (1 + 1e-9), (shape.root_bound(), least)
            checked += 1
        with monkeypatch.context() as patch:
            patch.setattr(own_root, "own_fill_links", lambda s, most: np.zeros(most.shape[1]))
            loose = shape._coupled_root(levels=True)
        raised += shape.root_coupled > loose * (1 + 1e-6)
    assert checked > 0 and raised > 0


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_no_option_is_bounded_below_its_shapes_root(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every plan below a node is one of its shape's, so every option's bound is at least the
    shape's root bound (by the test above, still never above the exact split): with the root
    bound set to the shape's exact best (the tightest valid one), no option is below it."""
    lifted = 0
    for shape in own_shapes(range(6), schedule):
        run = search_module._Search(shape.cost, SearchOptions(8, top_k=10**6))
        shape.build_grid(shape.w_max, 64)
        node = suffixes.root_node(shape)
        least = exact_below(run, shape, node, [0])
        if least == INF:
            continue
        before = min(bound for bound, _, _ in run._options(shape, node))
        monkeypatch.setattr(shape, "root_bound", lambda least=least: least)
        assert min(bound for bound, _, _ in run._options(shape, node)) >= least
        lifted += before < least
    assert lifted > 0
