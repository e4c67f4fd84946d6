"""The cost model and simulator of plans of several data-parallel pipelines: each pipeline's own
step for its share, plus the cross-pipeline gradient exchange on the links it crosses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec
from megatron_h2.planner import Cluster, CostConfig, CostModel
from megatron_h2.planner.model_input import model_from_dict
from megatron_h2.planner.pipelines_cost import (
    FP32_BYTES,
    evaluate_pipelines,
    evaluate_plan,
    simulate_plan,
    stage_exchange_s,
)

MODEL = model_from_dict(
    {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128,
     "seq_length": 32, "max_position_embeddings": 32, "vocab_size": 256}
)  # fmt: skip


def cluster(cross: float = 1.0, inter: float = 2.0) -> Cluster:
    chip = {"device": "cpu", "count": 4, "chips_per_node": 2, "tflops_bf16": 0.02,
            "memory_gib": 1.0, "intra_node_gb_per_s": 5, "inter_node_gb_per_s": inter}
    return Cluster.from_dict({"chips": {"fast": chip, "slow": dict(chip, emulate_slowdown=2.0)},
                              "cross_chip_gb_per_s": cross})


CHIPS = {"fast": ChipSpec("cpu"), "slow": ChipSpec("cpu", 2.0)}


def one(share: int, stages: list[StageSpec], dp: int = 1) -> HeteroPlan:
    return HeteroPlan(dp, 1, share, CHIPS, stages)


def two_pipelines(fast_share: int = 6, slow_share: int = 2) -> HeteroPlan:
    return HeteroPlan.of_pipelines([
        one(fast_share, [StageSpec("fast", 2, 4)]),
        one(slow_share, [StageSpec("slow", 1, 1), StageSpec("slow", 1, 3)]),
    ])


def test_step_is_slowest_pipeline_plus_exchange() -> None:
    cost = CostModel(cluster(), MODEL, CostConfig())
    plan = two_pipelines()
    est = evaluate_pipelines(cost, plan)
    alone = [cost.evaluate(pipe).step_time_s for pipe in plan.pipelines]
    assert est.pipelines[0].step_time_s == alone[0]
    assert est.step_time_s == pytest.approx(max(alone) + est.exchange_s)
    assert est.exchange_s > 0
    assert est.tokens_per_s == pytest.approx(8 * MODEL.seq_length / est.step_time_s)
    assert est.chips_used == {"fast": 2, "slow": 2}
    assert evaluate_plan(cost, plan) == est
    # a plan of one pipeline goes to the one-pipeline model
    assert evaluate_plan(cost, plan.pipelines[0]) == cost.evaluate(plan.pipelines[0])


def test_exchange_bytes_follow_each_ranks_shard_and_the_link_crossed() -> None:
    config = CostConfig(p2p_latency_s=0.0)
    plan = two_pipelines()
    slow_cross = CostModel(cluster(cross=0.5), MODEL, config)
    fast_cross = CostModel(cluster(cross=1.0), MODEL, config)
    # pipeline 0 (fast, TP 2) holds half the model per rank; every element crosses to "slow"
    costs = fast_cross.stage_costs("fast", 2, 1, 1)
    shard = costs.params(4, True, True)
    expected = shard * FP32_BYTES / (1.0e9 * config.comm_efficiency)
    assert stage_exchange_s(fast_cross, plan, 0, 0) == pytest.approx(expected)
    # half the bandwidth across chip types: twice the time
    assert stage_exchange_s(slow_cross, plan, 0, 0) == pytest.approx(2 * expected)
    # the same chip type on both sides: the type's own inter-node links
    same = HeteroPlan.of_pipelines([one(4, [StageSpec("fast", 2, 4)]),
                                    one(4, [StageSpec("fast", 1, 2), StageSpec("fast", 1, 2)])])
    assert stage_exchange_s(fast_cross, same, 0, 0) == pytest.approx(expected / 2.0)


def test_exchange_counts_every_other_pipeline_and_dp_shards() -> None:
    cost = CostModel(cluster(), MODEL, CostConfig(p2p_latency_s=0.0,
                                                  use_distributed_optimizer=True))
    pipe = one(2, [StageSpec("fast", 1, 4)])
    two = HeteroPlan.of_pipelines([pipe, pipe])
    three = HeteroPlan.of_pipelines([pipe, pipe, pipe])
    assert stage_exchange_s(cost, three, 0, 0) == pytest.approx(
        2 * stage_exchange_s(cost, two, 0, 0))
    # DP 2 under ZeRO: each rank holds and exchanges half
    sharded = HeteroPlan.of_pipelines([one(2, [StageSpec("fast", 1, 4)], dp=2), pipe])
    assert stage_exchange_s(cost, sharded, 0, 0) == pytest.approx(
        stage_exchange_s(cost, two, 0, 0) / 2)


def test_simulated_step_adds_the_exchange_to_the_slowest_simulation() -> None:
    cost = CostModel(cluster(), MODEL, CostConfig())
    plan = two_pipelines()
    sim = simulate_plan(cost, plan)
    assert len(sim.pipelines) == 2
    assert sim.step_time_s == pytest.approx(
        max(run.step_time_s for run in sim.pipelines) + sim.estimate.exchange_s)


def test_moving_batch_to_the_faster_pipeline_changes_the_slowest() -> None:
    cost = CostModel(cluster(), MODEL, CostConfig())
    even = evaluate_pipelines(cost, two_pipelines(4, 4))
    skewed = evaluate_pipelines(cost, two_pipelines(6, 2))
    assert even.slowest == 1  # the slow pipeline with half the batch sets the step
    assert skewed.step_time_s < even.step_time_s


def test_step_time_command_and_elastic_evaluate_take_a_plan_of_pipelines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_h2.commands.step_time import main
    from megatron_h2.config import ParallelConfig, RunConfig
    from megatron_h2.elastic.replan import evaluate

    plan, data = two_pipelines(), cluster().to_dict()
    plan.to_yaml(tmp_path / "plan.yaml")
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(data))
    model = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
             "ffn_hidden_size": 128, "seq_length": 32, "max_position_embeddings": 32,
             "vocab_size": 256}
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(model))
    (tmp_path / "m.jsonl").write_text("".join(
        json.dumps({"iteration": i, "iteration_ms": 500.0}) + "\n" for i in range(1, 9)))
    assert main(["--plan", str(tmp_path / "plan.yaml"), "--cluster", str(tmp_path / "cluster.yaml"),
                 "--model", str(tmp_path / "model.yaml"), "--metrics", str(tmp_path / "m.jsonl"),
                 "--skip", "2"]) == 0
    predicted = evaluate_pipelines(CostModel(cluster(), MODEL, CostConfig()), plan).step_time_s
    out = capsys.readouterr().out
    assert f"predicted step time: {predicted:.2f} s" in out
    assert f"measured / predicted: {0.5 / predicted:.2f}" in out
    cfg = RunConfig(model=MODEL, parallel=ParallelConfig())
    assert evaluate(plan, cluster(), cfg).tokens_per_s == pytest.approx(
        evaluate_pipelines(CostModel(cluster(), MODEL, CostConfig()), plan).tokens_per_s)
