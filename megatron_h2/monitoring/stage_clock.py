"""Per-rank compute accounting: times every micro-batch's forward and backward, pads it when
the plan emulates a slower chip, feeds the timeline, and reduces per-stage figures for the logs.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_h2.devices import Accelerator
from megatron_h2.distributed.topology import Topology


class Recorder(Protocol):
    def record(self, kind: str, micro_batch: int, start_s: float, end_s: float,
               iteration: int | None = None, chunk: int = 0) -> None: ...


def emulation_pad_s(slowdown: float, wall_s: float, cpu_s: float | None) -> float:
    """Sleep that makes a pass of ``wall_s`` seconds look like one on a chip ``slowdown`` times
    slower: ``(slowdown - 1)`` times the pass's own work. On the CPU that is the thread's CPU
    time ``cpu_s`` (compute runs on the calling thread), not the wall time, which also counts
    the time other processes held the core: padding that would multiply every millisecond they
    take by ``slowdown - 1`` (on a busy host, several times over for a slow chip). Without a CPU
    time (other devices compute asynchronously), the wall time."""
    if slowdown <= 1.0:
        return 0.0
    return (slowdown - 1.0) * (wall_s if cpu_s is None else min(cpu_s, wall_s))


def thread_cpu_s(acc: Accelerator) -> float | None:
    """This thread's CPU time where it is what a pass computes (the CPU device), else None."""
    return time.thread_time() if acc.device_type == "cpu" else None


class StageClock:
    """A :class:`~megatron_h2.pipeline.schedule_runner.ComputeObserver` for one rank.

    ``slowdown`` > 1 makes each forward / backward (and weight-gradient pass) take that many
    times as long (it sleeps for :func:`emulation_pad_s`), so a heterogeneous cluster can be
    rehearsed on one machine.
    """

    def __init__(self, acc: Accelerator, slowdown: float = 1.0,
                 recorder: Recorder | None = None, synchronize: bool = False) -> None:
        """``synchronize``: wait for the device after each pass even without a recorder or
        slowdown (per micro-batch timers, ``--timing-log-level 2``)."""
        self.acc, self.slowdown, self.recorder = acc, slowdown, recorder
        self.synchronize = synchronize
        self.compute_s = 0.0
        self.padded_s = 0.0
        self.by_kind: dict[str, float] = {}  # seconds per kind since take_kinds()

    @contextlib.contextmanager
    def compute(self, kind: str, micro_batch: int, chunk: int = 0) -> Iterator[None]:
        wall = time.time()
        start, cpu = time.perf_counter(), thread_cpu_s(self.acc)
        yield
        if self.slowdown != 1.0 or self.recorder is not None or self.synchronize:
            self.acc.synchronize()
        elapsed = time.perf_counter() - start
        if self.slowdown > 1.0:
            pad = emulation_pad_s(self.slowdown, elapsed,
                                  None if cpu is None else thread_cpu_s(self.acc) - cpu)
            time.sleep(pad)
            self.padded_s += pad
            elapsed += pad
        self.compute_s += elapsed
        self.by_kind[kind] = self.by_kind.get(kind, 0.0) + elapsed
        if self.recorder is not None:
            self.recorder.record(kind, micro_batch, wall, wall + elapsed, chunk=chunk)

    def take(self) -> float:
        """Compute seconds since the last call."""
        value, self.compute_s = self.compute_s, 0.0
        return value

    def take_kinds(self) -> dict[str, float]:
        """Compute seconds per kind (forward, backward, ...) since the last call."""
        value, self.by_kind = self.by_kind, {}
        return value


STRAGGLER_THRESHOLD = 0.2
"""A rank whose compute is this much above its peers' median is reported as a straggler."""


def straggler_report(chips: list[str], stages: list[int], compute_s: list[float],
                     threshold: float = STRAGGLER_THRESHOLD) -> str:
    """``stragglers: fast: rank 3 +45%; slow: none`` for ranks (indexed by rank) whose compute
    is more than ``threshold`` above the median of their peers: the ranks of their stage, which
    run the same layers on the same chip type with the same TP (comparing stages of one type
    that hold different layers would flag the work, not the chip)."""
    by_stage: dict[int, list[float]] = {}
    for stage, seconds in zip(stages, compute_s):
        by_stage.setdefault(stage, []).append(seconds)
    medians = {stage: statistics.median(values) for stage, values in by_stage.items()}
    found: dict[str, list[str]] = {chip: [] for chip in dict.fromkeys(chips)}
    for rank, (chip, stage, seconds) in enumerate(zip(chips, stages, compute_s)):
        median = medians[stage]
        if median > 0 and seconds > (1.0 + threshold) * median:
            found[chip].append(f"rank {rank} +{seconds / median - 1.0:.0%}")
    parts = [f"{chip}: {', '.join(ranks) if ranks else 'none'}" for chip, ranks in found.items()]
    return f"stragglers (> {threshold:.0%} over their stage's median): " + "; ".join(parts)


def stage_report(topo: Topology, compute_s: float, wall_s: float, comm: dict[str, float],
                 iterations: int) -> str:
    """One log line with every stage's compute per iteration, bubble share and bridge traffic,
    and the stragglers of every chip type (with data-parallel pipelines, every stage of every
    pipeline, and the gradients they sent each other).

    Collective over the job (all ranks call it at the same iterations); each stage is reported
    by the slowest of its ranks.
    """
    mine = torch.tensor([float(topo.stage), compute_s, wall_s, comm.get("bridge_bytes", 0.0),
                         comm.get("direct_bytes", 0.0),
                         comm.get("send_wait_s", 0.0) + comm.get("recv_wait_s", 0.0),
                         float(topo.pipeline), comm.get("pipelines_bytes", 0.0)],
                        dtype=torch.float64)
    rows = [mine]
    if topo.distributed:
        rows = [torch.zeros_like(mine) for _ in range(topo.world_size)]
        dist.all_gather(rows, mine, group=topo.cpu_group)
    job = topo.job_plan or topo.plan
    several = job.num_pipelines > 1
    places = [(k, s) for k, pipe in enumerate(job.pipeline_plans)
              for s in range(pipe.pipeline_parallel_size)]
    parts, bridge, direct, wait = [], 0.0, 0.0, 0.0
    for pipeline, stage in places:
        mine_rows = [r for r in rows if (int(r[6]), int(r[0])) == (pipeline, stage)]
        compute = max(float(r[1]) for r in mine_rows) / iterations
        wall = max(float(r[2]) for r in mine_rows) / iterations
        bubble = max(0.0, 1.0 - compute / wall) if wall > 0 else 0.0
        where = f"pipeline {pipeline} stage {stage}" if several else f"stage {stage}"
        parts.append(f"{where}: compute {compute * 1e3:.1f} ms, bubble {bubble:.0%}")
    for r in rows:
        bridge, direct, wait = bridge + float(r[3]), direct + float(r[4]), max(wait, float(r[5]))
    traffic = (f"bridge {bridge / iterations / 2**20:.2f} MiB/it, direct "
               f"{direct / iterations / 2**20:.2f} MiB/it, max comm wait "
               f"{wait / iterations * 1e3:.1f} ms/it")
    if several:
        across = sum(float(r[7]) for r in rows) / iterations / 2**20
        traffic += f", gradients across pipelines {across:.2f} MiB/it"
    keys = [(int(r[6]), int(r[0])) for r in rows]
    chips = [job.pipeline_plans[k].stages[s].chip for k, s in keys]
    stragglers = straggler_report(chips, [places.index(key) for key in keys],
                                  [float(r[1]) / iterations for r in rows])
    return " | ".join(parts) + " | " + traffic + " | " + stragglers
