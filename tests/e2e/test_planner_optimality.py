"""The search against brute force on the random clusters the fast loop leaves out: the unit
tests of tests/e2e/test_planner_brute_force.py, run on more seeds."""

from __future__ import annotations

import pytest

from tests.e2e.test_planner_brute_force import (
    test_derived_space_reaches_own_dp_plans as derived_space_case,
)
from tests.e2e.test_planner_brute_force import (
    test_search_matches_brute_force_on_random_clusters as search_case,
)


@pytest.mark.e2e
@pytest.mark.parametrize("seed", range(4, 16))  # the unit test runs seeds 0-3
def test_search_matches_brute_force_on_random_clusters(seed: int) -> None:
    search_case(seed)


@pytest.mark.e2e
@pytest.mark.parametrize("seed", [9, 35])  # the unit test runs seed 31
def test_derived_space_reaches_own_dp_plans(seed: int) -> None:
    """Random clusters where re-splits of the best one-DP plans give own-DP plans among the
    best: the search finds the brute-force best of that space, own-DP plans included."""
    derived_space_case(seed)
