"""The search over data-parallel pipelines against brute force on small clusters: every grouping
of the chip types, every batch split in whole micro-batches, every pipeline's best plan by the
one-pipeline brute-force enumerator, evaluated with the pipelines cost model.

The search gives each pipeline the plan fastest for its share alone; plans tied in that (a
single micro-batch gives every layer split of a stage count the same step) can differ in the
gradient exchange, which the search does not weigh. The brute-force cases therefore make the
exchange negligible (links of 1e6 GB/s, no latency) and check the groupings and splits;
test_pipelines_cost.py checks the exchange itself."""

from __future__ import annotations

import itertools
import random

import pytest

from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.cost_model import CostConfig, CostModel
from megatron_h2.planner.pipelines_cost import evaluate_pipelines, exchange_floor_s
from megatron_h2.planner.pipelines_search import (
    compositions,
    groupings,
    lower_bound_s,
    proportional,
    search_pipelines,
)
from megatron_h2.planner.search import SearchOptions, search
from tests.e2e.test_planner_brute_force import Enumerator
from tests.helpers.planner_models import planner_model


def label_groupings(names: list[str]) -> set[frozenset[frozenset[str]]]:
    """Every partition of ``names`` into two or more groups, by labelling each type."""
    out = set()
    for labels in itertools.product(range(len(names)), repeat=len(names)):
        groups: dict[int, set[str]] = {}
        for name, label in zip(names, labels):
            groups.setdefault(label, set()).add(name)
        if len(groups) > 1:
            out.add(frozenset(frozenset(g) for g in groups.values()))
    return out


def test_groupings_are_every_partition_up_to_four_types() -> None:
    for count in (2, 3, 4):
        names = list("ABCD"[:count])
        found = {frozenset(frozenset(g) for g in grouping) for grouping in groupings(names)}
        assert found == label_groupings(names)
        assert len(groupings(names)) == len(found)  # no grouping twice
    assert groupings(["A"]) == []
    # beyond four types: one pipeline per type, and each type apart from the rest
    assert len(groupings(list("ABCDEF"))) == 7


def test_proportional_split_is_whole_and_positive() -> None:
    assert proportional(8, [3.0, 1.0]) == (6, 2)
    assert proportional(5, [1.0, 1.0, 1.0]) in {(2, 2, 1), (2, 1, 2), (1, 2, 2)}
    assert proportional(3, [100.0, 1.0, 1.0]) == (1, 1, 1)
    assert sorted(compositions(4, 2)) == [(1, 3), (2, 2), (3, 1)]


def every_split(cost: CostModel, options: SearchOptions):  # type: ignore[no-untyped-def]
    """Every plan of pipelines over every grouping, split and micro-batch size, each pipeline's
    plan the enumerator's fastest for its chip types and share (splits where one has none are
    left out)."""
    names = cost.cluster.names
    fastest: dict[tuple, HeteroPlan | None] = {}
    for mbs in options.micro_batch_candidates():
        total = options.global_batch_size // mbs
        for partition in label_groupings(names):
            groups = [tuple(n for n in names if n in g) for g in partition]
            for split in compositions(total, len(groups)):
                keys = [(group, mbs, n) for group, n in zip(groups, split)]
                for key in keys:
                    if key not in fastest:
                        fastest[key] = fastest_plan(cost, *key)
                plans = [fastest[key] for key in keys]
                if None not in plans:
                    yield HeteroPlan.of_pipelines(plans)


def brute_force(cost: CostModel, options: SearchOptions) -> float:
    """Best step over :func:`every_split`."""
    return min((evaluate_pipelines(cost, plan).step_time_s
                for plan in every_split(cost, options)), default=float("inf"))


def fastest_plan(cost: CostModel, group: tuple[str, ...], mbs: int, micro_batches: int
                 ) -> HeteroPlan | None:
    """The enumerator's fastest plan of one pipeline on ``group`` for ``micro_batches``."""
    sub = CostModel(cost.cluster.subset(group), cost.model, cost.config)
    options = SearchOptions(mbs * micro_batches, 1, (mbs,), own_dp="all")
    found = min(Enumerator(sub, options).plans(), key=lambda item: item[0], default=None)
    return None if found is None else HeteroPlan(*found[2][:5], schedule=found[2][5])


def chip(name: str, count: int, per_node: int, tflops: float, memory_mib: float,
         slowdown: float = 1.0, inter: float = 1.0) -> ChipType:
    return ChipType(name, "cpu", count, per_node, tflops, memory_mib / 1024, 4.0, inter, slowdown)


def random_case(seed: int, slow_links: bool = False) -> tuple[CostModel, SearchOptions]:
    """A small random cluster; links so fast that the exchange is negligible unless
    ``slow_links`` (then a few GB/s and a latency: the exchange weighs)."""
    rng = random.Random(seed)
    types = rng.choice([2, 3])
    chips = tuple(chip("ABC"[i], rng.choice([1, 2, 4]), rng.choice([1, 2]),
                       rng.uniform(0.05, 0.5), rng.uniform(3, 12),
                       inter=rng.uniform(0.01, 0.1) if slow_links else 1e6)
                  for i in range(types))
    model = planner_model(rng.choice([4, 6]), 64, 176, 4, 128, 1000, 2)
    latency = 1e-4 if slow_links else 0.0
    config = CostConfig(use_distributed_optimizer=rng.random() < 0.5, p2p_latency_s=latency,
                        collective_latency_s=latency)
    options = SearchOptions(rng.choice([4, 6, 8]), 1, max_micro_batch_size=2, own_dp="all")
    cross = rng.uniform(0.01, 0.1) if slow_links else 1e6
    return CostModel(Cluster(chips, cross), model, config), options


@pytest.mark.parametrize("seed", range(6))
def test_search_matches_brute_force_on_random_clusters(seed: int) -> None:
    cost, options = random_case(seed)
    result = search_pipelines(cost, options)
    expected = brute_force(cost, options)
    assert result.exhaustive
    if expected == float("inf"):  # no grouping fits
        assert result.best is None and "fits in memory" in result.reason
        return
    assert result.best is not None
    assert result.best.estimate.step_time_s == pytest.approx(expected, rel=1e-5)
    assert result.best.estimate.exchange_s < 1e-5 * expected
    plan = result.best.plan
    assert plan.num_pipelines == len(result.best.groups) >= 2
    assert sum(p.global_batch_size for p in plan.pipelines) == options.global_batch_size
    assert all(p.global_batch_size % plan.micro_batch_size == 0 for p in plan.pipelines)


def test_large_batch_falls_back_to_a_local_search_and_says_so() -> None:
    cluster = Cluster((chip("A", 2, 2, 0.4, 12.0), chip("B", 2, 2, 0.1, 12.0)), 0.5)
    cost = CostModel(cluster, planner_model(4, 64, 176, 4, 128, 1000, 2), CostConfig())
    options = SearchOptions(256, 1, (1,))  # 255 splits of 256 micro-batches
    result = search_pipelines(cost, options)
    assert not result.exhaustive
    assert result.best is not None
    shares = [p.global_batch_size for p in result.best.plan.pipelines]
    # A computes four times as fast: the split follows the speeds
    assert shares[0] > 3 * shares[1]


@pytest.mark.parametrize("seed", range(6))
def test_lower_bound_holds_for_every_plan_on_random_clusters(seed: int) -> None:
    """No plan beats :func:`lower_bound_s`: not any plan of one pipeline the enumerator lists
    (every recompute mode), nor any plan of pipelines (each at least its slowest pipeline's
    fastest plan for its share, over every grouping and split); and the bound of an exhaustive
    search lies between it and the best plan of pipelines."""
    cost, options = random_case(seed)
    bound = lower_bound_s(cost, options)
    assert 0 < bound < float("inf")
    one = min((step for step, _, _ in Enumerator(cost, options).plans(all_modes=True)),
              default=float("inf"))
    assert bound <= one * (1 + 1e-9)
    # the least over the splits of their slowest pipeline's fastest step
    floor = min((max(e.step_time_s for e in evaluate_pipelines(cost, plan).pipelines)
                 for plan in every_split(cost, options)), default=float("inf"))
    assert bound <= floor * (1 + 1e-9)
    result = search_pipelines(cost, options)
    assert result.exhaustive and result.lower_bound_s == pytest.approx(max(bound, floor))
    if result.best is not None:
        assert result.lower_bound_s <= result.best.estimate.step_time_s * (1 + 1e-9)


@pytest.mark.parametrize("seed", [0, 1, 3, 5, 7, 8])  # seeds where some grouping fits
def test_incumbent_cuts_off_only_splits_that_cannot_beat_it(seed: int) -> None:
    """Given the step to beat, the search finds the brute force's best when it is faster, and
    otherwise none, with a proven bound of at least the step to beat."""
    cost, options = random_case(seed)
    expected = brute_force(cost, options)
    if expected == float("inf"):
        pytest.skip("no grouping fits")
    found = search_pipelines(cost, options, incumbent_s=1.05 * expected)
    assert found.exhaustive and found.best is not None
    assert found.best.estimate.step_time_s == pytest.approx(expected, rel=1e-5)
    beaten = search_pipelines(cost, options, incumbent_s=0.95 * expected)
    assert beaten.exhaustive and beaten.best is None and beaten.splits_cut > 0
    assert "none beats one pipeline for all" in beaten.reason
    assert 0.95 * expected * (1 - 1e-9) <= beaten.lower_bound_s <= expected * (1 + 1e-9)


def every_plan(cost: CostModel, group: tuple[str, ...], mbs: int, micro_batches: int
               ) -> list[HeteroPlan]:
    """Every plan of one pipeline on ``group`` for ``micro_batches`` (every recompute mode)."""
    sub = CostModel(cost.cluster.subset(group), cost.model, cost.config)
    options = SearchOptions(mbs * micro_batches, 1, (mbs,), own_dp="all")
    return [HeteroPlan(*item[2][:5], schedule=item[2][5])
            for item in Enumerator(sub, options).plans(all_modes=True)]


@pytest.mark.parametrize("seed", [0, 1, 5, 6, 7, 10])  # seeds where some grouping fits
def test_exchange_floor_and_cut_bound_hold_for_plans_of_pipelines(seed: int) -> None:
    """With slow links (the exchange weighs): no plan of pipelines, each pipeline any plan the
    enumerator lists for its share (up to 64 combinations per split, drawn at random), has a
    smaller exchange than :func:`exchange_floor_s` of its grouping, nor a step under the bound
    the search proves, given a step to beat that cuts splits off."""
    cost, options = random_case(seed, slow_links=True)
    rng = random.Random(seed)
    names = cost.cluster.names
    one = search(cost, options).best.estimate.step_time_s
    result = search_pipelines(cost, options, incumbent_s=0.9 * one)
    assert result.exhaustive and result.splits_cut > 0
    least = float("inf")
    for mbs in options.micro_batch_candidates():
        total = options.global_batch_size // mbs
        for grouping in groupings(names):
            floor = exchange_floor_s(cost, grouping)
            assert floor > 0
            for split in compositions(total, len(grouping)):
                plans = [every_plan(cost, g, mbs, n) for g, n in zip(grouping, split)]
                if not all(plans):
                    continue
                combos = list(itertools.product(*(range(len(p)) for p in plans)))
                for combo in rng.sample(combos, min(64, len(combos))):
                    plan = HeteroPlan.of_pipelines([p[i] for p, i in zip(plans, combo)])
                    estimate = evaluate_pipelines(cost, plan)
                    assert estimate.exchange_s >= floor * (1 - 1e-9)
                    least = min(least, estimate.exchange_s / floor)
                    assert estimate.step_time_s >= result.lower_bound_s * (1 - 1e-9)
    if least == float("inf"):
        pytest.skip("no plan of pipelines fits")
    assert least < 4  # the floor is of the exchange's scale, not vacuous
