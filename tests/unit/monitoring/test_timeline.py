"""The pipeline timeline: Chrome / Perfetto trace events, merging, bounds and the summary.
(Gathered across processes: tests/e2e/test_timeline.py.)"""

from __future__ import annotations

import json
import tracemalloc

import pytest

from megatron_h2.monitoring.timeline import (
    Timeline,
    event_name,
    format_summary,
    gather_and_write,
    merge,
    merge_and_write,
    summarize,
)
from megatron_h2.plan.schema import HeteroPlan

T0 = 1_700_000_000.0  # a wall-clock origin like time.time() gives

# A hand-made 1F1B-like step, seconds after T0: (kind, micro_batch, start, end).
# Stage 0 has two ranks (TP 2), stage 1 one rank; the window is [0, 9] seconds.
STAGE0 = [("forward", 0, 0.0, 1.0), ("send_forward", 0, 1.0, 1.5), ("forward", 1, 1.5, 2.5),
          ("send_forward", 1, 2.5, 3.0), ("recv_backward", 0, 3.0, 4.0),
          ("backward", 0, 4.0, 6.0), ("recv_backward", 1, 6.0, 6.5),
          ("backward", 1, 6.5, 8.5), ("optimizer", -1, 8.5, 9.0)]
STAGE1 = [("recv_forward", 0, 0.2, 1.5), ("forward", 0, 1.5, 2.5), ("backward", 0, 2.5, 3.5),
          ("send_backward", 0, 3.5, 4.0), ("recv_forward", 1, 4.0, 4.1),
          ("forward", 1, 4.1, 5.1), ("backward", 1, 5.1, 6.1), ("send_backward", 1, 6.1, 6.5),
          ("optimizer", -1, 8.5, 9.0)]


def make_rank(rank: int, stage: int, schedule, label: str | None = None,
              shorten_last_backward: float = 0.0) -> Timeline:
    timeline = Timeline(rank, stage, enabled=True, label=label)
    timeline.set_iteration(1)
    for kind, mb, start, end in schedule:
        if kind == "backward" and mb == 1:
            end -= shorten_last_backward
        timeline.record(kind, mb, T0 + start, T0 + end)
    return timeline


def three_ranks() -> list[Timeline]:
    return [make_rank(0, 0, STAGE0, "stage 0 (chip fast, TP 2)"),
            make_rank(1, 0, STAGE0, "stage 0 (chip fast, TP 2)", shorten_last_backward=0.5),
            make_rank(2, 1, STAGE1, "stage 1 (chip slow, TP 1)")]


def test_written_trace_has_chrome_structure(tmp_path):
    path = merge_and_write(tmp_path / "sub" / "trace.json", [t.events() for t in three_ranks()])
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    meta = [e for e in events if e["ph"] == "M"]
    assert len(spans) == len(STAGE0) * 2 + len(STAGE1)
    assert {e["ph"] for e in events} == {"X", "M"}
    for e in spans:
        assert set(e) == {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
        assert set(e["args"]) == {"iteration", "micro_batch"} and e["args"]["iteration"] == 1
        assert e["dur"] >= 0 and e["pid"] == (1 if e["tid"] == 2 else 0)
    names = {(e["tid"], e["name"], e["cat"]) for e in spans}
    assert {(0, "F0", "forward"), (0, "send F1", "send_forward"), (0, "recv B0", "recv_backward"),
            (0, "B1", "backward"), (2, "recv F0", "recv_forward"), (2, "send B1", "send_backward"),
            (2, "optimizer", "optimizer")} <= names
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert procs == {0: "stage 0 (chip fast, TP 2)", 1: "stage 1 (chip slow, TP 1)"}
    assert sum(e["name"] == "process_name" for e in meta) == 2  # one per stage, not per rank
    threads = {e["tid"]: (e["pid"], e["args"]["name"]) for e in meta if e["name"] == "thread_name"}
    assert threads == {0: (0, "rank 0"), 1: (0, "rank 1"), 2: (1, "rank 2")}
    sort = {e["tid"]: e["args"]["sort_index"] for e in meta if e["name"] == "thread_sort_index"}
    assert sort == {0: 0, 1: 1, 2: 2}
    # microseconds from the common origin (rank 0's first forward at T0)
    b0 = next(e for e in spans if e["tid"] == 0 and e["name"] == "B0")
    assert b0["ts"] == pytest.approx(4.0e6, abs=1) and b0["dur"] == pytest.approx(2.0e6, abs=1)
    first_recv = next(e for e in spans if e["tid"] == 2 and e["name"] == "recv F0")
    assert first_recv["ts"] == pytest.approx(0.2e6, abs=1)
    assert trace["otherData"]["origin_unix_us"] == pytest.approx(T0 * 1e6)
    assert trace["otherData"]["ranks"] == 3 and trace["otherData"]["max_iterations"] == 20
    assert "first 20 iterations" in trace["otherData"]["note"]
    assert [p.name for p in path.parent.iterdir()] == ["trace.json"]  # no temp file left


def test_origin_is_the_earliest_event_over_all_ranks():
    late, early = Timeline(0, 0, True), Timeline(1, 1, True)
    late.record("forward", 0, T0 + 5.0, T0 + 6.0)
    early.record("recv_forward", 0, T0 + 2.0, T0 + 5.0)  # a later rank starts first
    trace = merge([late.events(), early.events()])
    ts = {e["tid"]: e["ts"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert ts[1] == 0.0 and ts[0] == pytest.approx(3.0e6, abs=1)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["tid"] for e in xs] == [1, 0]  # sorted by time


def test_only_the_first_iterations_are_kept():
    timeline = Timeline(0, 0, enabled=True, max_iterations=3)
    for it in range(5, 11):
        timeline.set_iteration(it)
        with timeline.span("forward", 0):
            pass
        timeline.on_comm("send_forward", 0, T0 + it, T0 + it + 0.1)
    assert len(timeline) == 6
    assert timeline.dropped == 3  # on_comm of 8, 9, 10; past the bound span() does not time
    timeline.record("wait", -1, T0, T0 + 1, iteration=99)
    timeline.record("wait", -1, T0, T0 + 1, iteration=6)  # an admitted iteration still counts
    assert len(timeline) == 7 and timeline.dropped == 4
    assert not timeline.recording
    assert timeline.span("forward", 1) is timeline.span("backward", 2)  # shared no-op
    spans = [e for e in timeline.events() if e["ph"] == "X"]
    assert {e["args"]["iteration"] for e in spans} == {5, 6, 7}
    other = merge([timeline.events()])["otherData"]
    assert other["max_iterations"] == 3 and other["dropped_events"] == 4
    assert "first 3 iterations" in other["note"]


def test_event_count_is_bounded_too():
    timeline = Timeline(0, 0, enabled=True, max_events=4)
    for mb in range(10):
        timeline.record("forward", mb, T0 + mb, T0 + mb + 0.5)
    assert len(timeline) == 4 and timeline.dropped == 6
    with pytest.raises(ValueError):
        Timeline(0, 0, enabled=True, max_iterations=0)


def test_disabled_timeline_records_nothing_and_allocates_nothing():
    timeline = Timeline(3, 1, enabled=False)
    record, on_comm, span = timeline.record, timeline.on_comm, timeline.span
    record("forward", 0, T0, T0 + 1)  # warm up
    with span("forward", 0):
        pass
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(10_000):
            record("forward", 0, T0, T0 + 1)
            on_comm("recv_forward", 0, T0, T0 + 1)
            with span("backward", 0):
                pass
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 2048
    assert len(timeline) == 0 and timeline.events() == []
    assert span("forward", 0) is span("backward", 1)
    assert merge([timeline.events()])["traceEvents"] == []
    assert summarize([timeline.events()]) == {}


def test_summary_of_a_hand_made_schedule():
    summary = summarize([t.events() for t in three_ranks()])
    assert sorted(summary) == [0, 1]
    s0, s1 = summary[0], summary[1]
    assert s0["window_s"] == pytest.approx(9.0) and s1["window_s"] == pytest.approx(9.0)
    assert s0["ranks"] == 2 and s1["ranks"] == 1
    assert s0["compute_s"] == pytest.approx((6.0 + 5.5) / 2)  # mean over the two TP ranks
    assert s0["comm_wait_s"] == pytest.approx(0.5 + 0.5 + 1.0 + 0.5)
    assert s0["bubble"] == pytest.approx(1 - 5.75 / 9)
    assert s1["compute_s"] == pytest.approx(4.0)
    assert s1["comm_wait_s"] == pytest.approx(1.3 + 0.5 + 0.1 + 0.4)
    assert s1["bubble"] == pytest.approx(1 - 4.0 / 9)
    text = format_summary(summary)
    assert text.splitlines()[1] == ("timeline stage 1: compute 4.000 s, comm wait 2.300 s, "
                                    "bubble 55.6% of 9.000 s (1 rank(s))")


def test_rank_without_events_counts_as_idle():
    busy, idle = Timeline(0, 0, True), Timeline(1, 1, True)
    busy.record("forward", 0, T0, T0 + 2)
    summary = summarize([busy.events(), idle.events()])
    assert summary[0]["bubble"] == pytest.approx(0.0)
    assert summary[1] == {"ranks": 1, "compute_s": 0.0, "comm_wait_s": 0.0, "bubble": 1.0,
                          "window_s": pytest.approx(2.0)}


@pytest.mark.parametrize("kind, mb, name", [
    ("forward", 3, "F3"), ("backward", 12, "B12"), ("send_forward", 3, "send F3"),
    ("recv_forward", 0, "recv F0"), ("send_backward", 2, "send B2"),
    ("recv_backward", 1, "recv B1"),
    ("send_forward_recv_backward", 4, "send F4 + recv B"), ("optimizer", -1, "optimizer"),
    ("wait", -1, "wait"), ("grad_sync", 2, "grad_sync 2"),
])
def test_event_names(kind, mb, name):
    assert event_name(kind, mb) == name


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text("old")
    bad = Timeline(0, 0, True)
    bad.record("forward", 0, T0, T0 + 1)
    events = bad.events()
    events[-1]["args"]["micro_batch"] = object()  # not JSON
    with pytest.raises(TypeError):
        merge_and_write(path, [events])
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]


def test_for_plan_names_the_stage_row():
    plan = HeteroPlan.from_dict({
        "data_parallel_size": 1, "micro_batch_size": 1, "global_batch_size": 4,
        "chips": {"fast": {"device": "cpu"}, "slow": {"device": "cpu", "emulate_slowdown": 2.0}},
        "stages": [{"chip": "fast", "tensor_parallel_size": 2, "num_layers": 3},
                   {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 1}]})
    timeline = Timeline.for_plan(plan, rank=2, enabled=True, max_iterations=5)
    assert (timeline.stage, timeline.rank, timeline.max_iterations) == (1, 2, 5)
    assert timeline.label == "stage 1 (chip slow, TP 1)"


def test_gather_and_write_without_a_process_group(tmp_path):
    timeline = Timeline(0, 0, True)
    timeline.record("backward", 0, T0, T0 + 0.5)
    summary = gather_and_write(timeline, tmp_path / "t.json")
    assert summary is not None and summary[0]["compute_s"] == pytest.approx(0.5)
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"][-1]["name"] == "B0"


def test_chunks_and_the_split_backward_are_recorded_and_drawn(tmp_path):
    """Virtual stages and zero-bubble: events carry the chunk, B and W are told apart, W counts
    as compute, and the picture colours chunks and hatches the weight-gradient passes."""
    from megatron_h2.plan.orders import zero_bubble

    timeline = Timeline(0, 0, enabled=True, chunks=2)
    timeline.set_iteration(1)
    kinds = {"F": "forward", "B": "backward_input", "W": "backward_weight"}
    t = T0
    for action in zero_bubble(0, 2, 2, range(2)):
        timeline.record(kinds[action.kind], action.micro_batch, t, t + 1.0, chunk=action.chunk)
        timeline.on_comm("send_forward", action.micro_batch, t + 1.0, t + 1.5, action.chunk)
        t += 1.5
    spans = [e for e in timeline.events() if e["ph"] == "X"]
    names = {(e["name"], e["cat"], e["args"]["chunk"]) for e in spans}
    assert {("F1 c1", "forward", 1), ("B0 c0", "backward_input", 0),
            ("W1 c1", "backward_weight", 1), ("send F0 c1", "send_forward", 1)} <= names
    summary = summarize([timeline.events()])
    assert summary[0]["compute_s"] == pytest.approx(12.0)  # 4 F + 4 B + 4 W of 1 s

    from megatron_h2.commands import show_timeline as tool

    fig = tool.figure(spans, {0: "stage 0"}, {0: 0}, iterations=1)
    bars = fig.axes[0].collections
    hatched = [b for b in bars if b.get_hatch()]
    assert len(hatched) == 4  # the W passes
    colours = {tuple(b.get_facecolor()[0][:3]) for b in bars if not b.get_hatch()
               and b.get_alpha() == pytest.approx(0.45)}
    assert len(colours) == 2  # forwards of chunk 0 and chunk 1
    assert tool.main([str(merge_and_write(tmp_path / "t.json", [timeline.events()])),
                      "--output", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").stat().st_size > 0
