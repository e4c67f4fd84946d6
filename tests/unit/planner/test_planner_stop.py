"""What the search gives up at its time limit (``_Search._stop``): the batch shapes it never
reached bound the plans there from below, lowest root bound first, and a shape whose root bound
is not below the lowest bound so far is not bounded further (its tables are not even built),
while one below it is bounded by its root's children, which never lowers its bound."""

from __future__ import annotations

import importlib

import pytest

from megatron_h2.planner import suffixes
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.partition import INF
from megatron_h2.planner.search_options import SearchOptions
from tests.unit.planner.test_planner_bounds import small_case

search_module = importlib.import_module("megatron_h2.planner.search")


def unreached(seed: int) -> tuple[object, list[BatchShape]]:
    """A search with no plan yet and lazy (unprepared) zero-bubble shapes of a small cluster."""
    cost = small_case(seed)
    run = search_module._Search(cost, SearchOptions(8, top_k=1))
    shapes = []
    for mbs in (1, 2):
        for dp in (1, 2):
            plain = BatchShape(cost, 8, mbs, "1f1b", 1, dp)
            shape = BatchShape(cost, 8, mbs, "zero-bubble", 1, dp, lazy=True)
            if shape.kinds and plain.kinds and plain.w_floor < INF:
                shape.pre_bound = shape.cheap_bound(plain.w_floor)
                shapes.append(shape)
    return run, shapes


@pytest.mark.parametrize("seed", range(3))
def test_shapes_that_cannot_lower_the_bound_are_not_bounded_further(seed: int) -> None:
    run, shapes = unreached(seed)
    lowest = min(shape.root_bound() for shape in shapes)
    run.stats.lower_bound_s = lowest  # e.g. from the queue left
    run._stop(suffixes.Left(shapes, [], []))
    assert run.stats.lower_bound_s == lowest
    assert not any(shape.prepared for shape in shapes)
    assert not run.stats.exhaustive


@pytest.mark.parametrize("seed", range(3))
def test_the_lowest_shapes_are_bounded_by_their_roots_children(seed: int) -> None:
    run, shapes = unreached(seed)
    cheap = min(shape.root_bound() for shape in shapes)
    run._stop(suffixes.Left(shapes, [], []))
    first = min(shapes, key=lambda shape: shape.pre_bound)
    assert first.prepared  # the lowest root bound so far was inf: bounded by its root's children
    assert cheap <= run.stats.lower_bound_s < INF
