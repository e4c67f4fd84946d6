"""The planner's cost model for mixture-of-experts models: per-chip expert weights and optimizer
state under expert parallelism (ZeRO-1 over the expert-data-parallel group), the top-k experts'
FLOPs, the dispatch all-to-all, the token-imbalance factor, and stages costed by which layers
(dense or MoE) they hold; the exact split over layer ranges against the count-based one."""

from __future__ import annotations

import itertools

import pytest

from megatron_h2.config import ModelConfig
from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec
from megatron_h2.planner import CostModel
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.cost_model import CostConfig
from megatron_h2.planner.held_activations import held_states
from megatron_h2.planner.moe_report import moe_why, stage_dispatch_s
from megatron_h2.planner.partition import StageSlot, solve_split
from megatron_h2.planner.partition_ranges import RangeSlot, solve_range_split
from megatron_h2.planner.report import stage_summary
from megatron_h2.planner.search import Candidate, SearchOptions, search

LLAMA = {"swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
         "add_bias_linear": False, "untie_embeddings_and_output_weights": True}


def moe_model(layers: int = 4, freq: int | list[int] = 1, experts: int = 8, topk: int = 2,
              shared: int | None = None, **extra: object) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=64, ffn_hidden_size=128,
                       num_attention_heads=4, seq_length=64, vocab_size=256,
                       num_experts=experts, moe_router_topk=topk, moe_layer_freq=freq,
                       moe_ffn_hidden_size=96, moe_shared_expert_intermediate_size=shared,
                       **LLAMA, **extra)  # type: ignore[arg-type]


def chip(name: str, count: int = 8, per_node: int = 4, tflops: float = 1.0,
         memory_mib: float = 64.0, intra: float = 8.0, inter: float = 1.0) -> ChipType:
    return ChipType(name, "cpu", count, per_node, tflops, memory_mib / 1024, intra, inter)


CLUSTER = Cluster((chip("big", memory_mib=64.0, tflops=0.2), chip("fast", memory_mib=24.0)), 1.0)


@pytest.mark.parametrize("shared", [None, 48])
@pytest.mark.parametrize("freq", [1, 2, [0, 1, 1, 0]])
def test_per_layer_counts_add_up_to_the_models_parameters(freq, shared):
    model = moe_model(freq=freq, shared=shared)
    cost = CostModel(CLUSTER, model)
    total = model.embedding_params_per_chip(1) + model.head_params_per_chip(1)
    for layer, is_moe in enumerate(cost.layer_is_moe):
        assert is_moe == model.is_moe_layer(layer)
        total += cost.stage_costs("big", 1, 1, 1, 1, is_moe).layer_params
    assert total == model.num_parameters()
    non_expert, experts = model.moe_layer_params_per_chip(2, 4)
    assert experts == model.moe_layer_params_per_chip(1, 1)[1] / 8  # EP 4 x TP 2
    assert non_expert < model.moe_layer_params_per_chip(1, 4)[0]


def test_every_tp_rank_dispatches_the_whole_micro_batch():
    """The runtime's MoE layer gathers the sequence over TP before routing, so each TP rank's
    all-to-all carries every token of the micro-batch, whatever the TP degree."""
    model = moe_model()
    cost = CostModel(CLUSTER, model, CostConfig(moe_imbalance=1.0))
    whole = 2 * cost.alltoall_s(model.moe_dispatch_bytes(model.seq_length), 2,
                                CLUSTER.chip("big"))
    for tp in (1, 2):
        ep1, ep2 = (cost.stage_costs("big", tp, 1, 2, ep, True) for ep in (1, 2))
        assert ep2.layer_forward - ep1.layer_forward == pytest.approx(whole)


def test_expert_parallelism_shards_expert_state_and_adds_the_all_to_all():
    model = moe_model()
    cost = CostModel(CLUSTER, model, CostConfig(use_distributed_optimizer=True))
    ep1, ep2, ep4 = (cost.stage_costs("big", 1, 1, 4, ep, True) for ep in (1, 2, 4))
    non_expert, experts = model.moe_layer_params_per_chip(1, 2)
    bpp = cost.config.bytes_per_param
    assert ep2.layer_static == pytest.approx(non_expert * bpp(4) + experts * bpp(2))
    assert ep1.layer_static > ep2.layer_static > ep4.layer_static
    # EP 1: no all-to-all, no imbalance; EP 2 and 4 (intra-node): slower per layer
    assert ep1.layer_forward < ep2.layer_forward
    balanced = CostModel(CLUSTER, model, CostConfig(moe_imbalance=1.0))
    assert balanced.stage_costs("big", 1, 1, 4, 2, True).layer_forward < \
        CostModel(CLUSTER, model).stage_costs("big", 1, 1, 4, 2, True).layer_forward
    tokens = model.seq_length
    alltoall = cost.alltoall_s(model.moe_dispatch_bytes(tokens) * 1.2, 2, CLUSTER.chip("big"))
    rest, routed = model.moe_layer_forward_flops(tokens)
    compute = (rest + 1.2 * routed) / (0.2e12 * cost.config.compute_efficiency)
    assert ep2.layer_forward == pytest.approx(compute + 2 * alltoall)
    # an EP group larger than a node crosses nodes: slower links
    node = chip("n", count=16, per_node=2)
    assert cost.alltoall_s(1e6, 4, node) > cost.alltoall_s(1e6, 2, node)
    # the experts' gradients sync over the expert-DP group (DP / EP): less than EP 1's
    assert ep2.sync_per_layer < ep1.sync_per_layer


def test_moe_layer_costs_more_memory_and_time_than_a_dense_one():
    model = moe_model(freq=[1, 0, 1, 0])
    cost = CostModel(CLUSTER, model)
    dense, moe = (cost.stage_costs("big", 1, 1, 1, 1, kind) for kind in (False, True))
    assert moe.layer_static > dense.layer_static
    assert all(m >= d for m, d in zip(moe.layer_activation, dense.layer_activation))
    assert moe.layer_forward > dense.layer_forward  # top-2 experts of 96 > one MLP of 128
    # the search's bound view: the cheaper kind's time, the dearer kind's weights less a credit
    # for the model's two dense layers (a stage holds at most those)
    low = cost.stage_costs("big", 1, 1, 1)
    assert low.layer_forward == dense.layer_forward
    assert low.layer_static == moe.layer_static
    assert low.working == dense.working - 2 * (moe.layer_static - dense.layer_static)


def plan(stages: list[StageSpec], dp: int = 1, gbs: int = 4) -> HeteroPlan:
    return HeteroPlan(dp, 1, gbs, {"big": ChipSpec("cpu"), "fast": ChipSpec("cpu")}, stages)


def test_a_stage_is_costed_by_the_layers_it_holds():
    model = moe_model(layers=4, freq=[0, 0, 1, 1])
    cost = CostModel(CLUSTER, model)
    dense_first = cost.evaluate(plan([StageSpec("big", 1, 2), StageSpec("big", 1, 2)]))
    s0, s1 = dense_first.stages
    assert s0.memory_bytes < s1.memory_bytes - cost.stage_costs("big", 1, 1, 1, 1, False).working
    dense, moe = (cost.stage_costs("big", 1, 1, 1, 1, kind) for kind in (False, True))
    assert s1.forward_s == pytest.approx(2 * moe.layer_forward + moe.head_forward)
    assert s0.forward_s == pytest.approx(2 * dense.layer_forward + dense.embedding_forward)
    mixed = cost.evaluate(plan([StageSpec("big", 1, 3), StageSpec("big", 1, 1)]))
    assert mixed.stages[0].forward_s == pytest.approx(
        2 * dense.layer_forward + moe.layer_forward + dense.embedding_forward)


def test_profile_and_foreign_expert_tp_are_refused_in_one_line():
    from megatron_h2.planner.profile import ProfileTable
    with pytest.raises(ConfigError, match="drop --profile"):
        CostModel(CLUSTER, moe_model(), profile=ProfileTable.__new__(ProfileTable))
    with pytest.raises(ConfigError, match="moe_imbalance must be >= 1"):
        CostConfig(moe_imbalance=0.5)


def _range_slots(cost: CostModel, kinds, schedule, m):
    p = len(kinds)
    return [RangeSlot(cost.stage_costs(n, t, 1, d, 1, False), cost.stage_costs(n, t, 1, d, 1, True),
                      i == 0, i == p - 1, held_states(schedule, p, m, 1, i))
            for i, (n, t, d) in enumerate(kinds)]


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_range_split_equals_the_count_split_when_layers_are_alike(schedule):
    """All-MoE layers: every range of equal length costs the same, so the range programme must
    find the count-based solver's optimum (an independent implementation)."""
    model = moe_model(layers=7)
    cost = CostModel(CLUSTER, model, CostConfig(use_distributed_optimizer=True))
    for kinds in ([("fast", 1, 2), ("big", 1, 2), ("big", 2, 2)],
                  [("big", 1, 1), ("fast", 2, 1), ("fast", 1, 1), ("big", 1, 1)]):
        m = 4
        slots = _range_slots(cost, kinds, schedule, m)
        caps = []
        for i, (n, t, d) in enumerate(kinds):
            from megatron_h2.planner.held_activations import held_totals
            totals = held_totals(schedule, len(kinds), m, 1, i, None)
            caps.append(cost.stage_costs(n, t, 1, d).unit_caps(1, totals, i == 0,
                                                              i == len(kinds) - 1))
        count = solve_split([StageSlot(cost.stage_costs(n, t, 1, d), i == 0, i == len(kinds) - 1)
                             for i, (n, t, d) in enumerate(kinds)], 7, m, 1e-3, caps,
                            schedule=schedule)
        ranged = solve_range_split(slots, [True] * 7, [m] * len(kinds), 1e-3, schedule)
        assert (count is None) == (ranged is None)
        if count is not None:
            assert ranged.step_time_s == pytest.approx(count.step_time_s, rel=1e-12)


@pytest.mark.parametrize("pattern", [[0, 1, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0], [0, 0, 1, 1, 0, 1]])
def test_range_split_is_the_best_of_every_split_by_evaluate(pattern):
    """Mixed layers: the programme's optimum against every split and recompute mode, each
    plan costed by CostModel.evaluate."""
    model = moe_model(layers=6, freq=pattern)
    cost = CostModel(CLUSTER, model)
    kinds = [("fast", 1, 1), ("big", 1, 1), ("fast", 1, 1)]
    ranged = solve_range_split(_range_slots(cost, kinds, "1f1b", 4), cost.layer_is_moe,
                               [4, 4, 4], 0.0, "1f1b")
    best = None
    for cuts in itertools.combinations(range(1, 6), 2):
        split = [cuts[0], cuts[1] - cuts[0], 6 - cuts[1]]
        for modes in itertools.product(("none", "selective", "full"), repeat=3):
            est = cost.evaluate(plan([StageSpec(n, t, k, r)
                                      for (n, t, _), k, r in zip(kinds, split, modes)]))
            links = est.link_s
            if est.fits and (best is None or est.step_time_s - links < best[0]):
                best = (est.step_time_s - links, split)
    assert ranged is not None and best is not None
    assert ranged.step_time_s == pytest.approx(best[0], rel=1e-12)


def test_search_plans_a_moe_model_and_its_estimate_is_evaluate():
    model = moe_model(layers=4, freq=[0, 1, 1, 1])
    cost = CostModel(CLUSTER, model)
    result = search(cost, SearchOptions(global_batch_size=8, top_k=2, max_micro_batch_size=2))
    assert result.stats.exhaustive
    assert "interleaved" not in result.stats.space  # mixed layers: one chunk per stage
    assert "expert-parallel degree" in result.stats.space
    for cand in result.candidates:
        assert cand.estimate.step_time_s == pytest.approx(
            cost.evaluate(cand.plan).step_time_s, rel=1e-12)
        assert cand.plan.schedule != "interleaved"


def test_search_chooses_expert_parallelism_per_stage_kind():
    """A chip type with room for a stage's experts at EP 1 only just: the best plan shards the
    experts (EP 2, less memory, no expert gradient sync at expert-DP 1), each estimate is
    evaluate's, EP divides DP and the experts, and the best plan at EP 1 is slower."""
    model = moe_model(layers=2, experts=8)
    cost = CostModel(CLUSTER, model, CostConfig(use_distributed_optimizer=True))
    ep1 = cost.stage_costs("fast", 1, 1, 4, 1, True).layer_static
    ep2 = cost.stage_costs("fast", 1, 1, 4, 2, True).layer_static
    room = Cluster((chip("fast", count=8, per_node=1, memory_mib=(ep1 + ep2) / 2**20 * 1.2),),
                   1.0)  # one chip per node: TP 1 only
    cost = CostModel(room, model, CostConfig(use_distributed_optimizer=True))
    result = search(cost, SearchOptions(global_batch_size=8, top_k=3, max_micro_batch_size=1,
                                        schedules=("1f1b",)))
    assert result.stats.exhaustive and result.candidates
    for cand in result.candidates:
        for index, stage in enumerate(cand.plan.stages):
            ep, dp = stage.expert_model_parallel_size, cand.plan.stage_dp(index)
            assert dp % ep == 0 and 8 % ep == 0
        assert cand.estimate.step_time_s == pytest.approx(
            cost.evaluate(cand.plan).step_time_s, rel=1e-12)
    best = result.best.plan
    assert {s.expert_model_parallel_size for s in best.stages} == {2}
    flat = HeteroPlan(best.data_parallel_size, 1, 8, best.chips,
                      [StageSpec(s.chip, s.tensor_parallel_size, s.num_layers, s.recompute)
                       for s in best.stages])
    flat_estimate = cost.evaluate(flat)
    assert not flat_estimate.fits or flat_estimate.step_time_s > result.best.estimate.step_time_s
    assert flat_estimate.stages[0].memory_bytes > result.best.estimate.stages[0].memory_bytes


def test_why_lines_and_summary_name_expert_parallelism_and_the_dispatch():
    model = moe_model(layers=2, experts=8)
    room = Cluster((chip("fast", count=8, per_node=4, memory_mib=8.0),), 1.0)
    cost = CostModel(room, model, CostConfig(use_distributed_optimizer=True))
    stages = [StageSpec("fast", 1, 1, expert_model_parallel_size=2),
              StageSpec("fast", 1, 1, expert_model_parallel_size=4)]
    p = HeteroPlan(4, 1, 8, {"fast": ChipSpec("cpu")}, stages)
    cand = Candidate(p, cost.evaluate(p))
    assert stage_summary(p) == "fast TP1 EP2 x1 [1] | fast TP1 EP4 x1 [1]"
    lines = moe_why(cost, cand)
    assert lines[0].startswith("MoE on fast: 2 MoE and 0 dense layers on 2 stage(s), EP 2/4")
    k = cand.estimate.bottleneck
    dispatch = stage_dispatch_s(cost, cand, k)
    assert dispatch == pytest.approx(4 * cost.alltoall_s(
        model.moe_dispatch_bytes(model.seq_length) * 1.2, (2, 4)[k], room.chip("fast")))
    assert f"{1e3 * dispatch:.2f} ms" in lines[-1]
    # EP 4 spans a node of 4: intra-node; every a2a of stage 1 is costlier than stage 0's
    assert stage_dispatch_s(cost, cand, 1) > stage_dispatch_s(cost, cand, 0) > 0
