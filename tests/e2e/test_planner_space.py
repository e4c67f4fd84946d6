"""The planner's claim on a 1,024-chip cluster of four chip types that no example resembles,
with examples/models/llama_100b.yaml (no distributed optimizer): a plan built by hand, whose
chip types run other TP degrees than the one-DP plans the search starts from, each with its own
DP degree, must not beat the plan the search prints, nor lie below its proven bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_h2.plan.schema import ChipSpec, HeteroPlan
from megatron_h2.plan.specs import StageSpec
from megatron_h2.planner import CostConfig, CostModel, SearchOptions, model_from_yaml, search
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.report import search_summary

ROOT = Path(__file__).resolve().parents[2]

# datasheet-like chips, memory 40-96 GB, a 9x spread of TFLOPS, uneven counts
CLUSTER = Cluster(
    (
        ChipType("Hopper", "cuda", 128, 8, 989, 80, 450, 50),
        ChipType("Amp40", "cuda", 384, 8, 312, 40, 300, 25),
        ChipType("Gaud", "hpu", 256, 8, 432, 96, 262.5, 37.5),
        ChipType("Ada48", "cuda", 256, 8, 110, 48, 32, 12.5),
    ),
    25,
)

# (chip, TP, DP, stages, layers per stage, recompute), in pipeline order
HAND_BUILT = [  # the fastest type at TP 2 and Amp40 at TP 4, each type its own DP degree
    ("Ada48", 4, 32, 2, 3, "none"),
    ("Gaud", 4, 16, 4, 7, "none"),
    ("Amp40", 4, 16, 6, 5, "selective"),
    ("Hopper", 2, 16, 4, 8, "selective"),
]
ONE_DP_TP = [  # what the search printed as optimal when its re-splits kept each type's TP
    ("Ada48", 8, 32, 1, 4, "none"),
    ("Amp40", 8, 8, 6, 5, "selective"),
    ("Gaud", 4, 32, 2, 15, "none"),
    ("Hopper", 4, 16, 2, 16, "selective"),
]


def plan_of(blocks: list[tuple[str, int, int, int, int, str]]) -> HeteroPlan:
    stages = [
        StageSpec(chip, tp, layers, mode, (), dp)
        for chip, tp, dp, count, layers, mode in blocks
        for _ in range(count)
    ]
    chips = {c.name: ChipSpec(c.device) for c in CLUSTER.chips}
    return HeteroPlan(blocks[0][2], 1, 2048, chips, stages, schedule="1f1b")


@pytest.mark.e2e
@pytest.mark.parametrize("own_dp", ["derived", "all"])
def test_no_hand_built_plan_beats_the_printed_claim(own_dp: str) -> None:
    model = model_from_yaml(ROOT / "examples/models/llama_100b.yaml")
    cost = CostModel(CLUSTER, model, CostConfig(use_distributed_optimizer=False))
    hand = cost.evaluate(plan_of(HAND_BUILT)).step_time_s
    old = cost.evaluate(plan_of(ONE_DP_TP)).step_time_s
    assert hand < 0.99 * old  # the case: other TP degrees with own DP win by more than 1%
    time_limit = 600.0 if own_dp == "derived" else 20.0  # "all" stops at the limit here
    result = search(cost, SearchOptions(2048, time_limit_s=time_limit, own_dp=own_dp))
    line = search_summary(result)
    assert result.stats.lower_bound_s <= hand * (1 + 1e-9)
    assert "own DP degree using all its chips" in line
    if "optimal for the cost model over this space" in line:
        assert result.best.estimate.step_time_s <= hand * (1 + 1e-9)
    else:
        assert f"within {100 * result.gap:.1f}% of the optimum over this space" in line
    if own_dp == "derived":  # re-splits that change TP reach the hand-built plan
        assert result.best.estimate.step_time_s <= hand * (1 + 1e-9)
