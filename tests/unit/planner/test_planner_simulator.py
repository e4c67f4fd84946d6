"""The 1F1B event simulation: schedule order, exactness on uniform pipelines, outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.cost_model import CostConfig, CostModel
from megatron_h2.planner.simulator import (
    one_f_one_b,
    simulate,
    write_chrome_trace,
    write_timeline_png,
)
from tests.helpers.planner_models import planner_model

MODEL = planner_model(
    num_layers=8,
    hidden_size=128,
    ffn_hidden_size=352,
    num_attention_heads=4,
    seq_length=128,
    vocab_size=1000,
    num_query_groups=2,
)
SMALL_HEAD = planner_model(8, 512, 1408, 4, 128, 128, 2)  # head and embedding ~2% of a layer
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


def test_timeline_draws_each_event_once_in_one_bar_set_per_stage_and_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every event is one rectangle, in one collection per stage and look (colour, shade,
    hatch): one collection per event made the drawing quadratic in the events (minutes for the
    1,024-chip example's 16,154 events)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    cost = CostModel(FAST_LINKS, MODEL)
    plan = HeteroPlan(
        1, 1, 4, {"A": ChipSpec("cpu"), "B": ChipSpec("cpu")},
        [StageSpec("B", 1, 3), StageSpec("A", 1, 5)], schedule="zero-bubble",
    )  # fmt: skip
    result = simulate(plan, cost)
    drawn: list[int] = []
    save = Figure.savefig

    def counting(figure: Figure, *args: object, **kwargs: object) -> None:
        drawn.extend(len(c.get_paths()) for c in figure.axes[0].collections)
        save(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", counting)
    write_timeline_png(result, tmp_path / "timeline.png")
    assert sum(drawn) == len(result.events)
    assert len(drawn) == 2 * 4  # per stage: F, B (input gradients), W, DP sync


def uniform(schedule: str, p: int, m: int, v: int) -> HeteroPlan:
    """p equal stages of v equal chunks on chip A (8 layers)."""
    layers = 8 // p
    chunks = (layers // v,) * v if v > 1 else ()
    return HeteroPlan(
        1,
        1,
        m,
        {"A": ChipSpec("cpu")},
        [StageSpec("A", 1, layers, "none", chunks)] * p,
        schedule=schedule,
    )


@pytest.mark.parametrize(
    "schedule,p,m,v",
    [
        ("1f1b", 4, 8, 1),
        ("1f1b", 4, 2, 1),
        ("zero-bubble", 4, 8, 1),
        ("zero-bubble", 4, 2, 1),
        ("zero-bubble", 2, 5, 1),
        ("interleaved", 4, 8, 2),
        ("interleaved", 2, 6, 2),
        ("interleaved", 2, 2, 4),
        ("interleaved", 4, 4, 2),
    ],
)
def test_closed_form_is_exact_on_uniform_pipelines(schedule: str, p: int, m: int, v: int) -> None:
    for latency in (0.0, 2e-5):  # with and without link times that compute hides
        cost = CostModel(FAST_LINKS, SMALL_HEAD, CostConfig(p2p_latency_s=latency))
        result = simulate(uniform(schedule, p, m, v), cost)
        if schedule == "zero-bubble":  # exact but for the embedding's and head's shares
            assert result.step_time_s <= result.estimate.step_time_s
            assert result.step_time_s == pytest.approx(result.estimate.step_time_s, rel=5e-3)
        else:
            assert result.step_time_s == pytest.approx(result.estimate.step_time_s, rel=1e-9)
        big_head = simulate(uniform(schedule, p, m, v), CostModel(FAST_LINKS, MODEL, cost.config))
        assert big_head.step_time_s <= big_head.estimate.step_time_s * (1 + 1e-9)


def test_zero_bubble_and_interleaving_shrink_the_bubble_as_modelled() -> None:
    cost = CostModel(FAST_LINKS, SMALL_HEAD, CostConfig(p2p_latency_s=0.0))
    idle = {}  # step time beyond the busiest stage's compute
    for name, schedule, v in (
        ("1f1b", "1f1b", 1),
        ("v2", "interleaved", 2),
        ("zb", "zero-bubble", 1),
    ):
        result = simulate(uniform(schedule, 4, 8, v), cost)
        idle[name] = result.step_time_s - max(result.busy_s)
    stage = cost.evaluate(uniform("1f1b", 4, 8, 1)).stages[1]  # a middle stage: no edges
    w, g = stage.work_s, stage.weight_grad_s
    # (p - 1) W idle under 1F1B, (p - 1) W / V interleaved, (p - 1)(W - 2G) under ZB-H1
    assert idle["1f1b"] == pytest.approx(3 * w, rel=0.02)
    assert idle["v2"] / idle["1f1b"] == pytest.approx(0.5, abs=0.02)
    assert idle["zb"] / idle["1f1b"] == pytest.approx((w - 2 * g) / w, abs=0.02)


@pytest.mark.parametrize(
    "schedule,chunks",
    [
        ("1f1b", ((2,), (3,), (3,))),
        ("zero-bubble", ((2,), (3,), (3,))),
        ("interleaved", ((1, 1), (2, 1), (1, 2))),
        ("interleaved", ((0, 3), (1, 2), (2, 0))),
    ],
)
def test_simulated_peak_memory_is_the_cost_models(schedule: str, chunks: tuple) -> None:
    cost = CostModel(FAST_LINKS, MODEL)
    stages = [
        StageSpec(c, 1, sum(n), "selective" if c == "B" else "none", n if len(n) > 1 else ())
        for c, n in zip("BAA", chunks)
    ]
    plan = HeteroPlan(
        1, 1, 6, {"A": ChipSpec("cpu"), "B": ChipSpec("cpu")}, stages, schedule=schedule
    )
    result = simulate(plan, cost)
    for estimate, peak, count in zip(
        result.estimate.stages, result.peak_memory_bytes, result.peak_in_flight
    ):
        assert peak == pytest.approx(estimate.memory_bytes, rel=1e-12)
        assert count == estimate.in_flight
    if schedule == "zero-bubble":  # later stages keep deferred weight-gradient inputs
        assert [s.deferred for s in result.estimate.stages] == [1, 2, 3]  # s + 1 after a B


def test_interleaved_and_zero_bubble_events(tmp_path: Path) -> None:
    cost = CostModel(FAST_LINKS, MODEL)
    two = {"A": ChipSpec("cpu"), "B": ChipSpec("cpu")}
    inter = HeteroPlan(
        1, 1, 4, two, [StageSpec("B", 1, 4, "none", (2, 2)), StageSpec("A", 1, 4, "none", (2, 2))]
    )
    result = simulate(inter, cost)
    assert result.estimate.wrap_link_s > 0  # the last stage sends chunk 0's output to stage 0
    kinds = {(e.kind, e.chunk) for e in result.events if e.kind != "sync"}
    assert kinds == {("F", 0), ("F", 1), ("B", 0), ("B", 1)}
    ends = {(e.kind, e.stage, e.chunk, e.micro_batch): e.end_s for e in result.events}
    starts = {(e.kind, e.stage, e.chunk, e.micro_batch): e.start_s for e in result.events}
    wrap = result.estimate.wrap_link_s
    assert starts[("F", 0, 1, 0)] >= ends[("F", 1, 0, 0)] + wrap - 1e-12  # the wrap-around hop
    trace = tmp_path / "inter.json"
    write_chrome_trace(result, trace)
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    assert {"F0 c1", "B3 c0"} <= names
    zb = HeteroPlan(
        1, 1, 4, two, [StageSpec("B", 1, 4), StageSpec("A", 1, 4)], schedule="zero-bubble"
    )
    events = simulate(zb, cost).events
    assert sum(e.kind == "W" for e in events) == 8
    w = {(e.stage, e.micro_batch): e for e in events if e.kind == "W"}
    b = {(e.stage, e.micro_batch): e for e in events if e.kind == "B"}
    assert all(w[key].start_s >= b[key].end_s for key in w)
    pytest.importorskip("matplotlib")
    for plan, name in ((inter, "inter.png"), (zb, "zb.png")):
        write_timeline_png(simulate(plan, cost), tmp_path / name)
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
