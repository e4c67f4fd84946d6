"""Cost model formulas: parameters, bytes, activations, times, profile tables, whole plans."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.cost_model import CostConfig, CostModel
from megatron_h2.planner.held_activations import held_states, held_totals
from megatron_h2.planner.model_input import model_from_yaml
from megatron_h2.planner.profile import ProfileTable
from tests.helpers.paths import ROOT
from tests.helpers.planner_models import planner_model

MODEL = planner_model(
    num_layers=4,
    hidden_size=256,
    ffn_hidden_size=704,
    num_attention_heads=8,
    seq_length=256,
    vocab_size=4000,
    num_query_groups=4,
)
CLUSTER = Cluster(
    (
        ChipType("fast", "cpu", 4, 4, 0.5, 0.25, 8.0, 2.0),
        ChipType("slow", "cpu", 4, 2, 0.25, 0.5, 4.0, 1.0, emulate_slowdown=2.0),
    ),
    cross_chip_gb_per_s=0.5,
)

PROFILE = {
    "model": {"hidden_size": 256, "seq_length": 256},
    "chips": {
        "fast": {
            "micro_batch_sizes": {
                1: {
                    "layer_forward_ms": 2.0,
                    "layer_backward_ms": 5.0,
                    "head_forward_ms": 1.0,
                    "head_backward_ms": 2.0,
                }
            }
        },
        "slow": {"efficiency": 0.25},
    },
}


def test_llama_100b_parameter_count() -> None:
    model = model_from_yaml(ROOT / "examples/models/llama_100b.yaml")
    h, f, kv = 9216, 24576, 8 * 128
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    assert model.kv_size == kv
    assert model.num_parameters() == 96 * per_layer + 2 * 32000 * h + h
    assert model.vocab_size == 32000  # a multiple of 128 already: padding adds nothing
    assert model.layer_params_per_chip(8) == (per_layer - 2 * h) / 8 + 2 * h


def test_bytes_per_parameter() -> None:
    assert CostConfig().bytes_per_param(8) == 18.0
    # 2 bf16 weight + 4 fp32 gradient bucket + 1 received shard of it + (4 master + 8 Adam) / 4
    assert CostConfig(use_distributed_optimizer=True).bytes_per_param(4) == 6.0 + 1.0 + 3.0
    assert CostConfig(use_distributed_optimizer=True).bytes_per_param(1) == 6.0 + 12.0


def test_activation_bytes_by_recompute_mode() -> None:
    costs = CostModel(CLUSTER, MODEL).stage_costs("fast", 2, 1, 1)
    tokens, h, f, kv, a = 256, 256, 704, 128, 8
    none, selective, full = costs.layer_activation
    assert none == tokens * (8 * h + (4 * h + 4 * kv + 6 * f + 4 * a) / 2)
    assert selective == tokens * (4 * h + (2 * h + 4 * kv + 4 * f) / 2)
    assert full == tokens * 2 * h
    assert costs.working == none
    assert costs.capacity == 0.25 * 2**30 * 0.9


def test_memory_and_fastest_fitting_mode() -> None:
    cost = CostModel(CLUSTER, MODEL)
    costs = cost.stage_costs("fast", 1, 1, 1)
    for mode in range(3):
        for in_flight in (1, 3):
            top = costs.max_layers(mode, in_flight, True, False)
            assert costs.memory(top, mode, in_flight, True, False) <= costs.capacity
            assert costs.memory(top + 1, mode, in_flight, True, False) > costs.capacity
    assert (
        costs.max_layers(0, 4, False, False)
        <= costs.max_layers(1, 4, False, False)
        <= costs.max_layers(2, 4, False, False)
    )
    layers = costs.max_layers(0, 4, False, False) + 1
    assert cost.fastest_fitting_mode(costs, layers, 4, False, False) in ("selective", "full")
    assert cost.fastest_fitting_mode(costs, 1, 1, False, False) == "none"


def test_times_tp_communication_and_recompute() -> None:
    cost = CostModel(CLUSTER, MODEL)
    tp1, tp2 = cost.stage_costs("fast", 1, 1, 1), cost.stage_costs("fast", 2, 1, 1)
    flops = MODEL.layer_forward_flops(256)
    assert tp1.layer_forward == pytest.approx(flops / (0.5e12 * 0.5))
    allreduce = cost.allreduce_s(256 * 256 * 2, 2, 8.0)
    assert allreduce == pytest.approx(2 * 10e-6 + 2 * (2 - 1) / 2 * 256 * 256 * 2 / (8e9 * 0.8))
    assert tp2.layer_forward == pytest.approx(flops / (2 * 0.5e12 * 0.5) + 2 * allreduce)
    none, selective, full = tp2.layer_backward
    assert none < selective < full
    assert full == pytest.approx(none + tp2.layer_forward)
    slow = cost.stage_costs("slow", 1, 1, 1)  # emulate_slowdown 2 on half the TFLOPS
    assert slow.layer_forward == pytest.approx(4 * tp1.layer_forward)


def test_links_and_dp_sync_bandwidths() -> None:
    cost = CostModel(CLUSTER, MODEL)
    payload = 256 * 256 * 2
    assert cost.link_s("fast", "fast", 1) == pytest.approx(20e-6 + payload / (2e9 * 0.8))
    assert cost.link_s("fast", "slow", 1) == pytest.approx(20e-6 + payload / (0.5e9 * 0.8))
    local = cost.stage_costs("fast", 2, 1, 2)  # 2 x 2 chips in a 4-chip node: intra-node ring
    remote = cost.stage_costs("fast", 1, 1, 3)  # 3 does not divide 4: inter-node ring
    assert local.sync_per_param == pytest.approx(2 * 4.0 * (1 / 2) / (8e9 * 0.8))
    assert remote.sync_per_param == pytest.approx(2 * 4.0 * (2 / 3) / (2e9 * 0.8))
    assert cost.stage_costs("fast", 1, 1, 1).dp_sync(3, True, True) == 0.0


def two_stage_plan(dp: int = 1) -> HeteroPlan:
    return HeteroPlan(
        dp,
        1,
        4 * dp,
        {"fast": ChipSpec("cpu"), "slow": ChipSpec("cpu", 2.0)},
        [StageSpec("slow", 1, 1, "full"), StageSpec("fast", 2, 3)],
    )


def test_evaluate_matches_the_step_formula() -> None:
    cost = CostModel(CLUSTER, MODEL)
    plan = two_stage_plan(dp=2)
    est = cost.evaluate(plan)
    works = [s.work_s for s in est.stages]
    m = plan.num_micro_batches
    link = cost.link_s("slow", "fast", 1)
    expected = (m - 1) * max(works) + sum(works) + 2 * link + max(s.dp_sync_s for s in est.stages)
    assert est.step_time_s == pytest.approx(expected)
    assert [s.in_flight for s in est.stages] == [2, 1]
    assert est.stages[0].recompute == "full" and est.fits
    assert est.chips_used == {"slow": 2, "fast": 4}
    assert 0 < est.mfu < 1
    assert est.tokens_per_s == pytest.approx(plan.global_batch_size * 256 / est.step_time_s)
    with pytest.raises(ConfigError, match="but the model has 4"):
        cost.evaluate(HeteroPlan(1, 1, 4, {"fast": ChipSpec("cpu")}, [StageSpec("fast", 1, 3)]))


def test_profile_table_replaces_the_flop_model(tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(PROFILE))
    profile = ProfileTable.from_yaml(path)
    plain, measured = CostModel(CLUSTER, MODEL), CostModel(CLUSTER, MODEL, profile=profile)
    tp2 = measured.stage_costs("fast", 2, 1, 1)
    allreduce = measured.allreduce_s(256 * 256 * 2, 2, 8.0)
    assert tp2.layer_forward == pytest.approx(2.0e-3 / 2 + 2 * allreduce)
    assert tp2.layer_backward[0] == pytest.approx(5.0e-3 / 2 + 2 * allreduce)
    assert tp2.head_forward == pytest.approx(1.0e-3 / 2)
    # micro-batch 2 is not in the table: the nearest size is scaled linearly
    assert measured.stage_costs("fast", 1, 2, 1).layer_forward == pytest.approx(4.0e-3)
    # an efficiency only: the FLOP model with that efficiency (0.25 instead of 0.5)
    slow_plain, slow_measured = (
        plain.stage_costs("slow", 1, 1, 1),
        measured.stage_costs("slow", 1, 1, 1),
    )
    assert slow_measured.layer_forward == pytest.approx(2 * slow_plain.layer_forward)
    assert (
        measured.evaluate(two_stage_plan()).step_time_s
        != plain.evaluate(two_stage_plan()).step_time_s
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda p: p["chips"].update(fsat=p["chips"].pop("fast")),
            "not in the cluster (did you mean 'fast'?)",
        ),
        (
            lambda p: p["model"].update(hidden_size=512),
            "measured for hidden_size 512 but the model has 256",
        ),
        (lambda p: p["chips"]["slow"].update(efficiency=1.5), "efficiency must be a fraction"),
        (
            lambda p: p["chips"]["fast"]["micro_batch_sizes"][1].pop("layer_backward_ms"),
            "missing key 'layer_backward_ms'",
        ),
        (
            lambda p: p["chips"]["fast"].update(micro_batch_size={}),
            "did you mean 'micro_batch_sizes'",
        ),
    ],
)
def test_profile_errors(change, message: str) -> None:  # type: ignore[no-untyped-def]
    import copy

    data = copy.deepcopy(PROFILE)
    change(data)
    with pytest.raises(ConfigError, match=re.escape(message)):
        CostModel(CLUSTER, MODEL, profile=ProfileTable.from_dict(data))


def test_weight_gradient_part_of_the_backward() -> None:
    tokens, tp = 256, 2
    costs = CostModel(CLUSTER, MODEL).stage_costs("fast", tp, 1, 1)
    assert MODEL.layer_weight_grad_flops(tokens) == 2 * tokens * MODEL.layer_matrix_params
    assert costs.layer_weight_grad == pytest.approx(
        MODEL.layer_weight_grad_flops(tokens) / (tp * 0.5e12 * 0.5)
    )
    # dW is half the matrix part of the backward; the attention core and TP traffic are input work
    assert costs.layer_weight_grad < 0.5 * costs.layer_backward[0]
    assert costs.head_weight_grad == pytest.approx(
        MODEL.head_forward_flops(tokens) / (tp * 0.25e12)
    )
    f, b, w = costs.chunk_times(3, 2, False, True)
    assert (f, b) == (costs.forward(3, False, True), costs.backward(3, 2, False, True))
    assert w == pytest.approx(3 * costs.layer_weight_grad + costs.head_weight_grad)
    h, ffn, kv = 256, 704, 128
    assert costs.layer_weight_inputs == tokens * (8 * h + (4 * h + 4 * kv + 6 * ffn) / tp)
    measured = CostModel(CLUSTER, MODEL, profile=ProfileTable.from_dict(PROFILE))
    share = MODEL.layer_weight_grad_flops(tokens) / (2 * MODEL.layer_forward_flops(tokens))
    assert measured.stage_costs("fast", 1, 1, 1).layer_weight_grad == pytest.approx(5e-3 * share)


def test_held_memory_of_each_schedule() -> None:
    costs = CostModel(CLUSTER, MODEL).stage_costs("fast", 1, 1, 1)
    act, keep, static = costs.layer_activation[0], costs.layer_weight_inputs, costs.layer_static
    base = costs.working + costs.head_static
    # 1F1B: one state, the warm-up plus one micro-batch in flight (memory()'s count)
    states = held_states("1f1b", 4, 8, 1, 0)
    assert costs.held_memory((2,), 1, states, True, False) == costs.memory(2, 1, 4, True, False)
    # zero-bubble, last of 4 stages: after its 4th forward one micro-batch's activations and 3
    # deferred weight gradients' inputs; right after that backward, 4 deferred
    states = held_states("zero-bubble", 4, 8, 1, 3)
    peak = max(
        2 * (1 * act + 3 * keep) + costs.head_activation + 3 * costs.head_weight_inputs,
        2 * (0 * act + 4 * keep) + 4 * costs.head_weight_inputs,
    )
    assert costs.held_memory((2,), 0, states, False, True) == pytest.approx(
        base + 2 * static + peak
    )
    # interleaved, first of 4 stages, V = 2: Megatron's warm-up 2 x 3 + 4 forwards, plus one
    states = held_states("interleaved", 4, 8, 2, 0)
    even = costs.held_memory((2, 2), 0, states, False, False)
    assert even == pytest.approx(costs.working + 4 * static + 2 * 11 * act)
    # chunk 0 starts first and finishes last: layers there are held longer
    early = costs.held_memory((3, 1), 0, states, False, False)
    late = costs.held_memory((1, 3), 0, states, False, False)
    assert late < even < early


@pytest.mark.parametrize(
    "schedule,v", [("1f1b", 1), ("zero-bubble", 1), ("interleaved", 2), ("interleaved", 3)]
)
def test_search_memory_totals_equal_the_per_chunk_walk(schedule: str, v: int) -> None:
    costs = CostModel(CLUSTER, MODEL).stage_costs("fast", 2, 1, 1)
    for p, m in ((2, 4), (3, 6), (4, 4), (4, 12)):
        if schedule == "interleaved" and m % p:
            continue
        for s in range(p):
            first, last = s == 0, s == p - 1
            states, totals = held_states(schedule, p, m, v, s), held_totals(schedule, p, m, v, s)
            for units, mode in ((1, 0), (2, 1), (3, 2)):
                walk = costs.held_memory((units,) * v, mode, states, first, last)
                assert costs.totals_memory(units, v, mode, totals, first, last) == pytest.approx(
                    walk, rel=1e-12
                )
                most = costs.max_units(v, mode, totals, first, last)
                assert costs.held_memory((most,) * v, mode, states, first, last) <= costs.capacity
                over = costs.held_memory((most + 1,) * v, mode, states, first, last)
                assert over > costs.capacity


def test_step_formula_of_each_schedule() -> None:
    cost = CostModel(CLUSTER, MODEL)
    chips = {"fast": ChipSpec("cpu"), "slow": ChipSpec("cpu", 2.0)}
    m, link = 4, cost.link_s("slow", "fast", 1)
    zb = cost.evaluate(
        HeteroPlan(
            1,
            1,
            m,
            chips,
            [StageSpec("slow", 1, 1), StageSpec("fast", 2, 3)],
            schedule="zero-bubble",
        )
    )
    w = [s.work_s for s in zb.stages]
    g = [s.weight_grad_s for s in zb.stages]
    expected = (m - 1) * max(w) + sum(x - 2 * y for x, y in zip(w, g)) + 2 * max(g) + 2 * link
    assert zb.step_time_s == pytest.approx(expected)
    inter = cost.evaluate(
        HeteroPlan(
            1,
            1,
            m,
            chips,
            [StageSpec("slow", 1, 2, "none", (1, 1)), StageSpec("fast", 2, 2, "none", (1, 1))],
        )
    )
    w = [s.work_s for s in inter.stages]
    wrap = cost.link_s("fast", "slow", 1)
    expected = ((2 * m - 1) * max(w) + sum(w)) / 2 + 2 * link + 2 * (link + wrap)
    assert inter.schedule == "interleaved" and inter.step_time_s == pytest.approx(expected)
    assert [s.chunk_layers for s in inter.stages] == [(1, 1), (1, 1)]
    with pytest.raises(ConfigError, match=r"= 3\) to be a multiple of the pipeline size"):
        cost.evaluate(
            HeteroPlan(
                1,
                1,
                3,
                chips,
                [StageSpec("slow", 1, 2, "none", (1, 1)), StageSpec("fast", 2, 2, "none", (1, 1))],
            )
        )
