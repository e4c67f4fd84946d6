"""The local improvement of found plans (``improve.py``): every neighbour is a closed pipeline
of its batch shape's plan space (the branch and bound's own leaves, enumerated) and the
two-block moves are among them, a climb ends at a plan no neighbour beats, and the search
finds the same optimum with and without it."""

from __future__ import annotations

import importlib

import pytest

from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.improve import KICK_REACH, Polish, shape_neighbours
from megatron_h2.planner.partition import INF
from megatron_h2.planner.search_options import SearchOptions
from megatron_h2.planner.structure import solve_structure
from megatron_h2.planner.suffixes import root_node
from tests.unit.planner.test_planner_bounds import small_case

search_module = importlib.import_module("megatron_h2.planner.search")


def leaves(run, shape: BatchShape, node, out: set) -> set:
    """Every closed pipeline below ``node`` (the search's tree, nothing pruned)."""
    for _, kind, count in run._options(shape, node):
        if kind < 0:
            out.add(node.suffix)
        else:
            links = run._block_links(shape, node, kind, count)
            leaves(run, shape, node.child(shape, kind, count, links), out)
    return out


def shapes_of(cost, gbs: int) -> list[BatchShape]:
    """One-DP shapes (every DP degree, 1F1B and zero-bubble) and the own-DP ones."""
    out = []
    for schedule in ("1f1b", "zero-bubble"):
        for dp in (1, 2, None):
            shape = BatchShape(cost, gbs, 1, schedule, 1, dp)
            if shape.kinds:
                shape.build_grid(shape.w_max, 16)
                out.append(shape)
    return out


def two_moves(suffix) -> set:
    """``suffix`` with one block dropped or a stage longer or shorter and another block a stage
    longer or shorter (what :func:`shape_neighbours` must offer under one DP degree)."""
    out = set()
    for i, (kind, count) in enumerate(suffix):
        for first in (0, count - 1, count + 1):
            for j, (other, other_count) in enumerate(suffix):
                for second in (other_count - 1, other_count + 1):
                    if j != i:
                        blocks = list(suffix)
                        blocks[i], blocks[j] = (kind, first), (other, second)
                        out.add(tuple(b for b in blocks if b[1]))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_every_neighbour_is_a_plan_of_the_shape(seed: int) -> None:
    cost = small_case(seed)
    run = search_module._Search(cost, SearchOptions(8, time_limit_s=600))
    checked = pairs = 0
    for shape in shapes_of(cost, 8):
        space = leaves(run, shape, root_node(shape), set())
        for suffix in space:
            near = shape_neighbours(shape, suffix)
            assert suffix not in near and len(set(near)) == len(near)
            assert set(near) <= space, (shape.schedule, shape.dp, suffix, set(near) - space)
            wanted = two_moves(suffix) & space - {suffix} if shape.uniform else set()
            assert wanted <= set(near), (shape.dp, suffix, wanted - set(near))  # two moves
            pairs += len(wanted)
            checked += len(near)
    assert checked > 0 and pairs > 0


def exact(shape: BatchShape, suffix) -> float | None:
    split = solve_structure(shape, suffix)
    return None if split is None else split.step_time_s


@pytest.mark.parametrize("seed", range(6))
def test_a_climb_ends_where_no_neighbour_is_faster(seed: int) -> None:
    cost = small_case(seed)
    run = search_module._Search(cost, SearchOptions(8, time_limit_s=600))
    shapes = shapes_of(cost, 8)
    polish = Polish(exact, lambda: False, lambda: INF, budget=10_000)
    polish.register(shapes)
    climbed = 0
    for shape in shapes:
        plans = [(v, s) for s in leaves(run, shape, root_node(shape), set())
                 if (v := exact(shape, s)) is not None]
        if not plans:
            continue
        value, suffix = max(plans)  # the slowest plan that fits
        end_shape, end, reached = polish.improve(shape, suffix, value)
        assert reached <= value and exact(end_shape, end) == pytest.approx(reached, rel=1e-12)
        for other_shape, other in polish._neighbours(end_shape, end):
            step = exact(other_shape, other)
            assert step is None or step >= reached
        climbed += reached < value
    assert climbed > 0  # some climb improved its plan


@pytest.mark.parametrize("seed", range(8))
def test_the_search_finds_the_same_optimum_with_and_without_it(seed: int) -> None:
    cost = small_case(seed)
    results = []
    for polish in (True, False):
        result = search_module.search(cost, SearchOptions(8, time_limit_s=600, polish=polish))
        assert result.stats.exhaustive
        results.append(result.best.estimate.step_time_s)
    assert results[0] == pytest.approx(results[1], rel=1e-12)


def test_kicks_reach_faster_plans_than_the_climb_alone() -> None:
    """A kick (its plan moved into a shape of another micro-batch size or DP degree and
    climbed there from a slower start) never ends slower than the climb alone, its plan is a
    closed pipeline of its shape with its exact step time, and from some plan it ends faster
    (the climbs here start from the three slowest plans of each shape)."""
    faster = 0
    for seed in range(6):
        cost = small_case(seed)
        run = search_module._Search(cost, SearchOptions(8, time_limit_s=600))
        shapes = shapes_of(cost, 8)
        space = {id(shape): leaves(run, shape, root_node(shape), set()) for shape in shapes}
        alone, kicked = (Polish(exact, lambda: False, lambda: INF, kicks=k) for k in (0, 3))
        for polish in (alone, kicked):
            polish.register(shapes)
        for shape in shapes:
            plans = sorted((v, s) for s in space[id(shape)] if (v := exact(shape, s)) is not None)
            for value, suffix in plans[-3:]:
                _, _, reached = alone.improve(shape, suffix, value)
                end_shape, end, best = kicked.improve(shape, suffix, value)
                assert best <= reached and end in space[id(end_shape)]
                assert exact(end_shape, end) == pytest.approx(best, rel=1e-12)
                faster += best < reached
    assert faster > 0


def test_a_dive_that_found_nothing_climbs_from_its_leaves() -> None:
    """From a dive's closed pipelines all slower than the best plan so far, the climb within
    the shape (:meth:`Polish.from_dive`) returns a closed pipeline of the shape faster than that
    plan, at its exact step time, or nothing; from some it finds one (each shape's slowest plans
    within reach of its fourth-fastest as the leaves, the fourth-fastest as the best)."""
    found = 0
    for seed in range(6):
        cost = small_case(seed)
        run = search_module._Search(cost, SearchOptions(8, time_limit_s=600))
        shapes = shapes_of(cost, 8)
        polish = Polish(exact, lambda: False, lambda: INF)
        polish.register(shapes)
        for shape in shapes:
            plans = sorted((v, s) for s in leaves(run, shape, root_node(shape), set())
                           if (v := exact(shape, s)) is not None)
            if len(plans) < 5:
                continue
            value = plans[3][0]
            slower = [s for v, s in plans if value < v <= KICK_REACH * value][-3:]
            point = polish.from_dive(shape, slower, value)
            if point is not None:
                end_shape, end, best = point
                assert end_shape is shape and best < value
                assert exact(shape, end) == pytest.approx(best, rel=1e-12)
                found += 1
    assert found > 0
