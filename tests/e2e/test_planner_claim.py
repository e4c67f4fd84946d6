"""What the search summary claims is true: on small random clusters, for every ``own_dp``
setting, "optimal" is printed only when the brute-force best of the named space is no faster,
and otherwise the printed gap covers the brute-force best of that space (the whole space of
one pipeline with each chip type its own TP and DP, whatever the search searched itself)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_h2.errors import ConfigError
from megatron_h2.planner.report import search_summary
from megatron_h2.planner.search import search
from tests.e2e.test_planner_brute_force import brute_force_best, random_case


@pytest.mark.parametrize("own_dp", ["all", "derived", "none"])
@pytest.mark.parametrize("seed", [1, 9, 31])
def test_the_printed_claim_holds_over_the_named_space(seed: int, own_dp: str) -> None:
    cost, options = random_case(seed)
    options = replace(options, own_dp=own_dp, time_limit_s=600)
    space = "none" if own_dp == "none" else "all"
    optimum = brute_force_best(cost, options, 1, own_dp=space)[0]
    result = search(cost, options)
    line = search_summary(result)
    best = result.best.estimate.step_time_s
    assert result.stats.lower_bound_s <= optimum * (1 + 1e-9)
    if "optimal for the cost model over this space" in line:
        assert best <= optimum * (1 + 1e-9)
    else:
        assert best <= optimum * (1 + result.gap) * (1 + 1e-9)
        assert f"within {100 * result.gap:.1f}%" in line
    mentions_own = "each chip type its own DP degree" in line
    assert mentions_own == (own_dp != "none")


def test_re_splits_change_tp_degrees() -> None:
    """On seed 0 the best re-split runs a chip type at a TP degree that none of the one-DP plans
    it comes from (the search's ``top_k`` best one-DP plans) gives that type; the search finds
    the brute-force best of the re-split space, and it beats every one-DP plan."""
    cost, options = random_case(0)
    options = replace(options, own_dp="derived", time_limit_s=600)
    one_dp = search(cost, replace(options, own_dp="none")).candidates
    seed_tp = {(s.chip, s.tensor_parallel_size) for c in one_dp for s in c.plan.stages}
    expected = brute_force_best(cost, options, 2, own_dp="derived")
    result = search(cost, options)
    assert [c.estimate.step_time_s for c in result.candidates] == pytest.approx(expected, rel=1e-9)
    best = result.best.plan
    assert not best.uniform_dp
    assert {(s.chip, s.tensor_parallel_size) for s in best.stages} - seed_tp
    assert result.best.estimate.step_time_s < one_dp[0].estimate.step_time_s


def test_no_plan_within_the_time_limit_is_not_called_nothing_fits() -> None:
    cost, options = random_case(1)
    with pytest.raises(ConfigError, match="no plan found within the time limit"):
        search(cost, replace(options, time_limit_s=1e-6))
