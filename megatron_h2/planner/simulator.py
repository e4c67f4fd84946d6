"""Event-driven simulation of one training step of a plan under its pipeline schedule.

Every stage runs its schedule's order of actions (:mod:`.orders`: Megatron's 1F1B, Megatron's
interleaved 1F1B over ``V`` model chunks, or ZB-H1 with the backward split into input-gradient
``B`` and weight-gradient ``W`` work), each action as soon as its input is there and the stage
is free. Model chunk ``c`` of stage ``s`` is virtual stage ``v = c p + s``: a forward of
micro-batch ``i`` on ``v`` needs the forward of ``i`` on ``v - 1`` plus the link time (from the
last stage to the first for ``v = c p``: the wrap-around link), a backward needs the backward on
``v + 1`` plus the link time (on the last virtual stage, its own forward), and a weight-gradient
action follows its stage's own backward. Point-to-point transfers are latencies that do not
occupy the stages (DiComm-style asynchronous sends). After its last action each stage runs its
DP gradient synchronisation (and optimizer step); the step ends when the last one finishes.
Durations come from the cost model.

This is the reference the closed-form step time of :mod:`.cost_model` is checked against. The
result gives the step time, the bubble share, per-stage utilisation and peak memory (walking
each stage's simulated actions), and can be written as a timeline picture (PNG, needs
matplotlib) or a Chrome / Perfetto trace (JSON trace events, open in ui.perfetto.dev).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path

from megatron_h2.config import RECOMPUTE_MODES
from megatron_h2.errors import ConfigError
from megatron_h2.plan.orders import Action, replica_micro_batches, stage_order
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner.cost_model import CostModel, PlanEstimate, replica_warmups

KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient", "sync": "DP sync"}


@dataclass(frozen=True)
class Event:
    """One interval on one stage: forward "F", backward "B" (under zero-bubble the
    input-gradient part), weight-gradient "W" (zero-bubble) or "sync", on model ``chunk``."""

    stage: int
    kind: str
    micro_batch: int
    start_s: float
    end_s: float
    chunk: int = 0
    replica: int = 0
    """DP replica of the stage (0 unless the stages have their own DP degrees)."""


@dataclass(frozen=True)
class SimulationResult:
    """What one simulated step looks like."""

    plan: HeteroPlan
    estimate: PlanEstimate
    step_time_s: float
    events: tuple[Event, ...]
    busy_s: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    peak_memory_bytes: tuple[float, ...]
    replica_events: tuple[Event, ...] = ()
    """Events of the DP replicas other than 0 (stages with their own DP degrees only)."""

    @property
    def utilization(self) -> tuple[float, ...]:
        """Per stage: compute time (F, B, W) over the step time."""
        return tuple(busy / self.step_time_s for busy in self.busy_s)

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-time not spent in compute (pipeline bubble + DP sync)."""
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.step_time_s)

    def peak_memory_by_chip(self) -> dict[str, float]:
        """Highest simulated peak memory (bytes per chip) over the stages of each chip type."""
        peaks: dict[str, float] = {}
        for stage, peak in zip(self.plan.stages, self.peak_memory_bytes):
            peaks[stage.chip] = max(peaks.get(stage.chip, 0.0), peak)
        return peaks


def one_f_one_b(stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """Megatron's non-interleaved 1F1B order of (kind, micro-batch) for one stage."""
    return [(kind, i) for kind, _, i in stage_order("1f1b", stages, micro_batches, 1, stage)]


class _Timing:
    """Durations and link times of a plan's estimate, by (stage, chunk) and virtual hop."""

    def __init__(self, estimate: PlanEstimate) -> None:
        split = estimate.schedule == "zero-bubble"
        self.durations = {
            "F": [s.chunk_forward_s for s in estimate.stages],
            "B": [
                tuple(b - w for b, w in zip(s.chunk_backward_s, s.chunk_weight_s))
                if split
                else s.chunk_backward_s
                for s in estimate.stages
            ],
            "W": [s.chunk_weight_s for s in estimate.stages],
        }
        self.links, self.wrap = estimate.link_times_s, estimate.wrap_link_s
        self.p, self.v = len(estimate.stages), estimate.virtual_pipeline_size

    def duration(self, kind: str, stage: int, chunk: int) -> float:
        return self.durations[kind][stage][chunk]

    def hop(self, sender: int) -> float:
        """Link time from stage ``sender`` to the next stage in virtual order."""
        return self.wrap if sender == self.p - 1 else self.links[sender]

    def ready(
        self, action: Action, stage: int, ends: dict[tuple[str, int, int, int], float]
    ) -> float | None:
        """When the input of ``action`` on ``stage`` has arrived, or None if not yet known."""
        kind, chunk, i = action
        p, v = self.p, chunk * self.p + stage
        if kind == "W":
            return ends[("B", stage, chunk, i)]
        if kind == "F":
            if v == 0:
                return 0.0
            sender = (v - 1) % p
            end = ends.get(("F", sender, (v - 1) // p, i))
            return None if end is None else end + self.hop(sender)
        if v == p * self.v - 1:
            return ends.get(("F", stage, chunk, i))
        end = ends.get(("B", (v + 1) % p, (v + 1) // p, i))
        return None if end is None else end + self.hop(stage)


def simulate(plan: HeteroPlan, cost: CostModel) -> SimulationResult:
    """Simulate one step of ``plan`` with durations from ``cost`` (see the module docstring).

    Stages with their own DP degree: every DP replica runs its own order over its micro-batches
    (``j mod DP_s``, :func:`~megatron_h2.plan.orders.routed_warmups` warm-up forwards) and
    micro-batch ``j`` goes through replica ``j mod DP_s`` of every stage; a stage's DP sync
    starts when its last replica is done. Under uniform DP the replicas are alike and one is
    simulated. Events, busy time and memory are those of replica 0 of each stage (the events of
    the others are in :attr:`SimulationResult.replica_events`).
    """
    estimate = cost.evaluate(plan)
    p, v = plan.pipeline_parallel_size, plan.virtual_pipeline_size
    if plan.uniform_dp:
        dps, total, warmups = [1] * p, plan.num_micro_batches, [None] * p
    else:
        dps, total = [plan.stage_dp(s) for s in range(p)], plan.total_micro_batches
        warmups = replica_warmups(str(plan.schedule), dps, v, total)
    timing = _Timing(estimate)
    actors = [(s, r) for s in range(p) for r in range(dps[s])]
    orders = {
        (s, r): stage_order(
            str(plan.schedule), p, replica_micro_batches(total, dps, s, r, v), v, s, warmups[s]
        )
        for s, r in actors
    }
    ends: dict[tuple[str, int, int, int], float] = {}
    pointer, free = dict.fromkeys(actors, 0), dict.fromkeys(actors, 0.0)
    events: list[Event] = []
    wake = [(0.0, actor) for actor in actors]
    heapq.heapify(wake)
    while wake:
        _, actor = heapq.heappop(wake)
        s, order = actor[0], orders[actor]
        while pointer[actor] < len(order):
            action = order[pointer[actor]]
            ready = timing.ready(action, s, ends)
            if ready is None:
                break  # woken again when the dependency finishes
            kind, chunk, i = action
            start = max(free[actor], ready)
            end = start + timing.duration(kind, s, chunk)
            ends[(kind, s, chunk, i)] = end
            events.append(Event(s, kind, i, start, end, chunk, actor[1]))
            free[actor], pointer[actor] = end, pointer[actor] + 1
            if kind != "W" and p > 1:
                other = (s + 1) % p if kind == "F" else (s - 1) % p
                heapq.heappush(wake, (end, (other, i % dps[other])))
    if any(pointer[actor] < len(orders[actor]) for actor in actors):
        raise AssertionError("pipeline simulation deadlocked; the schedule is inconsistent")
    step = 0.0
    for s, stage in enumerate(estimate.stages):
        done = max(free[(s, r)] for r in range(dps[s]))
        events.append(Event(s, "sync", -1, done, done + stage.dp_sync_s))
        step = max(step, done + stage.dp_sync_s)
    if cost.cluster.host_cores is not None:  # CPU emulation: the processes share the cores
        step = max(step, estimate.host_cpu_s / cost.cluster.host_cores)
    shown = [e for e in events if e.replica == 0]
    busy = tuple(
        sum(e.end_s - e.start_s for e in shown if e.stage == s and e.kind != "sync")
        for s in range(p)
    )
    shown.sort(key=lambda e: (e.stage, e.start_s))
    peaks, memory = zip(*(_walk_memory(plan, cost, shown, s) for s in range(p)))
    others = tuple(sorted((e for e in events if e.replica), key=lambda e: (e.stage, e.start_s)))
    return SimulationResult(plan, estimate, step, tuple(shown), busy, peaks, memory, others)


def _walk_memory(
    plan: HeteroPlan, cost: CostModel, events: list[Event], s: int
) -> tuple[int, float]:
    """Peak chunk-micro-batches in flight and peak memory of stage ``s`` along its events."""
    spec, p = plan.stages[s], plan.pipeline_parallel_size
    dp, ranges = plan.stage_dp(s), plan.chunk_layer_ranges()[s]
    ep, etp = cost.stage_expert_parallel(spec, dp), cost.stage_expert_tp(spec)
    per_chunk = tuple(
        cost.stage_layer_costs(spec.chip, spec.tensor_parallel_size, plan.micro_batch_size, dp,
                               ep, r, etp)
        for r in ranges
    )  # by the dense and MoE layers each chunk holds
    costs = per_chunk[0]
    mode = RECOMPUTE_MODES.index(spec.recompute)
    chunks = spec.chunks
    active, deferred = [0] * len(chunks), [0] * len(chunks)
    split = plan.schedule == "zero-bubble"
    peak_count, peak_bytes = 0, 0.0
    for e in (e for e in events if e.stage == s):
        if e.kind == "F":
            active[e.chunk] += 1
        elif e.kind == "B":
            active[e.chunk] -= 1
            deferred[e.chunk] += 1 if split else 0
        elif e.kind == "W":
            deferred[e.chunk] -= 1
        state = ((tuple(active), tuple(deferred)),)
        peak_count = max(peak_count, sum(active))
        held = costs.held_memory(chunks, mode, state, s == 0, s == p - 1, per_chunk)
        peak_bytes = max(peak_bytes, held)
    return peak_count, peak_bytes


def event_name(event: Event, chunks: int) -> str:
    """Short label: ``F3`` (forward of micro-batch 3), ``B3 c1`` (backward on chunk 1), ``W3``."""
    if event.kind == "sync":
        return "DP sync"
    chunk = f" c{event.chunk}" if chunks > 1 else ""
    return f"{event.kind}{event.micro_batch}{chunk}"


def chrome_trace(result: SimulationResult) -> dict[str, object]:
    """The simulated step as Chrome / Perfetto trace events (microseconds; one track per stage).

    Each event is named by :func:`event_name` and carries its kind, micro-batch and model chunk.
    """
    plan = result.plan
    label = f"megatron_h2 plan (simulated, {schedule_label(plan)})"
    events: list[dict[str, object]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": label}},
    ]
    for s, spec in enumerate(plan.stages):
        layers = "/".join(str(n) for n in spec.chunks)
        label = f"stage {s}: {spec.chip} TP{spec.tensor_parallel_size} {layers} layers"
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": label}}
        )
        events.append(
            {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": s, "args": {"sort_index": s}}
        )
    v = plan.virtual_pipeline_size
    for e in result.events:
        events.append(
            {
                "name": event_name(e, v),
                "cat": KIND_NAMES[e.kind],
                "ph": "X",
                "pid": 0,
                "tid": e.stage,
                "ts": e.start_s * 1e6,
                "dur": (e.end_s - e.start_s) * 1e6,
                "args": {
                    "micro_batch": e.micro_batch,
                    "chunk": e.chunk,
                    "chip": plan.stages[e.stage].chip,
                },
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def schedule_label(plan: HeteroPlan) -> str:
    """``1F1B``, ``interleaved 1F1B, V=2`` or ``zero-bubble (ZB-H1)``."""
    if plan.schedule == "interleaved":
        return f"interleaved 1F1B, V={plan.virtual_pipeline_size}"
    return "zero-bubble (ZB-H1)" if plan.schedule == "zero-bubble" else "1F1B"


def write_chrome_trace(result: SimulationResult, path: str | Path) -> None:
    """Write :func:`chrome_trace` as JSON."""
    Path(path).write_text(json.dumps(chrome_trace(result)))


CHUNK_HATCHES = ("", "..", "oo", "**", "++", "OO")
"""Hatching of model chunks 0, 1, ... in the timeline picture."""


def write_timeline_png(result: SimulationResult, path: str | Path) -> None:
    """Draw the simulated step (one row per stage) as a PNG; needs matplotlib.

    Colour: the chip type; light: forward, dark: backward (its input-gradient part under
    zero-bubble), mid with ``//``: deferred weight-gradient work, grey: DP sync; model chunks
    1, 2, ... are hatched ``..``, ``oo``, ... on top.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError(
            "--timeline needs matplotlib; pip install matplotlib (or use --trace FILE.json)"
        ) from None
    plan = result.plan
    chips = list(dict.fromkeys(stage.chip for stage in plan.stages))
    palette = plt.get_cmap("tab10")
    colours = {chip: palette(i % 10) for i, chip in enumerate(chips)}
    p, v = plan.pipeline_parallel_size, plan.virtual_pipeline_size
    fig, ax = plt.subplots(figsize=(13, 0.45 * p + 1.8))
    shade = {"F": 0.45, "B": 1.0, "W": 0.75}
    bars: dict[tuple[int, object, float, str], list[tuple[float, float]]] = {}
    for e in result.events:  # one broken_barh per stage and look (per event: quadratic)
        colour = "0.55" if e.kind == "sync" else colours[plan.stages[e.stage].chip]
        hatch = CHUNK_HATCHES[e.chunk % len(CHUNK_HATCHES)] if v > 1 else ""
        if e.kind == "W":
            hatch += "//"
        look = (e.stage, colour, shade.get(e.kind, 1.0), hatch)
        bars.setdefault(look, []).append((e.start_s, e.end_s - e.start_s))
    for (stage, colour, alpha, hatch), ranges in bars.items():
        ax.broken_barh(
            ranges,
            (stage - 0.4, 0.8),
            facecolors=colour,
            alpha=alpha,
            edgecolor="white",
            linewidth=0.2,
            hatch=hatch or None,
        )
    ax.set_yticks(range(p))
    ax.set_yticklabels(
        [
            f"{s}: {st.chip} TP{st.tensor_parallel_size} L{'/'.join(str(n) for n in st.chunks)}"
            for s, st in enumerate(plan.stages)
        ],
        fontsize=7,
    )
    ax.invert_yaxis()
    ax.set_xlabel("time in the step (s)")
    parts = ["light: forward", "dark: backward"]
    if plan.schedule == "zero-bubble":
        parts = ["light: forward", "dark: input gradients", "//: weight gradients"]
    if v > 1:
        parts.append("chunk 1+ hatched")
    ax.set_title(
        f"{schedule_label(plan)} step {result.step_time_s:.3f} s, bubble"
        f" {100 * result.bubble_fraction:.1f}% ({', '.join(parts)}, grey: DP sync)",
        fontsize=9,
    )
    handles = [Patch(color=colours[c], label=c) for c in chips] + [
        Patch(color="0.55", label="DP sync")
    ]
    if plan.schedule == "zero-bubble":
        handles.append(Patch(facecolor="white", edgecolor="0.3", hatch="//", label="W"))
    handles += [
        Patch(facecolor="white", edgecolor="0.3", hatch=CHUNK_HATCHES[c], label=f"chunk {c}")
        for c in range(1, v)
    ]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
