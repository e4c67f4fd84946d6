"""Event-driven simulation of one training step of a plan under Megatron's 1F1B schedule.

Every stage runs Megatron's non-interleaved one-forward-one-backward order: stage ``s`` of ``p``
first runs ``min(p - s - 1, m)`` warm-up forwards, then alternates forward and backward in the
steady state, then drains the remaining backwards (cool-down). A forward of micro-batch ``i`` on
stage ``s`` needs the forward of ``i`` on stage ``s - 1`` plus the link time; a backward needs
the backward of ``i`` on stage ``s + 1`` plus the link time (on the last stage, its own forward).
Point-to-point transfers are modelled as latencies that do not occupy the stages (DiComm-style
asynchronous sends). After its last backward each stage runs its DP gradient synchronisation;
the step ends when the last one finishes. Durations come from the cost model.

The result gives the step time, the bubble share, per-stage utilisation and peak memory (from
the simulated peak of micro-batches in flight), and can be written as a timeline picture (PNG,
needs matplotlib) or as a Chrome / Perfetto trace (JSON trace events, open in ui.perfetto.dev).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path

from megatron_h2.config import RECOMPUTE_MODES
from megatron_h2.errors import ConfigError
from megatron_h2.hetero_plan import HeteroPlan
from megatron_h2.planner.cost_model import CostModel, PlanEstimate


@dataclass(frozen=True)
class Event:
    """One interval on one stage: a forward ("F"), backward ("B") or DP sync ("sync")."""

    stage: int
    kind: str
    micro_batch: int
    start_s: float
    end_s: float


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

    @property
    def utilization(self) -> tuple[float, ...]:
        """Per stage: forward + backward time over the step time."""
        return tuple(busy / self.step_time_s for busy in self.busy_s)

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-time not spent in forward or backward (pipeline bubble + DP sync)."""
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.step_time_s)

    def peak_memory_by_chip(self) -> dict[str, float]:
        """Highest simulated peak memory (bytes per chip) over the stages of each chip type."""
        peaks: dict[str, float] = {}
        for stage, peak in zip(self.plan.stages, self.peak_memory_bytes):
            peaks[stage.chip] = max(peaks.get(stage.chip, 0.0), peak)
        return peaks


def one_f_one_b(stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """Megatron's non-interleaved 1F1B order of (kind, micro-batch) for one stage."""
    warmup = min(stages - stage - 1, micro_batches)
    order = [("F", i) for i in range(warmup)]
    steady = micro_batches - warmup
    for i in range(steady):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(steady, micro_batches)]
    return order


def simulate(plan: HeteroPlan, cost: CostModel) -> SimulationResult:
    """Simulate one step of ``plan`` with durations from ``cost`` (see the module docstring)."""
    estimate = cost.evaluate(plan)
    p, m = plan.pipeline_parallel_size, plan.num_micro_batches
    forward = [s.forward_s for s in estimate.stages]
    backward = [s.backward_s for s in estimate.stages]
    links = estimate.link_times_s
    orders = [one_f_one_b(p, m, s) for s in range(p)]
    ends: dict[tuple[str, int, int], float] = {}
    pointer, free = [0] * p, [0.0] * p
    events: list[Event] = []
    wake = [(0.0, s) for s in range(p)]
    heapq.heapify(wake)
    while wake:
        _, s = heapq.heappop(wake)
        while pointer[s] < len(orders[s]):
            kind, i = orders[s][pointer[s]]
            ready = _ready(kind, s, i, p, ends, links)
            if ready is None:
                break  # woken again when the dependency finishes
            start = max(free[s], ready)
            end = start + (forward[s] if kind == "F" else backward[s])
            ends[(kind, s, i)] = end
            events.append(Event(s, kind, i, start, end))
            free[s], pointer[s] = end, pointer[s] + 1
            neighbour = s + 1 if kind == "F" else s - 1
            if 0 <= neighbour < p:
                heapq.heappush(wake, (end, neighbour))
    if any(pointer[s] < len(orders[s]) for s in range(p)):
        raise AssertionError("1F1B simulation deadlocked; the schedule is inconsistent")
    step = 0.0
    for s, stage in enumerate(estimate.stages):
        events.append(Event(s, "sync", -1, free[s], free[s] + stage.dp_sync_s))
        step = max(step, free[s] + stage.dp_sync_s)
    busy = tuple(m * (forward[s] + backward[s]) for s in range(p))
    peaks = _peak_in_flight(events, p)
    memory = tuple(_stage_memory(plan, cost, s, peaks[s]) for s in range(p))
    events.sort(key=lambda e: (e.stage, e.start_s))
    return SimulationResult(plan, estimate, step, tuple(events), busy, peaks, memory)


def _ready(
    kind: str,
    s: int,
    i: int,
    p: int,
    ends: dict[tuple[str, int, int], float],
    links: tuple[float, ...],
) -> float | None:
    """When the input of (kind, stage s, micro-batch i) has arrived, or None if not yet known."""
    if kind == "F":
        if s == 0:
            return 0.0
        end = ends.get(("F", s - 1, i))
        return None if end is None else end + links[s - 1]
    if s == p - 1:
        return ends.get(("F", s, i))
    end = ends.get(("B", s + 1, i))
    return None if end is None else end + links[s]


def _peak_in_flight(events: list[Event], stages: int) -> tuple[int, ...]:
    """Most micro-batches whose activations a stage holds at once.

    A micro-batch is held from the start of its forward to the end of its backward.
    """
    peaks = []
    for s in range(stages):
        changes = sorted(
            [(e.start_s, 1) for e in events if e.stage == s and e.kind == "F"]
            + [(e.end_s, -1) for e in events if e.stage == s and e.kind == "B"],
            key=lambda item: (item[0], item[1]),
        )
        level = peak = 0
        for _, delta in changes:
            level += delta
            peak = max(peak, level)
        peaks.append(peak)
    return tuple(peaks)


def _stage_memory(plan: HeteroPlan, cost: CostModel, s: int, in_flight: int) -> float:
    spec, p = plan.stages[s], plan.pipeline_parallel_size
    costs = cost.stage_costs(
        spec.chip, spec.tensor_parallel_size, plan.micro_batch_size, plan.data_parallel_size
    )
    mode = RECOMPUTE_MODES.index(spec.recompute)
    return costs.memory(spec.num_layers, mode, in_flight, s == 0, s == p - 1)


def chrome_trace(result: SimulationResult) -> dict[str, object]:
    """The simulated step as Chrome / Perfetto trace events (microseconds; one track per stage)."""
    events: list[dict[str, object]] = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": 0,
            "args": {"name": "megatron_h2 plan (simulated)"},
        },
    ]
    for s, spec in enumerate(result.plan.stages):
        label = f"stage {s}: {spec.chip} TP{spec.tensor_parallel_size} {spec.num_layers} layers"
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": label}}
        )
        events.append(
            {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": s, "args": {"sort_index": s}}
        )
    for e in result.events:
        name = "DP sync" if e.kind == "sync" else f"{e.kind}{e.micro_batch}"
        events.append(
            {
                "name": name,
                "cat": e.kind,
                "ph": "X",
                "pid": 0,
                "tid": e.stage,
                "ts": e.start_s * 1e6,
                "dur": (e.end_s - e.start_s) * 1e6,
                "args": {"micro_batch": e.micro_batch, "chip": result.plan.stages[e.stage].chip},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(result: SimulationResult, path: str | Path) -> None:
    """Write :func:`chrome_trace` as JSON."""
    Path(path).write_text(json.dumps(chrome_trace(result)))


def write_timeline_png(result: SimulationResult, path: str | Path) -> None:
    """Draw the simulated step (one row per stage) as a PNG; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError(
            "--timeline needs matplotlib; pip install matplotlib (or use --trace FILE.json)"
        ) from None
    chips = list(dict.fromkeys(stage.chip for stage in result.plan.stages))
    palette = plt.get_cmap("tab10")
    colours = {chip: palette(i % 10) for i, chip in enumerate(chips)}
    p = result.plan.pipeline_parallel_size
    fig, ax = plt.subplots(figsize=(12, 0.45 * p + 1.6))
    for e in result.events:
        chip = result.plan.stages[e.stage].chip
        colour = "0.55" if e.kind == "sync" else colours[chip]
        alpha = 0.55 if e.kind == "F" else 1.0
        ax.broken_barh(
            [(e.start_s, e.end_s - e.start_s)],
            (e.stage - 0.4, 0.8),
            facecolors=colour,
            alpha=alpha,
            edgecolor="white",
            linewidth=0.2,
        )
    ax.set_yticks(range(p))
    ax.set_yticklabels(
        [
            f"{s}: {st.chip} TP{st.tensor_parallel_size} L{st.num_layers}"
            for s, st in enumerate(result.plan.stages)
        ],
        fontsize=7,
    )
    ax.invert_yaxis()
    ax.set_xlabel("time in the step (s)")
    ax.set_title(
        f"1F1B step {result.step_time_s:.3f} s, bubble {100 * result.bubble_fraction:.1f}%"
        f" (light: forward, dark: backward, grey: DP sync)",
        fontsize=9,
    )
    handles = [Patch(color=colours[c], label=c) for c in chips] + [
        Patch(color="0.55", label="DP sync")
    ]
    ax.legend(handles=handles, fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
