"""Interleaved schedules with per-stage DP: the simulator replays the runtime's routed orders;
plans whose simulated step is over 10% above the formula's are not offered, with the reason in
one line, and those within 10% are."""

from __future__ import annotations

import pytest

from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec
from megatron_h2.planner import Cluster, CostConfig, CostModel, SearchOptions, simulate
from megatron_h2.planner.alternatives import schedule_alternatives
from megatron_h2.planner.interleaved_dp import STALL_LIMIT, interleaved_variant, order_stall
from megatron_h2.planner.model_input import model_from_dict

MODEL = model_from_dict(
    {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128,
     "seq_length": 32, "max_position_embeddings": 32, "vocab_size": 256}
)  # fmt: skip
CHIP = {"device": "cpu", "count": 8, "chips_per_node": 1, "tflops_bf16": 0.02, "memory_gib": 1.0,
        "intra_node_gb_per_s": 5, "inter_node_gb_per_s": 5}
COST = CostModel(Cluster.from_dict({"chips": {"A": CHIP, "B": dict(CHIP, tflops_bf16=0.04)},
                                    "cross_chip_gb_per_s": 5}), MODEL, CostConfig())
CHIPS = {"A": ChipSpec("cpu"), "B": ChipSpec("cpu")}


def plan(dps: tuple[int, int], global_batch: int, schedule: str = "1f1b") -> HeteroPlan:
    stages = [StageSpec("A", 1, 4, "none", (), dps[0]), StageSpec("B", 1, 4, "none", (), dps[1])]
    one = HeteroPlan(1, 1, global_batch, CHIPS, stages)
    return interleaved_variant(one, 2) if schedule == "interleaved" else one


def ratio(p: HeteroPlan) -> float:
    return simulate(p, COST).step_time_s / COST.evaluate(p).step_time_s


def test_stalling_orders_are_excluded_with_a_one_line_reason() -> None:
    stalled = plan((2, 1), 16, "interleaved")
    assert ratio(stalled) > STALL_LIMIT  # the simulator replays the routed orders
    reason = order_stall(COST, stalled)
    assert reason is not None and "\n" not in reason
    assert "routed interleaved orders stall with per-stage DP 2/1" in reason
    assert f"{ratio(stalled):.2f}x the formula's" in reason


def test_orders_within_ten_percent_are_kept() -> None:
    kept = plan((4, 8), 16, "interleaved")
    assert ratio(kept) <= STALL_LIMIT
    assert order_stall(COST, kept) is None
    # not interleaved, or one DP degree: nothing to check
    assert order_stall(COST, plan((2, 1), 16)) is None
    assert order_stall(COST, plan((2, 2), 16, "interleaved")) is None


def test_formula_takes_each_stages_micro_batches_under_interleaving() -> None:
    # stage 1 (DP 1) runs twice the micro-batches of stage 0 (DP 2) at half the work each
    est = COST.evaluate(plan((2, 1), 16, "interleaved"))
    w = [s.work_s for s in est.stages]
    steady = max((16 // 2 * 2 - 1) * w[0], (16 * 2 - 1) * w[1])
    assert est.pipeline_s == pytest.approx((steady + sum(w)) / 2)


@pytest.mark.parametrize("dps, stalls", [((2, 1), True), ((4, 8), False)])
def test_why_lines_show_interleaving_of_a_per_stage_dp_plan_or_why_not(
        dps: tuple[int, int], stalls: bool) -> None:
    options = SearchOptions(16, schedules=("1f1b", "interleaved"), max_virtual_stages=2)
    found = {a.label: a for a in schedule_alternatives(COST, plan(dps, 16), options)}
    alternative = found["interleaved V=2"]
    if stalls:
        assert alternative.candidate is None and "orders stall" in alternative.reason
    else:
        assert alternative.candidate is not None
        assert alternative.candidate.plan.schedule == "interleaved"
        assert ratio(alternative.candidate.plan) <= STALL_LIMIT
