"""The planner's expert tensor parallelism (ETP other than the stage's TP): the routed
experts' weights and optimizer state split over ETP x EP with their gradients synced over the
expert-DP group of TP x DP / (ETP x EP) chips, each TP rank dispatching its 1/TP of the tokens,
the all-gather of the dispatched rows over the expert-TP group (and the reduce-scatter of the
outputs) over the chip type's links, expert FLOPs per chip as at ETP = TP, and plans validated
in one line."""

from __future__ import annotations

import pytest

from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import StageSpec
from megatron_h2.planner import CostModel
from megatron_h2.planner.cost_model import CostConfig
from tests.unit.planner.test_planner_moe import CLUSTER, chip, moe_model, plan


def test_expert_weights_and_optimizer_split_over_etp_times_ep():
    model = moe_model()
    cost = CostModel(CLUSTER, model, CostConfig(use_distributed_optimizer=True))
    non_expert, experts = model.moe_layer_params_per_chip(1, 2, 2)
    assert experts == model.moe_layer_params_per_chip(1, 1)[1] / 4  # EP 2 x ETP 2
    assert non_expert == model.moe_layer_params_per_chip(1, 2)[0]
    bpp = cost.config.bytes_per_param
    etp2 = cost.stage_costs("big", 1, 1, 8, 2, True, etp=2)  # expert DP 8 / (2 x 2) = 2
    assert etp2.layer_static == pytest.approx(non_expert * bpp(8) + experts * bpp(2))
    assert etp2.layer_params == pytest.approx(non_expert + experts)
    etp1 = cost.stage_costs("big", 1, 1, 8, 2, True)  # expert DP 4
    assert etp1.layer_static > etp2.layer_static
    # the experts' gradients sync over a smaller expert-DP group, each chip fewer of them
    assert etp2.sync_per_layer < etp1.sync_per_layer


def test_the_expert_tp_all_gather_and_reduce_scatter_are_added_each_way():
    model = moe_model()
    cost = CostModel(CLUSTER, model, CostConfig(moe_imbalance=1.5))
    big = CLUSTER.chip("big")
    for ep in (1, 2):  # the imbalance factor where experts are apart (EP > 1)
        dispatched = model.moe_dispatch_bytes(model.seq_length) * (1.5 if ep > 1 else 1.0)
        etp1 = cost.stage_costs("big", 1, 1, 4, ep, True)
        etp2 = cost.stage_costs("big", 1, 1, 4, ep, True, etp=2)
        extra = 2 * cost.expert_tp_exchange_s(dispatched, 2, big)  # gather + reduce-scatter
        assert etp2.layer_forward - etp1.layer_forward == pytest.approx(extra)
        assert etp2.layer_backward[0] - etp1.layer_backward[0] == pytest.approx(extra)
    # the formula: (ETP - 1) shares of the rows each way, intra-node within a node
    lat, eff = cost.config.collective_latency_s, cost.config.comm_efficiency
    assert cost.expert_tp_exchange_s(1e6, 4, big) == pytest.approx(
        3 * (lat + 1e6 / (big.intra_node_gb_per_s * 1e9 * eff)))
    assert cost.expert_tp_exchange_s(1e6, 8, big) == pytest.approx(
        7 * (lat + 1e6 / (big.inter_node_gb_per_s * 1e9 * eff)))
    assert cost.expert_tp_exchange_s(1e6, 1, big) == 0.0
    node = chip("n", count=16, per_node=2)
    assert cost.expert_tp_exchange_s(1e6, 4, node) > 2 * cost.expert_tp_exchange_s(1e6, 2, node)


def test_plans_with_expert_tp_are_costed_and_checked_in_one_line():
    model = moe_model()
    cost = CostModel(CLUSTER, model)
    assert cost.expert_parallel_options(1, 4, 2) == [1, 2]  # EP x ETP 2 divides 4 ranks
    assert cost.expert_parallel_options(1, 4) == [1, 2, 4]
    base = cost.evaluate(plan([StageSpec("big", 1, 4)], dp=4, gbs=8))
    split = cost.evaluate(plan([StageSpec("big", 1, 4, expert_tensor_parallel_size=2)], dp=4,
                               gbs=8))
    assert split.stages[0].memory_bytes < base.stages[0].memory_bytes
    assert split.stages[0].forward_s > base.stages[0].forward_s  # the gather, no FLOPs saved
    # TP 2 with ETP 1: each TP rank dispatches half the tokens, the experts whole on each rank
    tp2 = cost.stage_costs("big", 2, 1, 2, 2, True)
    tp2_etp1 = cost.stage_costs("big", 2, 1, 2, 2, True, etp=1)
    half = model.moe_dispatch_bytes(model.seq_length) * cost.config.moe_imbalance / 2
    big = CLUSTER.chip("big")
    assert tp2_etp1.layer_forward - tp2.layer_forward == pytest.approx(
        2 * (cost.alltoall_s(half, 2, big) - cost.alltoall_s(2 * half, 2, big)))
    assert tp2_etp1.layer_params - tp2.layer_params == pytest.approx(
        model.moe_layer_params_per_chip(2, 2, 1)[1] - model.moe_layer_params_per_chip(2, 2)[1])
    assert cost.evaluate(plan([StageSpec("big", 2, 4, expert_tensor_parallel_size=1)], dp=2,
                              gbs=8)).stages[0].memory_bytes > 0
    with pytest.raises(ConfigError, match="4 x expert_tensor_parallel_size 2 = 8 does not divide"):
        cost.evaluate(plan([StageSpec("big", 1, 4, expert_model_parallel_size=4,
                                      expert_tensor_parallel_size=2)], dp=4, gbs=8))
