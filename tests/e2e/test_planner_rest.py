"""The bound on what unused chip types can add (``BatchShape.rest``) when masks of many types
are split into halves: it stays an upper bound of the exact programme, and the search with it
still finds the brute-force best plans."""

from __future__ import annotations

import numpy as np
import pytest

import megatron_h2.planner.rest_bound as rest_bound
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.cost_model import CostConfig, CostModel
from megatron_h2.planner.search import SearchOptions, search
from tests.e2e.test_planner_brute_force import brute_force_best, random_case
from tests.helpers.planner_models import planner_model


def five_types() -> CostModel:
    chips = tuple(
        ChipType(name, "cpu", count, 2, tflops, memory / 1024, 4.0, 1.0)
        for name, count, tflops, memory in (
            ("A", 4, 0.4, 3.0), ("B", 2, 0.15, 9.0), ("C", 4, 0.25, 5.0),
            ("D", 2, 0.1, 12.0), ("E", 6, 0.3, 4.0),
        )
    )  # fmt: skip
    model = planner_model(6, 64, 176, 4, 128, 1000, 2)
    return CostModel(Cluster(chips, 0.5), model, CostConfig())


@pytest.mark.parametrize("dp", [1, 2, None])  # uniform DP 1 and 2, and own DP per type
def test_split_masks_bound_the_exact_programme(monkeypatch, dp: int | None) -> None:
    cost = five_types()
    full = (1 << 5) - 1
    values = {}
    for exact in (5, 1):
        monkeypatch.setattr(rest_bound, "EXACT_REST_TYPES", exact)
        shape = BatchShape(cost, 8, 1, "1f1b", 1, dp)
        shape.build_grid(shape.w_max, 64)
        values[exact] = {mask: shape.rest(mask) for mask in range(1, full + 1)}
    for mask in values[5]:
        assert np.all(values[1][mask] >= values[5][mask] - 1e-9)
        if bin(mask).count("1") == 1:
            assert np.array_equal(values[1][mask], values[5][mask])


@pytest.mark.parametrize("seed", range(4))
def test_search_with_split_masks_matches_brute_force(monkeypatch, seed: int) -> None:
    """Every mask of two or more types split: the bound is looser, the plans the same."""
    monkeypatch.setattr(rest_bound, "EXACT_REST_TYPES", 1)
    cost, options = random_case(seed)
    expected = brute_force_best(cost, options, 2, own_dp=options.own_dp)
    found = [c.estimate.step_time_s for c in search(cost, options).candidates]
    assert found == pytest.approx(expected, rel=1e-9)


def test_five_types_same_plans_with_split_masks(monkeypatch) -> None:
    cost = five_types()
    options = SearchOptions(
        8, top_k=3, max_micro_batch_size=1, schedules=("1f1b",), own_dp="none", time_limit_s=600
    )
    found = {}
    for exact in (5, 2):
        monkeypatch.setattr(rest_bound, "EXACT_REST_TYPES", exact)
        result = search(cost, options)
        assert result.stats.exhaustive
        found[exact] = [(c.plan, c.estimate.step_time_s) for c in result.candidates]
    assert found[2] == found[5]
