"""Pipeline timeline: each rank's forward, backward and communication as a Chrome / Perfetto trace.

``--timeline-trace FILE`` makes training record, on every rank, when each micro-batch's forward,
backward, sends and receives ran, and write them as one trace that chrome://tracing and
https://ui.perfetto.dev open: one process row per pipeline stage, one thread row per global
rank, so pipeline bubbles and slow stages show at a glance.

How the pieces fit::

    timeline = Timeline(rank, stage, enabled=bool(args.timeline_trace), label=stage_label(...))
    timeline.set_iteration(iteration)                  # once per training step
    with timeline.span("forward", micro_batch): ...    # compute
    timeline.on_comm("recv_forward", mb, t0, t1)       # called by the p2p layer (time.time())
    gather_and_write(timeline, args.timeline_trace)    # collective at the end; rank 0 writes

Times are wall-clock seconds from :func:`time.time`, comparable across processes of one machine
and across NTP-synchronised nodes. Events keep absolute timestamps until
:func:`merge_and_write`, which shifts every rank's events by one common origin (the earliest
event over all ranks), so the rows line up.

Memory is bounded: a rank keeps the events of its first ``max_iterations`` distinct iterations
(default 20) and at most ``max_events`` events; later calls are counted as dropped and cost one
comparison. The bound and the drop counts are written into the trace's ``otherData``. A disabled
timeline returns from every call at once, allocating nothing.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_h2.plan.schema import HeteroPlan

TraceEvent = dict[str, Any]

DEFAULT_MAX_ITERATIONS = 20
DEFAULT_MAX_EVENTS = 500_000
COMPUTE_KINDS = frozenset({"forward", "backward", "backward_input", "backward_weight"})
"""``backward`` is a whole backward; zero-bubble splits it into ``backward_input`` (B: the input
gradient) and ``backward_weight`` (W: the weight gradients, deferred)."""
_LETTER = {"forward": "F", "backward": "B", "backward_input": "B", "backward_weight": "W"}
_COMM_PART = re.compile(r"(send|recv)_(forward|backward)")
_PIPELINE_ROW = re.compile(r"pipeline (\d+) stage (\d+)")


def is_comm_kind(kind: str) -> bool:
    """True for kinds that count as communication wait: ``send*``, ``recv*`` and ``wait``."""
    return kind == "wait" or kind.startswith(("send", "recv"))


def event_name(kind: str, micro_batch: int, chunk: int | None = None) -> str:
    """Short name shown on a trace slice: ``F3``, ``B3``, ``W3``, ``send F3``, ``recv B3``,
    ``optimizer``; with a ``chunk`` (virtual pipeline stages) ``F3 c1``, ``send F3 c1``.

    Combined kinds such as ``send_forward_recv_backward`` become ``send F3 + recv B``; unknown
    kinds are shown as ``<kind> <micro_batch>`` (or the bare kind for a negative micro-batch).
    """
    tail = "" if chunk is None else f" c{chunk}"
    if kind in COMPUTE_KINDS:
        return f"{_LETTER[kind]}{micro_batch}{tail}"
    parts = _COMM_PART.findall(kind)
    if parts and "_".join(f"{op}_{way}" for op, way in parts) == kind:
        names = [f"{op} {way[0].upper()}" for op, way in parts]
        names[0] += str(micro_batch) if micro_batch >= 0 else ""
        return " + ".join(names) + tail
    return kind if micro_batch < 0 else f"{kind} {micro_batch}"


def stage_label(stage: int, chip: str, tensor_parallel_size: int,
                data_parallel_size: int | None = None) -> str:
    """The process-row title of a stage, e.g. ``stage 1 (chip slow, TP 2)``, or with the
    stage's own DP degree ``stage 1 (chip slow, TP 2, DP 3)``."""
    dp = "" if data_parallel_size is None else f", DP {data_parallel_size}"
    return f"stage {stage} (chip {chip}, TP {tensor_parallel_size}{dp})"


class Timeline:
    """Intervals one rank spent in forward, backward, communication and the optimizer.

    ``rank`` is the global rank (the trace's thread id), ``stage`` its pipeline stage (the
    process id), ``label`` the stage row's title (default ``stage <s>``). Only the first
    ``max_iterations`` distinct iterations and at most ``max_events`` events are kept.
    ``chunks`` > 1 (virtual pipeline stages): events name their model chunk and carry it in
    ``args.chunk``.
    """

    def __init__(self, rank: int, stage: int, enabled: bool, label: str | None = None,
                 max_iterations: int = DEFAULT_MAX_ITERATIONS,
                 max_events: int = DEFAULT_MAX_EVENTS, chunks: int = 1) -> None:
        if max_iterations < 1 or max_events < 1:
            raise ValueError(f"max_iterations ({max_iterations}) and max_events ({max_events})"
                             " must be positive")
        self.rank, self.stage, self.enabled, self.chunks = rank, stage, enabled, chunks
        self.label = label or f"stage {stage}"
        self.max_iterations, self.max_events = max_iterations, max_events
        self.dropped = 0
        self._iteration = 0
        self._iterations: set[int] = set()
        self._records: list[tuple[str, int, int, float, float, int]] = []
        self._null: AbstractContextManager[None] = nullcontext()

    @classmethod
    def for_plan(cls, plan: HeteroPlan, rank: int, enabled: bool,
                 max_iterations: int = DEFAULT_MAX_ITERATIONS) -> Timeline:
        """A timeline for ``rank`` of ``plan``, its stage row titled with chip and TP degree (and
        DP degree where the stages have their own). With data-parallel pipelines each pipeline's
        stages get rows of their own, after the rows of the pipelines before it, titled
        ``pipeline k stage s (...)``."""
        pipeline = plan.pipeline_of_rank(rank)
        pipe = plan.pipeline_plans[pipeline]
        stage = pipe.rank_coordinates(rank)[0]
        spec = pipe.stages[stage]
        dp = None if pipe.uniform_dp else pipe.stage_dp(stage)
        label = stage_label(stage, spec.chip, spec.tensor_parallel_size, dp)
        row = stage
        if plan.pipelines:
            row += sum(len(p.stages) for p in plan.pipelines[:pipeline])
            label = f"pipeline {pipeline} {label}"
        return cls(rank, row, enabled, label, max_iterations=max_iterations,
                   chunks=pipe.virtual_pipeline_size)

    @property
    def iteration(self) -> int:
        """The iteration that records without an explicit one are filed under (default 0)."""
        return self._iteration

    @property
    def recording(self) -> bool:
        """Whether a record for the current iteration would be kept right now."""
        return self.enabled and len(self._records) < self.max_events and (
            self._iteration in self._iterations or len(self._iterations) < self.max_iterations)

    def set_iteration(self, iteration: int) -> None:
        """File the following records under ``iteration`` (call once per training step)."""
        self._iteration = iteration

    def record(self, kind: str, micro_batch: int, start_s: float, end_s: float,
               iteration: int | None = None, chunk: int = 0) -> None:
        """Keep one interval: ``kind`` of ``micro_batch`` (on model ``chunk``) ran from
        ``start_s`` to ``end_s``.

        Times are :func:`time.time` seconds; ``micro_batch`` is -1 for work that belongs to no
        micro-batch (the optimizer step); ``iteration`` defaults to :attr:`iteration`.
        """
        if not self.enabled:
            return
        it = self._iteration if iteration is None else iteration
        if it not in self._iterations:
            if len(self._iterations) >= self.max_iterations:
                self.dropped += 1
                return
            self._iterations.add(it)
        if len(self._records) >= self.max_events:
            self.dropped += 1
            return
        self._records.append((kind, micro_batch, it, start_s, end_s, chunk))

    def on_comm(self, kind: str, micro_batch: int, start_s: float, end_s: float,
                chunk: int = 0) -> None:
        """Hook for the pipeline communication layer: one send / receive (``record`` alias)."""
        self.record(kind, micro_batch, start_s, end_s, chunk=chunk)

    def span(self, kind: str, micro_batch: int, chunk: int = 0) -> AbstractContextManager[None]:
        """Context manager that records the time spent inside it as ``kind`` of ``micro_batch``.

        When the timeline is disabled or past its bound it returns a shared no-op context.
        """
        if not self.recording:
            return self._null
        return self._span(kind, micro_batch, chunk)

    @contextmanager
    def _span(self, kind: str, micro_batch: int, chunk: int) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.record(kind, micro_batch, start, time.time(), chunk=chunk)

    def __len__(self) -> int:
        return len(self._records)

    def events(self) -> list[TraceEvent]:
        """This rank's Chrome trace events: metadata rows, then one ``ph: "X"`` per interval.

        Timestamps are absolute (microseconds since the epoch); :func:`merge_and_write` moves
        them to a common origin. A disabled timeline returns an empty list.
        """
        if not self.enabled:
            return []
        pid, tid = self.stage, self.rank
        trace_info = {"name": f"rank {self.rank}", "max_iterations": self.max_iterations,
                      "traced_iterations": sorted(self._iterations),
                      "dropped_events": self.dropped}
        out: list[TraceEvent] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": tid,
             "args": {"name": self.label}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": tid,
             "args": {"sort_index": pid}},
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": trace_info},
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
             "args": {"sort_index": tid}},
        ]
        chunked = self.chunks > 1
        for kind, micro_batch, iteration, start, end, chunk in self._records:
            args = {"iteration": iteration, "micro_batch": micro_batch}
            if chunked and micro_batch >= 0:
                args["chunk"] = chunk
            out.append({"name": event_name(kind, micro_batch, chunk if "chunk" in args else None),
                        "cat": kind, "ph": "X", "ts": start * 1e6,
                        "dur": max(0.0, (end - start) * 1e6), "pid": pid, "tid": tid,
                        "args": args})
        return out


def _spans(per_rank_events: Sequence[Sequence[TraceEvent]]) -> list[TraceEvent]:
    return [e for events in per_rank_events for e in events if e.get("ph") == "X"]


def merge(per_rank_events: Sequence[Sequence[TraceEvent]]) -> dict[str, Any]:
    """One trace object from every rank's :meth:`Timeline.events`, on a common time origin.

    The origin is the earliest ``ts`` over all ranks; metadata events are de-duplicated (the
    first rank of a stage names its row). ``otherData`` records the origin, the iteration bound
    and how many events the bound dropped.
    """
    spans = _spans(per_rank_events)
    origin = min((e["ts"] for e in spans), default=0.0)
    metadata: list[TraceEvent] = []
    seen: set[tuple[Any, ...]] = set()
    bounds, dropped, ranks = set(), 0, set()
    for events in per_rank_events:
        for event in events:
            if event.get("ph") != "M":
                continue
            key = (event["name"], event["pid"],
                   None if event["name"].startswith("process") else event.get("tid"))
            if key in seen:
                continue
            seen.add(key)
            metadata.append(dict(event))
            if event["name"] == "thread_name":
                ranks.add(event["tid"])
                bounds.add(event["args"].get("max_iterations"))
                dropped += event["args"].get("dropped_events", 0)
    shifted = [{**e, "ts": round(e["ts"] - origin, 3), "dur": round(e["dur"], 3)} for e in spans]
    shifted.sort(key=lambda e: (e["ts"], e["pid"], e["tid"]))
    bound = max((b for b in bounds if b is not None), default=None)
    other = {
        "generator": "megatron_h2 timeline",
        "origin_unix_us": origin,
        "ranks": len(ranks),
        "max_iterations": bound,
        "dropped_events": dropped,
        "note": (f"only the first {bound} iterations of each rank are traced; "
                 "ts is microseconds after origin_unix_us" if bound is not None else
                 "ts is microseconds after origin_unix_us"),
    }
    return {"traceEvents": metadata + shifted, "displayTimeUnit": "ms", "otherData": other}


def merge_and_write(path: str | Path, per_rank_events: Sequence[Sequence[TraceEvent]]) -> Path:
    """Merge every rank's events (see :func:`merge`) and write them atomically as JSON.

    The file is written to a temporary name beside ``path`` and renamed over it, so a reader
    never sees half a trace. Returns the path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    trace = merge(per_rank_events)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(trace, fh, separators=(",", ":"))
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def summarize(per_rank_events: Sequence[Sequence[TraceEvent]]) -> dict[int, dict[str, float]]:
    """Per pipeline stage: compute and communication-wait seconds, and the bubble share (with
    data-parallel pipelines, per stage row, each also naming its ``pipeline`` and ``stage``).

    The window is the traced span over all ranks (earliest start to latest end). For each rank,
    compute is its forward + backward time and comm wait its send / receive / wait time; a stage
    reports the mean over its ranks (``ranks`` says how many), and ``bubble`` is
    ``1 - compute_s / window_s``. Returns ``{stage: {"ranks", "compute_s", "comm_wait_s",
    "bubble", "window_s"}}``; empty when nothing was traced.
    """
    spans = _spans(per_rank_events)
    if not spans:
        return {}
    start = min(e["ts"] for e in spans)
    window_s = (max(e["ts"] + e["dur"] for e in spans) - start) / 1e6
    compute: dict[tuple[int, int], float] = {}
    comm: dict[tuple[int, int], float] = {}
    places: dict[int, tuple[float, float]] = {}  # row -> (pipeline, stage) with pipelines
    for events in per_rank_events:
        for e in events:
            if e.get("ph") == "M" and e.get("name") == "process_name":
                found = _PIPELINE_ROW.match(str(e.get("args", {}).get("name", "")))
                if found:
                    places[e["pid"]] = (float(found[1]), float(found[2]))
            if e.get("ph") == "M" and e.get("name") == "thread_name":
                compute.setdefault((e["pid"], e["tid"]), 0.0)
                comm.setdefault((e["pid"], e["tid"]), 0.0)
    for e in spans:
        key = (e["pid"], e["tid"])
        compute.setdefault(key, 0.0)
        comm.setdefault(key, 0.0)
        kind = e.get("cat", "")
        if kind in COMPUTE_KINDS:
            compute[key] += e["dur"] / 1e6
        elif is_comm_kind(kind):
            comm[key] += e["dur"] / 1e6
    summary: dict[int, dict[str, float]] = {}
    for stage in sorted({pid for pid, _ in compute}):
        keys = [key for key in compute if key[0] == stage]
        compute_s = sum(compute[k] for k in keys) / len(keys)
        summary[stage] = {
            "ranks": len(keys),
            "compute_s": compute_s,
            "comm_wait_s": sum(comm[k] for k in keys) / len(keys),
            "bubble": 1.0 - compute_s / window_s if window_s > 0 else 0.0,
            "window_s": window_s,
        }
        if stage in places:
            summary[stage]["pipeline"], summary[stage]["stage"] = places[stage]
    return summary


def format_summary(summary: dict[int, dict[str, float]]) -> str:
    """One log line per stage, e.g. ``stage 1: compute 1.20 s, comm wait 0.30 s, bubble 40.0%``."""
    lines = []
    for stage, row in summary.items():
        where = (f"pipeline {int(row['pipeline'])} stage {int(row['stage'])}"
                 if "pipeline" in row else f"stage {stage}")
        lines.append(f"timeline {where}: compute {row['compute_s']:.3f} s, comm wait "
                     f"{row['comm_wait_s']:.3f} s, bubble {100 * row['bubble']:.1f}% of "
                     f"{row['window_s']:.3f} s ({int(row['ranks'])} rank(s))")
    return "\n".join(lines)


def gather_and_write(timeline: Timeline, path: str | Path,
                     group: Any = None) -> dict[int, dict[str, float]] | None:
    """Collective: gather every rank's events to rank 0, which writes ``path``.

    Every rank of ``group`` (default: the whole job) must call it. Uses
    ``torch.distributed.all_gather_object``; without an initialised process group the local
    events are written directly. Returns :func:`summarize` of the trace on the writing rank and
    ``None`` elsewhere.
    """
    import torch.distributed as dist

    local = timeline.events()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        if dist.get_rank(group) != 0:
            return None
    else:
        gathered = [local]
    merge_and_write(path, gathered)
    return summarize(gathered)
