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


def logged_steps(calls: list, path: list) -> tuple:
    """Exact steps for a climb: the first logs each neighbour solved in ``calls``; the second
    also each plan faster than the climbed one in ``path`` (the climb's moves)."""

    def step(target, other, _):
        calls.append(other)
        return exact(target, other)

    def recorded(target, other, cutoff):
        found = step(target, other, cutoff)
        if found is not None and found < cutoff:
            path.append((other, found))
        return found

    return step, recorded


def test_a_climb_stops_at_its_goal_and_gives_up_after_its_patience() -> None:
    """A climb with a goal ends at the first plan of the full climb's path faster than the
    goal (the full climb from the same plan passes it), and one with a patience of ``p`` solves
    at most ``p`` neighbours after its last move; from some plan each ends earlier than the
    full climb."""
    early = short = 0
    for seed in range(4):
        cost = small_case(seed)
        run = search_module._Search(cost, SearchOptions(8, time_limit_s=600))
        polish = Polish(exact, lambda: False, lambda: INF)
        for shape in shapes_of(cost, 8):
            plans = sorted((v, s) for s in leaves(run, shape, root_node(shape), set())
                           if (v := exact(shape, s)) is not None)
            if not plans:
                continue
            value, suffix = plans[-1]
            near = lambda t, s: ((t, n) for n in shape_neighbours(t, s))  # noqa: E731
            path, calls = [], []
            step, recorded = logged_steps(calls, path)
            full = polish._climb((shape, suffix, value), recorded, near)
            goal = (value + full[2]) / 2
            first = next(((s, v) for s, v in path if v < goal), None)
            end = polish._climb((shape, suffix, value), step, near, goal=goal)
            assert (end[1], end[2]) == (first if first else (full[1], full[2]))
            early += first is not None and first != path[-1]
            calls.clear()
            end = polish._climb((shape, suffix, value), step, near, patience=3)
            tail = len(calls) - 1 - max((i for i, s in enumerate(calls) if s == end[1]),
                                        default=-1)
            assert end[2] >= full[2] and tail <= 3
            short += end[2] > full[2]
    assert early > 0 and short > 0


def test_a_dive_below_the_cutoff_that_records_nothing_climbs_to_a_plan() -> None:
    """With a cutoff just above one of the fastest plans, dives whose leaves are all at or
    above it record nothing alone (polishing off) but climb from those leaves to a plan below
    it with polishing on (:meth:`Polish.from_dive`); every plan found is below the cutoff at its
    exact step time."""
    climbed = 0
    for seed in (9, 11, 19):
        cost = small_case(seed)
        values = [c.estimate.step_time_s for c in search_module.search(
            cost, SearchOptions(8, top_k=3, time_limit_s=600)).candidates]
        for value in values:
            found = []
            for polish in (False, True):
                options = SearchOptions(8, time_limit_s=600, cutoff_s=value * (1 + 1e-6),
                                        polish=polish, dive_nodes=8)
                run = search_module._Search(cost, options)
                run._dive(run._shapes(own=False))
                found.append(run._best_value())
                for _, _, plan in run.best:
                    assert plan.value < options.cutoff_s
                    shape = BatchShape(cost, 8, plan.micro_batch_size, plan.schedule,
                                       plan.chunks, plan.kinds[plan.blocks[0][0]].dp)
                    assert exact(shape, plan.blocks) == pytest.approx(plan.value, rel=1e-12)
            climbed += found[0] == INF and found[1] < INF
    assert climbed > 0
