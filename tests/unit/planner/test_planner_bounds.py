"""The search's lower bounds (``BatchShape`` with ``_Search._options``) against the exact split
of every pipeline structure below them, on small random clusters: every option's bound is at
most the step time of every closed pipeline it leads to, and the bounds see the stages that hold
the head (its steady term, and under zero-bubble its deferred weight gradients)."""

from __future__ import annotations

import importlib
import random

import pytest

from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.cost_model import CostConfig, CostModel, zero_bubble_share
from megatron_h2.planner.partition import INF
from megatron_h2.planner.search_options import SearchOptions
from megatron_h2.planner.structure import solve_structure
from tests.helpers.planner_models import planner_model

search_module = importlib.import_module("megatron_h2.planner.search")


def small_case(seed: int, vocab: int = 1000) -> CostModel:
    """Two or three chip types, at most 12 chips, tight memory (deterministic per seed)."""
    rng = random.Random(seed)
    chips = tuple(
        ChipType(
            "ABC"[index], "cpu", rng.choice([2, 4]), rng.choice([1, 2]), rng.uniform(0.05, 0.5),
            rng.uniform(3, 12) / 1024, rng.uniform(1, 10), rng.uniform(0.2, 2),
        )
        for index in range(rng.choice([2, 3]))
    )  # fmt: skip
    model = planner_model(rng.choice([4, 5, 6]), 64, 176, 4, 128, vocab, 2)
    config = CostConfig(use_distributed_optimizer=rng.random() < 0.5)
    return CostModel(Cluster(chips, rng.uniform(0.1, 1)), model, config)


def exact_below(run, shape: BatchShape, node, checked: list[int]) -> float:
    """The least exact step time of the closed pipelines below ``node``, asserting on the way
    that no option's bound exceeds the exact step time of any pipeline it leads to."""
    best = INF
    for bound, kind, count in run._options(shape, node):
        if kind < 0:
            split = solve_structure(shape, node.suffix)
            value = split.step_time_s if split is not None else INF
        else:
            links = run._block_links(shape, node, kind, count)
            value = exact_below(run, shape, node.child(shape, kind, count, links), checked)
        if value < INF:
            assert bound <= value * (1 + 1e-9), (node.suffix, kind, count, bound, value)
            checked[0] += 1
        best = min(best, value)
    return best


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
@pytest.mark.parametrize("dp", [1, 2, None])  # one DP degree, and each type its own
@pytest.mark.parametrize("seed", range(3))
def test_bounds_never_exceed_the_exact_split(seed: int, dp: int | None, schedule: str) -> None:
    cost = small_case(seed)
    run = search_module._Search(cost, SearchOptions(8, top_k=10**6))
    checked = [0]
    for mbs in (1, 2):
        shape = BatchShape(cost, 8, mbs, schedule, 1, dp)
        if not shape.kinds:
            continue
        shape.build_grid(shape.w_max, 64)
        least = exact_below(run, shape, search_module._root(shape), checked)
        assert shape.root_bound() <= least * (1 + 1e-9)
    assert checked[0] > 0 or dp is None  # some pipelines fit (own DP may leave none)


def test_the_head_stage_bounds_the_steady_term_and_the_tail() -> None:
    """A large vocabulary: the last stage's head weighs more than a layer. Below a suffix, the
    largest steady term is at least (m - 1) x (head + one layer) on its last stage's kind, and
    under zero-bubble the end-of-step term at least (1 + b) x the head's and one layer's weight
    gradients."""
    cost = small_case(1, vocab=16000)
    for schedule in ("1f1b", "zero-bubble"):
        shape = BatchShape(cost, 8, 1, schedule, 1, 1)
        shape.build_grid(shape.w_max, 64)
        for kind, k in enumerate(shape.kinds):
            costs, node = k.costs, search_module._root(shape)
            head = costs.head_forward + costs.head_backward
            assert head > costs.layer_time(0)  # the case this test is about
            node = node.child(shape, kind, 1, 0.0)
            steady = (k.micro_batches - 1) * (head + costs.layer_time(0))
            assert search_module._need(shape, node) >= steady * (1 - 1e-12) > 0
            if schedule == "zero-bubble":
                share = 1 + zero_bubble_share(max(shape.positions, 2), k.micro_batches)
                grads = share * (costs.head_weight_grad + costs.layer_weight_grad)
                assert shape.sync_bound(node.suffix, 0, kind) >= grads * (1 - 1e-12)
