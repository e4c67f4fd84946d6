"""What makes the search cheaper leaves it the same search: the coupled sync bound solved only
for the options whose uncoupled bound is below the cutoff (``BatchShape.bound``'s ``cutoff``),
the exact fill only for the options whose floor is below it (:mod:`.bound_columns`), and the
prefix budget (``SearchOptions.max_prefixes``) that benches use to compare two versions
of the search on the same work (``bench/search_fingerprint.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_h2.planner import bounds, search
from megatron_h2.planner.bound_columns import take_columns
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.partition import INF
from megatron_h2.planner.search_options import SearchOptions, SearchResult
from tests.unit.planner.test_planner_bounds import small_case


def fingerprint(result: SearchResult) -> tuple[object, ...]:
    """Everything the search did and found: prefixes, pruned options, splits, bound, plans."""
    s = result.stats
    plans = tuple((c.estimate.step_time_s, c.plan) for c in result.candidates)
    return s.nodes, s.nodes_pruned, s.splits_solved, s.lower_bound_s, s.exhaustive, plans


@pytest.mark.parametrize("seed", [0, 3])  # seeds where skipping too much shows
def test_the_coupled_sync_below_the_cutoff_only_changes_no_decision(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    cost, options = small_case(seed), SearchOptions(8, top_k=2)
    original, skipped = BatchShape.bound, [0]

    def checked(self: BatchShape, *args: object, **kwargs: object) -> np.ndarray:
        cut = original(self, *args, **kwargs)  # type: ignore[arg-type]
        full = original(self, *args[:8], INF, *args[9:], **kwargs)  # type: ignore[arg-type]
        cutoff = args[8] if len(args) > 8 else INF
        same = cut == full
        assert (same | ((cut >= cutoff) & (full >= cutoff))).all()  # pruned either way
        skipped[0] += int((~same).sum())
        return cut

    monkeypatch.setattr(BatchShape, "bound", checked)
    fast = fingerprint(search(cost, options))
    def coupled(self: BatchShape, *args: object, **kwargs: object) -> np.ndarray:
        return original(self, *args[:8], INF, *args[9:], **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(BatchShape, "bound", coupled)
    assert fingerprint(search(cost, options)) == fast  # every column coupled: the same search
    assert skipped[0] > 0  # and the cutoff did skip the coupling somewhere


@pytest.mark.parametrize("seed", range(2))
def test_a_prefix_budget_stops_the_search_the_same_way_each_time(seed: int) -> None:
    cost = small_case(seed)
    whole = search(cost, SearchOptions(8, top_k=2))
    assert whole.stats.exhaustive and whole.stats.nodes > 8
    budget = SearchOptions(8, top_k=2, max_prefixes=8, own_dp="none")
    first, second = search(cost, budget), search(cost, budget)
    assert not first.stats.exhaustive
    assert first.stats.nodes <= whole.stats.nodes
    assert fingerprint(first) == fingerprint(second)


@pytest.mark.parametrize("seed", [0, 3])
def test_the_fill_floors_change_no_bound_below_the_cutoff(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bounds, "FLOOR_SIZE", 0)  # floors in every bound call
    cost, options = small_case(seed), SearchOptions(8, top_k=2)
    original, floored = BatchShape.bound, [0]

    def checked(self: BatchShape, *args: object, **kwargs: object) -> np.ndarray:
        fast = original(self, *args, **kwargs)  # type: ignore[arg-type]
        exact = original(self, *args, **{**kwargs, "floors": False})  # type: ignore[arg-type]
        cutoff = args[8] if len(args) > 8 else INF
        same = fast == exact  # the same floats below the cutoff; pruned either way above it
        assert (same | ((fast >= cutoff) & (exact >= cutoff))).all()
        assert (fast <= exact).all()  # a floor is never above the exact bound
        floored[0] += int((~same).sum())
        return fast

    monkeypatch.setattr(BatchShape, "bound", checked)
    fast = fingerprint(search(cost, options))

    def exact(self: BatchShape, *args: object, **kwargs: object) -> np.ndarray:
        return original(self, *args, **{**kwargs, "floors": False})  # type: ignore[arg-type]

    monkeypatch.setattr(BatchShape, "bound", exact)
    assert fingerprint(search(cost, options)) == fast  # no floors: the same search
    assert floored[0] > 0  # and floors did prune columns somewhere


def test_take_columns_indexes_the_option_axis_only() -> None:
    caps, one = np.arange(12.0).reshape(3, 4), np.arange(3.0)[:, None]
    fixed = [(0.5, caps, np.array([1, 2, 3, 4])), (0.25, one, 2)]
    kept = take_columns(np.array([1, 3]), 4, fixed, 5, np.array([7, 8, 9, 10]), None, 1.5)
    (unit, block, count), (_, single, stages) = kept[0]
    assert unit == 0.5 and block.tolist() == [[1, 3], [5, 7], [9, 11]]
    assert count.tolist() == [2, 4] and single is one and stages == 2
    assert kept[1:] == [5, kept[2], None, 1.5] and kept[2].tolist() == [8, 10]
