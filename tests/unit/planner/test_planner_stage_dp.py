"""A plan the planner writes with per-chip-type DP degrees is one the runtime runs: it passes the
runtime's start-up check, and the simulator replays the routed orders the runtime executes.
(torchrun trains it with one process's losses: tests/e2e/test_planner_stage_dp.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_h2.config import ParallelConfig
from megatron_h2.plan.orders import check_orders, routed_orders
from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec
from megatron_h2.planner import Cluster, CostConfig, CostModel, SearchOptions, search
from megatron_h2.planner.alternatives import schedule_alternatives
from megatron_h2.planner.model_input import model_from_dict
from megatron_h2.planner.simulator import simulate
from megatron_h2.training.layout import check_plan_for_model, stage_dps

# dist_utils.tiny_model_flags() as the planner reads it (micro-batch 2, global batch 8)
MODEL = model_from_dict(
    {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128,
     "seq_length": 32, "max_position_embeddings": 32, "vocab_size": 256}
)  # fmt: skip
# two fast chips too small for the model alone at full speed, one slower chip with memory
CLUSTER = Cluster.from_dict(
    {
        "chips": {
            "fast": {"device": "cpu", "count": 2, "chips_per_node": 1, "tflops_bf16": 0.02,
                     "memory_gib": 0.004, "intra_node_gb_per_s": 5, "inter_node_gb_per_s": 1},
            "slow": {"device": "cpu", "count": 1, "chips_per_node": 1, "tflops_bf16": 0.02,
                     "memory_gib": 0.05, "intra_node_gb_per_s": 5, "inter_node_gb_per_s": 1,
                     "emulate_slowdown": 1.5},
        },
        "cross_chip_gb_per_s": 1,
    }
)  # fmt: skip


def planned(tmp_path: Path) -> tuple[str, HeteroPlan, CostModel]:
    cost = CostModel(CLUSTER, MODEL, CostConfig())
    best = search(cost, SearchOptions(8, top_k=3, micro_batch_sizes=(2,))).best
    path = tmp_path / "plan.yaml"
    best.plan.to_yaml(path)
    return str(path), HeteroPlan.from_yaml(path), cost


def test_planned_per_type_dp_plan_passes_the_runtime_check(tmp_path: Path) -> None:
    _, plan, cost = planned(tmp_path)
    dps = stage_dps(plan)
    assert len(set(dps)) > 1, "the planner should give the two chip types their own DP"
    assert plan.world_size == 3  # every chip used: slow DP 1, fast DP 2
    check_plan_for_model(plan, MODEL, ParallelConfig(), plan.world_size)
    total, chunks = plan.total_micro_batches, plan.virtual_pipeline_size
    check_orders(routed_orders(str(plan.schedule), dps, chunks, total), chunks, dps)
    # the simulator replays those routed orders; the step formula agrees with it here
    result = simulate(plan, cost)
    assert {(e.stage, e.replica) for e in result.events + result.replica_events} == {
        (s, r) for s, dp in enumerate(dps) for r in range(dp)
    }
    assert result.step_time_s == pytest.approx(cost.evaluate(plan).step_time_s, rel=0.1)


def test_schedule_alternatives_of_a_one_dp_plan_that_leaves_chips_idle() -> None:
    """The other schedules of a plan with one DP degree 2 whose fast type uses two of its three
    chips are solved in the search's one-DP shape (own-DP shapes only hold types that use all
    their chips)."""
    data = {"device": "cpu", "chips_per_node": 1, "tflops_bf16": 0.02, "memory_gib": 0.05,
            "intra_node_gb_per_s": 5, "inter_node_gb_per_s": 1}  # fmt: skip
    cluster = Cluster.from_dict(
        {"chips": {"fast": {**data, "count": 3}, "slow": {**data, "count": 2}},
         "cross_chip_gb_per_s": 1}
    )  # fmt: skip
    cost = CostModel(cluster, MODEL, CostConfig())
    stages = [StageSpec("slow", 1, 1), StageSpec("fast", 1, 3)]
    plan = HeteroPlan(2, 2, 8, {"fast": ChipSpec("cpu"), "slow": ChipSpec("cpu")}, stages)
    found = {a.schedule: a for a in schedule_alternatives(cost, plan, SearchOptions(8))}
    best = found["zero-bubble"].candidate
    assert best is not None and best.plan.world_size == 4
    assert found["1f1b"].candidate.estimate.step_time_s <= cost.evaluate(plan).step_time_s
