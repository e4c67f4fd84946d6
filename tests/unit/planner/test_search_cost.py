"""What makes the search cheaper leaves it the same search: the coupled sync bound solved only
for the options whose uncoupled bound is below the cutoff (``BatchShape.bound``'s ``cutoff``),
and the prefix budget (``SearchOptions.max_prefixes``) that benches use to compare two versions
of the search on the same work (``bench/search_fingerprint.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_h2.planner import search
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

    def checked(self: BatchShape, *args: object) -> np.ndarray:
        cut = original(self, *args)  # type: ignore[arg-type]
        full = original(self, *args[:8], INF, *args[9:])  # type: ignore[arg-type]
        cutoff = args[8] if len(args) > 8 else INF
        same = cut == full
        assert (same | ((cut >= cutoff) & (full >= cutoff))).all()  # pruned either way
        skipped[0] += int((~same).sum())
        return cut

    monkeypatch.setattr(BatchShape, "bound", checked)
    fast = fingerprint(search(cost, options))
    def coupled(self: BatchShape, *args: object) -> np.ndarray:
        return original(self, *args[:8], INF, *args[9:])  # type: ignore[arg-type]

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
