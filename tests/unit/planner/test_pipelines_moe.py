"""Plans of several data-parallel pipelines for mixture-of-experts models: the gradient
exchange counts each rank's range of the routed experts (``1 / EP`` of them per chip, summed
over an expert-DP group of ``DP / EP``), and the pipelines search plans MoE models with the EP
degree the one-pipeline search picks for each pipeline's stages."""

from __future__ import annotations

import pytest

from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec
from megatron_h2.planner import CostModel
from megatron_h2.planner.cluster import Cluster
from megatron_h2.planner.cost_model import CostConfig
from megatron_h2.planner.pipelines_cost import FP32_BYTES, evaluate_pipelines, stage_exchange_s
from megatron_h2.planner.pipelines_search import search_pipelines
from megatron_h2.planner.search import SearchOptions
from tests.unit.planner.test_planner_moe import chip, moe_model

MODEL = moe_model(layers=2, experts=8)


def tight_cluster(big_tflops: float = 0.5) -> Cluster:
    """'fast': one chip per node (TP 1), room for a stage's experts at EP 1 only just (as in
    test_search_chooses_expert_parallelism_per_stage_kind); 'big': roomy and slower."""
    cost = CostModel(Cluster((chip("fast"),), 1.0), MODEL,
                     CostConfig(use_distributed_optimizer=True))
    ep1, ep2 = (cost.stage_costs("fast", 1, 1, 4, ep, True).layer_static for ep in (1, 2))
    return Cluster((chip("fast", count=8, per_node=1, memory_mib=(ep1 + ep2) / 2**20 * 1.2),
                    chip("big", count=2, per_node=2, memory_mib=64.0, tflops=big_tflops)), 1.0)


def two_pipelines(ep: int) -> HeteroPlan:
    chips = {"fast": ChipSpec("cpu"), "big": ChipSpec("cpu")}
    return HeteroPlan.of_pipelines([
        HeteroPlan(4, 1, 4, chips, [StageSpec("fast", 1, 2, expert_model_parallel_size=ep)]),
        HeteroPlan(1, 1, 4, chips, [StageSpec("big", 1, 2)])])


@pytest.mark.parametrize("zero", [True, False])
def test_exchange_counts_the_experts_each_rank_holds(zero):
    """Under ZeRO-1 a rank of a DP-4 stage exchanges 1/4 of every parameter whatever its EP
    (1/EP of the experts on its chip, 1/(DP/EP) of those in its range); the replicated
    optimizer's all-gather of the experts shrinks with the expert-DP group (none at EP 4)."""
    cluster = Cluster((chip("fast", count=4, memory_mib=1e4), chip("big", count=1)), 1.0)
    cost = CostModel(cluster, MODEL, CostConfig(use_distributed_optimizer=zero))
    times = [stage_exchange_s(cost, two_pipelines(ep), 0, 0) for ep in (1, 2, 4)]
    if zero:
        send = MODEL.num_parameters() / 4 * FP32_BYTES / (1e9 * cost.config.comm_efficiency)
        assert times == pytest.approx([cost.config.p2p_latency_s + send] * 3, rel=1e-12)
    else:
        assert times[0] > times[1] > times[2]
        # EP 2: each chip's 1/2 of the experts of the 2 layers all-gathered over expert-DP 2
        # (half of it received) on the intra-node links (8 GB/s), EP 4: nothing to gather
        experts = 2 * MODEL.moe_layer_params_per_chip(1, 2)[1]
        link = 8.0 * 1e9 * cost.config.comm_efficiency
        assert times[1] - times[2] == pytest.approx(
            cost.config.collective_latency_s + experts / 2 * FP32_BYTES / link, rel=1e-9)
    # the receiving end: the EP 1 pipeline's one rank takes every parameter from pipeline 0
    received = stage_exchange_s(cost, two_pipelines(2), 1, 0)
    assert received > MODEL.num_parameters() * FP32_BYTES / 1e9


def test_search_plans_pipelines_of_a_moe_model_each_with_its_own_ep():
    """Two chip types: the pipeline on 'fast' shards its experts (EP 2 at DP 2, as the
    one-pipeline search picks there), the one on 'big' keeps them whole (EP 1); the
    estimate is evaluate_pipelines' and every pipeline's is the one-pipeline model's."""
    cost = CostModel(tight_cluster(), MODEL, CostConfig(use_distributed_optimizer=True))
    result = search_pipelines(cost, SearchOptions(global_batch_size=8, max_micro_batch_size=1,
                                                  schedules=("1f1b",), time_limit_s=30))
    assert result.best is not None and result.reason == "" and result.exhaustive
    plan = result.best.plan
    eps = {}
    for pipe in plan.pipelines:
        for index, stage in enumerate(pipe.stages):
            assert pipe.stage_dp(index) % stage.expert_model_parallel_size == 0
            eps.setdefault(stage.chip, set()).add(stage.expert_model_parallel_size)
    assert eps == {"fast": {2}, "big": {1}}
    estimate = evaluate_pipelines(cost, plan)
    assert result.best.estimate.step_time_s == pytest.approx(estimate.step_time_s, rel=1e-12)
    for pipe, own in zip(plan.pipelines, estimate.pipelines):
        assert own.step_time_s == pytest.approx(cost.evaluate(pipe).step_time_s, rel=1e-12)
