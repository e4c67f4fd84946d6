"""The 1F1B event simulation: schedule order, exactness on uniform pipelines, outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_h2.hetero_plan import ChipSpec, HeteroPlan, StageSpec
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.cost_model import CostConfig, CostModel
from megatron_h2.planner.simulator import (
    one_f_one_b,
    simulate,
    write_chrome_trace,
    write_timeline_png,
)
from tests.planner_models import planner_model

MODEL = planner_model(
    num_layers=8,
    hidden_size=128,
    ffn_hidden_size=352,
    num_attention_heads=4,
    seq_length=128,
    vocab_size=1000,
    num_query_groups=2,
)
FAST_LINKS = Cluster(
    (
        ChipType("A", "cpu", 8, 8, 0.2, 1.0, 1e9, 1e9),
        ChipType("B", "cpu", 8, 8, 0.1, 2.0, 1e9, 1e9),
    ),
    cross_chip_gb_per_s=1e9,
)


def test_megatron_1f1b_order() -> None:
    assert one_f_one_b(4, 6, 0) == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("F", 3),
        ("B", 0),
        ("F", 4),
        ("B", 1),
        ("F", 5),
        ("B", 2),
        ("B", 3),
        ("B", 4),
        ("B", 5),
    ]
    assert one_f_one_b(4, 6, 3) == [x for i in range(6) for x in (("F", i), ("B", i))]
    assert one_f_one_b(4, 2, 0) == [
        ("F", 0),
        ("F", 1),
        ("B", 0),
        ("B", 1),
    ]  # fewer micro-batches than stages


def test_uniform_pipeline_matches_the_formula_exactly() -> None:
    cost = CostModel(FAST_LINKS, MODEL, CostConfig(p2p_latency_s=0.0))
    plan = HeteroPlan(1, 1, 12, {"A": ChipSpec("cpu")}, [StageSpec("A", 1, 2)] * 4)
    result = simulate(plan, cost)
    est = result.estimate
    works = [stage.work_s for stage in est.stages]  # equal but for the embedding and the head
    assert result.step_time_s == pytest.approx((12 - 1) * max(works) + sum(works), rel=1e-9)
    assert result.step_time_s == pytest.approx(est.step_time_s, rel=1e-9)
    assert result.bubble_fraction == pytest.approx(
        1 - 12 * sum(works) / (4 * result.step_time_s), rel=1e-9
    )
    assert result.peak_in_flight == (4, 3, 2, 1)


def test_heterogeneous_pipeline_is_close_to_the_formula() -> None:
    cost = CostModel(FAST_LINKS, MODEL)
    plan = HeteroPlan(
        2,
        1,
        16,
        {"A": ChipSpec("cpu"), "B": ChipSpec("cpu")},
        [StageSpec("B", 1, 2, "selective"), StageSpec("A", 2, 3), StageSpec("A", 1, 3)],
    )
    result = simulate(plan, cost)
    assert result.step_time_s <= result.estimate.step_time_s * 1.05
    assert result.step_time_s >= max(result.busy_s)
    assert result.peak_in_flight == (3, 2, 1)
    for stage, peak in zip(result.estimate.stages, result.peak_memory_bytes):
        assert peak == pytest.approx(
            stage.memory_bytes
        )  # simulated peak = cost model's in-flight bound
    assert set(result.peak_memory_by_chip()) == {"A", "B"}
    assert all(0 < u <= 1 for u in result.utilization)
    kinds = [e.kind for e in result.events if e.stage == 0]
    assert kinds.count("F") == kinds.count("B") == 8 and kinds[-1] == "sync"


def test_link_latency_that_1f1b_cannot_hide_shows_in_the_simulation() -> None:
    slow_links = Cluster((ChipType("A", "cpu", 8, 1, 0.2, 1.0, 1.0, 0.01),), None)
    cost = CostModel(slow_links, MODEL)
    plan = HeteroPlan(1, 1, 8, {"A": ChipSpec("cpu")}, [StageSpec("A", 1, 2)] * 4)
    result = simulate(plan, cost)
    assert result.step_time_s > result.estimate.step_time_s


def test_trace_and_timeline_files(tmp_path: Path) -> None:
    cost = CostModel(FAST_LINKS, MODEL)
    plan = HeteroPlan(
        1,
        1,
        4,
        {"A": ChipSpec("cpu"), "B": ChipSpec("cpu")},
        [StageSpec("B", 1, 3), StageSpec("A", 1, 5)],
    )
    result = simulate(plan, cost)
    trace = tmp_path / "trace.json"
    write_chrome_trace(result, trace)
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 2 * 4 * 2 + 2  # F and B per micro-batch per stage, one sync per stage
    assert {e["tid"] for e in spans} == {0, 1}
    assert any(
        e["name"] == "thread_name" and e["args"]["name"].startswith("stage 1: A") for e in events
    )
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    write_timeline_png(result, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
