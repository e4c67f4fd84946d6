"""bench/bench_superlinear.py: its planning step builds the effect it measures (the memory-poor
fast chip alone recomputes, the mixed plan spares it). (The bench run end to end:
tests/e2e/test_bench_superlinear.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))

from bench_superlinear import (  # noqa: E402
    CLUSTER,
    MIXED,
    MODEL,
    PIPELINES,
    cores_needed,
    plan_cases,
    planner_model,
    ratio,
    side_by_side_processes,
)
from emulated_runs import common_window, plan_label  # noqa: E402

from megatron_h2.plan.schema import HeteroPlan  # noqa: E402
from megatron_h2.planner import Cluster, ProfileTable  # noqa: E402


def cpu_like_profile() -> ProfileTable:
    """Times shaped like this CPU's for the bench model (without dropout, as it trains: a
    layer's backward about 1.7 forwards), so the planning is checked for the profile the bench
    measures as well as for the FLOP model."""
    row = {"layer_forward_ms": 2.6, "layer_backward_ms": 4.5, "embedding_forward_ms": 0.04,
           "embedding_backward_ms": 0.06, "head_forward_ms": 0.56, "head_backward_ms": 1.05,
           "selective_recompute_ms": 1.4}
    chip = {"micro_batch_sizes": {1: row}, "optimizer_ns_per_param": 7.0}
    return ProfileTable.from_dict({"chips": {"fast": chip, "big": chip}})


@pytest.mark.parametrize("profile", [None, cpu_like_profile()], ids=["flops", "cpu-profile"])
def test_fast_alone_recomputes_and_the_mixed_plan_spares_it(profile) -> None:
    cases = {case.name: case for case in plan_cases(Cluster.from_yaml(CLUSTER), profile,
                                                    time_limit_s=20)}
    assert set(cases) == {"fast", "big", MIXED}
    fast, big, mixed = cases["fast"].plan, cases["big"].plan, cases[MIXED].plan
    # alone, the memory-poor chip fits the model only by recomputing every layer
    assert {s.chip for s in fast.stages} == {"fast"}
    assert all(s.recompute == "full" for s in fast.stages)
    # the memory-rich one needs no recompute alone
    assert {s.chip for s in big.stages} == {"big"}
    assert all(s.recompute == "none" for s in big.stages)
    # together: both types, the early stages (embedding) on the memory-rich type, and the fast
    # chip's layers without recompute
    assert {s.chip for s in mixed.stages} == {"fast", "big"}
    assert mixed.stages[0].chip == "big"
    assert all(s.recompute == "none" for s in mixed.stages if s.chip == "fast")
    assert sum(s.num_layers for s in mixed.stages) == planner_model().num_layers
    # the planner predicts the mixed cluster beats the sum of its parts
    alone = cases["fast"].predicted_tokens_per_s + cases["big"].predicted_tokens_per_s
    assert cases[MIXED].predicted_tokens_per_s / alone >= 1.10
    # the three plans side by side (each chip twice: alone and in the mix) fit the host's two
    # cores with room to spare
    assert cores_needed(mixed) == pytest.approx(1 / 4 + 1 / 12)
    assert sum(cores_needed(case.plan) for case in cases.values()) == pytest.approx(2 / 3)


def test_common_window_is_where_every_run_is_measuring() -> None:
    steps = {"a": [(10.0, 12.0), (12.0, 14.0), (14.0, 16.0)], "b": [(11.0, 15.0), (15.0, 19.0)]}
    assert common_window(steps) == (11.0, 16.0)


def test_side_by_side_profile_has_one_process_per_process_of_the_runs(tmp_path: Path) -> None:
    cluster = Cluster.from_yaml(CLUSTER)
    plan = HeteroPlan.from_yaml(side_by_side_processes(cluster, tmp_path / "p.yaml"))
    chips = [plan.stages[plan.rank_coordinates(r)[0]].chip for r in range(plan.world_size)]
    assert sorted(chips) == ["big", "big", "fast", "fast"]
    assert sum(s.num_layers for s in plan.stages) == planner_model().num_layers


def test_pipelines_case_is_one_pipeline_per_type_with_whole_micro_batch_shares() -> None:
    cases = {case.name: case for case in plan_cases(Cluster.from_yaml(CLUSTER), None,
                                                    time_limit_s=20, pipelines=True)}
    assert set(cases) == {"fast", "big", PIPELINES}
    plan = cases[PIPELINES].plan
    assert plan.num_pipelines == 2
    assert [{s.chip for s in p.stages} for p in plan.pipelines] == [{"fast"}, {"big"}]
    shares = [p.global_batch_size for p in plan.pipelines]
    assert sum(shares) == MODEL["global_batch_size"] and shares[0] > shares[1]  # fast takes more
    # the process count and cores come from every pipeline's ranks
    assert plan.world_size == 2
    assert cores_needed(plan) == pytest.approx(1 / 4 + 1 / 12)
    assert plan_label(plan) == f"[fast 8 full] {shares[0]} + [big 8] {shares[1]}"
    assert ratio({"fast": 1.0, "big": 1.0, PIPELINES: 3.0}) == pytest.approx(1.5)

