"""--compare-homogeneous is fair: each chip type alone gets the same search, schedules included."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_h2.planner.cluster import Cluster
from megatron_h2.planner.compare import compare_homogeneous
from megatron_h2.planner.cost_model import CostConfig, CostModel
from megatron_h2.planner.model_input import model_from_yaml
from megatron_h2.planner.search import SearchOptions, search
from tests.helpers.paths import ROOT

CLUSTER = Cluster.from_yaml(ROOT / "examples/clusters/cpu_2types.yaml")
MODEL = model_from_yaml(ROOT / "examples/models/tiny.yaml")


@pytest.mark.parametrize(
    "schedules", [("1f1b",), ("interleaved",), ("1f1b", "interleaved", "zero-bubble")]
)
def test_each_chip_type_alone_gets_the_same_schedule_choices(schedules: tuple[str, ...]) -> None:
    cost = CostModel(CLUSTER, MODEL, CostConfig())
    options = SearchOptions(16, top_k=2, schedules=schedules)
    together = search(cost, options).best
    comparison = compare_homogeneous(cost, options, together.estimate.tokens_per_s)
    for result in comparison.homogeneous:
        alone = CostModel(CLUSTER.subset([result.chip]), MODEL, CostConfig())
        best = search(alone, replace(options, top_k=1)).best
        assert result.candidate is not None
        assert result.candidate.plan.schedule in schedules
        assert result.tokens_per_s == pytest.approx(best.estimate.tokens_per_s, rel=1e-12)
    assert comparison.ratio == pytest.approx(
        together.estimate.tokens_per_s / sum(r.tokens_per_s for r in comparison.homogeneous)
    )


def test_more_schedules_never_make_a_chip_type_alone_slower() -> None:
    tight = Cluster.from_dict(  # neither type holds the model on one stage: both pipeline alone
        {
            "chips": {
                name: {"device": "cpu", "count": 8, "chips_per_node": 2, "tflops_bf16": 0.2,
                       "memory_gib": memory, "intra_node_gb_per_s": 5, "inter_node_gb_per_s": 1}
                for name, memory in (("a", 0.04), ("b", 0.05))
            },
            "cross_chip_gb_per_s": 1,
        }
    )  # fmt: skip
    cost = CostModel(tight, MODEL, CostConfig())
    only = compare_homogeneous(cost, SearchOptions(16, top_k=1, schedules=("1f1b",)), 1.0)
    every = compare_homogeneous(cost, SearchOptions(16, top_k=1), 1.0)
    for a, b in zip(only.homogeneous, every.homogeneous):
        assert b.tokens_per_s >= a.tokens_per_s * (1 - 1e-12)
    assert every.homogeneous_sum > only.homogeneous_sum  # the bubble shrinks alone, too
