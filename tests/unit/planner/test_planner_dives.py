"""The order of the search's short dives (``dives.py``): lazy shapes are prepared before they
are dived into and dived in the order of their prepared root bounds, and the dives' probe grids
top at the best plan found (only the dives change: the search's optimum is checked against
brute force in ``tests/e2e/test_planner_brute_force.py``)."""

from __future__ import annotations

import importlib

import pytest

from megatron_h2.planner.dives import dive_grids, dive_order
from megatron_h2.planner.partition import INF
from megatron_h2.planner.search_options import SearchOptions
from tests.unit.planner.test_planner_bounds import small_case

search_module = importlib.import_module("megatron_h2.planner.search")


def lazy_shapes(seed: int) -> list:
    cost = small_case(seed)
    run = search_module._Search(cost, SearchOptions(8, time_limit_s=600))
    return run._shapes(own=False)


@pytest.mark.parametrize("seed", range(6))
def test_dives_go_lowest_prepared_root_first(seed: int) -> None:
    shapes = lazy_shapes(seed)
    assert any(not shape.prepared for shape in shapes)  # the zero-bubble ones are lazy
    order = list(dive_order(shapes, lambda: INF, lambda: False))
    assert all(shape.prepared for shape in order)
    assert len({id(shape) for shape in order}) == len(order)
    left = [shape for shape in shapes if all(shape is not other for other in order)]
    assert all(shape.root_bound() == INF for shape in left)  # no plan there: never dived
    roots = [shape.root_bound() for shape in order]
    assert roots == sorted(roots)


@pytest.mark.parametrize("seed", range(6))
def test_dives_stop_at_the_cutoff_and_prepare_only_what_may_come_first(seed: int) -> None:
    shapes = lazy_shapes(seed)
    cheap = {id(shape): shape.root_bound() for shape in shapes}
    first = next(dive_order(shapes, lambda: INF, lambda: False))
    cutoff = first.root_bound() * (1 + 1e-12)
    order = list(dive_order(shapes, lambda: cutoff, lambda: False))
    assert all(shape.root_bound() < cutoff for shape in order)
    for shape in shapes:  # a shape whose cheap bound is past the cutoff is never prepared
        if cheap[id(shape)] >= cutoff and shape is not first:
            assert not shape.prepared or shape.root_bound() == cheap[id(shape)]
    assert list(dive_order(shapes, lambda: INF, lambda: True)) == []  # late: no dives


@pytest.mark.parametrize("seed", range(3))
def test_dives_skip_a_shape_whose_sharpened_root_cannot_win(seed: int) -> None:
    shapes = lazy_shapes(seed)
    full = list(dive_order(shapes, lambda: INF, lambda: False))
    raised, sharpened = full[0], []

    def sharpen(shape) -> None:
        sharpened.append(id(shape))
        if shape is raised:
            shape.root_coupled = INF  # as if its cells proved that it cannot win

    assert list(dive_order(shapes, lambda: INF, lambda: False, sharpen)) == full
    assert sharpened == []  # no cutoff yet: nothing to sharpen against
    order = []
    for shape in dive_order(shapes, lambda: 1e30, lambda: False, sharpen):
        assert sharpened.count(id(shape)) == 1  # sharpened once, before its dive
        order.append(shape)
    assert raised not in order and order == full[1:]


def test_dive_grids_top_at_the_best_plan_found() -> None:
    shape = next(s for s in lazy_shapes(0) if s.prepared)
    found = [INF]

    def best() -> float:
        return found[0]

    tops = dive_grids(shape, best)
    assert next(tops) == shape.w_max  # no plan yet: the whole range
    found[0] = 1.5  # that dive found one: dive again on a grid up to it
    assert next(tops) == 1.5
    assert list(tops) == []
    assert list(dive_grids(shape, best)) == [1.5]  # a plan before: one dive, up to it
    found[0] = INF
    assert list(dive_grids(shape, best)) == [shape.w_max]  # none found: no second dive
