"""Floors of the suffixes by their last block and their placed blocks
(:mod:`megatron_h2.planner.last_floor`) against the exact split of every pipeline below them
on small random clusters (one-DP and own-DP shapes, every schedule those run, zero-bubble's
micro-batch-1 shapes among them), and that they raise some option's bound above the search's
without them."""

from __future__ import annotations

import importlib

import pytest

from megatron_h2.planner import last_floor, suffixes
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.partition import INF
from megatron_h2.planner.search_options import SearchOptions
from tests.unit.planner.test_planner_bounds import exact_below
from tests.unit.planner.test_planner_own_root import own_shapes
from tests.unit.planner.test_planner_uniform_root import uniform_shapes

search_module = importlib.import_module("megatron_h2.planner.search")


def _shapes(schedule: str, seeds: range) -> list[BatchShape]:
    shapes = uniform_shapes(seeds, schedule)
    return shapes + (own_shapes(seeds, schedule) if schedule != "interleaved" else [])


def _all_bounds(run, shape: BatchShape, node, out: dict) -> None:
    """Every option bound below ``node``, into ``out`` by (suffix, kind, count)."""
    for bound, kind, count in run._options(shape, node):
        out[node.suffix, kind, count] = bound
        if kind >= 0:
            links = run._block_links(shape, node, kind, count)
            _all_bounds(run, shape, node.child(shape, kind, count, links), out)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble", "interleaved"])
@pytest.mark.parametrize("slack", [INF, 1.02])
def test_no_floor_exceeds_the_exact_split_below_it(
    schedule: str, slack: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the floors kept for a cutoff far above every plan (every cell) or just above the
    shape's best (the cells below it only), no option's bound exceeds the exact step time of a
    closed pipeline below it (``exact_below`` asserts it at every node; every suffix floor
    computed, none given up)."""
    monkeypatch.setattr(last_floor, "TRIAL", 10**9)
    checked = 0
    for shape in _shapes(schedule, range(8)):
        run = search_module._Search(shape.cost, SearchOptions(8, top_k=10**6))
        shape.build_grid(shape.w_max, 64)
        shape.tighten()
        least = exact_below(run, shape, suffixes.root_node(shape), [0])
        if least == INF:
            continue
        cutoff = 1e9 if slack == INF else least * slack
        run = search_module._Search(shape.cost, SearchOptions(8, top_k=10**6, cutoff_s=cutoff))
        last_floor.prepare_last_floors(shape, cutoff)
        counted = [0]
        assert exact_below(run, shape, suffixes.root_node(shape), counted) == least
        checked += counted[0] > 0
    assert checked > 0


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_the_floors_raise_some_option(schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On some small shape some option's bound is higher with the floors than without them,
    none lower (the floors computed only when asked, every suffix floor)."""
    monkeypatch.setattr(last_floor, "DEFER", 10**9)
    monkeypatch.setattr(last_floor, "TRIAL", 10**9)
    raised = 0
    for shape in _shapes(schedule, range(6)):
        run = search_module._Search(shape.cost, SearchOptions(8, top_k=10**6, cutoff_s=1e9))
        shape.build_grid(shape.w_max, 64)
        shape.tighten()
        before: dict = {}
        _all_bounds(run, shape, suffixes.root_node(shape), before)
        last_floor.prepare_last_floors(shape, 1e9)
        after: dict = {}
        _all_bounds(run, shape, suffixes.root_node(shape), after)
        assert before.keys() == after.keys()
        assert all(before[key] <= after[key] * (1 + 1e-12) for key in before)
        raised += any(after[key] > before[key] * (1 + 1e-6) for key in before)
    assert raised > 0


def test_floors_come_at_the_deferred_expansion_and_stop_where_they_do_not_prune(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shape's floors are computed at its :data:`last_floor.DEFER`-th expansion, not before;
    its suffix floors stop after :data:`last_floor.TRIAL` of them where none prunes (a cutoff
    far above every plan), and go on where they do."""
    shape = next(s for s in _shapes("zero-bubble", range(12)) if s.layers > 3)
    run = search_module._Search(shape.cost, SearchOptions(8, top_k=10**6, cutoff_s=1e9))
    shape.build_grid(shape.w_max, 64)
    root = suffixes.root_node(shape)
    for _ in range(last_floor.DEFER - 1):
        run._options(shape, root)
    assert "_last_floors" not in shape.__dict__
    run._options(shape, root)
    assert "_last_floors" in shape.__dict__
    calls = [0]
    real = last_floor.node_floor

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(last_floor, "node_floor", counted)
    child = next((k, c) for _, k, c in run._options(shape, root) if k >= 0)
    node = root.child(shape, *child, run._block_links(shape, root, *child))
    for _ in range(2 * last_floor.TRIAL):
        run._options(shape, node)
    assert last_floor.TRIAL <= calls[0] < 2 * last_floor.TRIAL
    shape._floor_tries = [0, 0]  # now as if every one had pruned
    monkeypatch.setattr(last_floor, "node_floor", lambda *args: (counted(*args), 2e9)[1])
    before = calls[0]
    for _ in range(2 * last_floor.TRIAL):
        run._options(shape, node)
    assert calls[0] - before >= 2 * last_floor.TRIAL
