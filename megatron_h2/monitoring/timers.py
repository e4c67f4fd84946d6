"""Megatron's timers (``--timing-log-level``, ``--timing-log-option``,
``--log-timers-to-tensorboard``): named wall-clock timers at levels 1 (about once per iteration)
and 2 (per micro-batch), reported over ranks at each log line.

Level 0 times nothing beyond the iteration. A timer of a level above ``--timing-log-level`` costs
one comparison; an active one synchronises the device at both ends, so it measures the work and
not the queueing (this is what makes levels 1 and 2 slower, as Megatron warns).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch.distributed as dist

from megatron_h2.devices import Accelerator
from megatron_h2.distributed.topology import Topology

ORDER = ("forward-backward", "forward-compute", "backward-compute", "pipeline-send-wait",
         "pipeline-recv-wait", "all-grads-sync", "optimizer")
"""The timers this run has, in the order they are reported; level 1: forward-backward (the
pipeline schedule), all-grads-sync (tied-embedding and data-parallel gradient sums),
optimizer (clipping and the update); level 2: forward-compute and backward-compute (summed over
micro-batches), pipeline-send-wait and pipeline-recv-wait (time blocked on stage boundaries)."""


class Timers:
    """This rank's timers; ``level`` is ``--timing-log-level``."""

    def __init__(self, level: int, acc: Accelerator) -> None:
        self.level, self.acc = level, acc
        self._elapsed: dict[str, float] = defaultdict(float)
        self._started: dict[str, float] = {}

    def active(self, level: int) -> bool:
        return 0 < level <= self.level

    def start(self, name: str, level: int) -> None:
        if self.active(level):
            self.acc.synchronize()
            self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        begun = self._started.pop(name, None)
        if begun is not None:
            self.acc.synchronize()
            self._elapsed[name] += time.perf_counter() - begun

    def add(self, name: str, level: int, seconds: float) -> None:
        """Time measured elsewhere (per micro-batch compute, communication waits)."""
        if self.active(level):
            self._elapsed[name] += seconds

    def take(self) -> dict[str, float]:
        """Seconds per timer since the last call."""
        out, self._elapsed = dict(self._elapsed), defaultdict(float)
        return out


def report_timers(mine: dict[str, float], topo: Topology, option: str, iterations: int
                  ) -> tuple[list[str], dict[str, float]]:
    """Log lines of every rank's timers in ms per iteration, as Megatron prints them
    (``option``: max, minmax or all), and the maximum over ranks of each (for TensorBoard).
    Collective over the job."""
    every = [mine]
    if topo.distributed:
        every = [None] * topo.world_size
        dist.all_gather_object(every, mine, group=topo.cpu_group)
    names = [n for n in ORDER if any(n in r for r in every)]
    if not names:
        return [], {}
    per_rank = {n: [r.get(n, 0.0) * 1e3 / iterations for r in every] for n in names}
    header = {"max": "max time across ranks (ms):",
              "minmax": "(min, max) time across ranks (ms):",
              "all": "times across ranks (ms):"}[option]
    lines = [header]
    for name, values in per_rank.items():
        if option == "max":
            shown = f"{max(values):.2f}"
        elif option == "minmax":
            shown = f"({min(values):.2f}, {max(values):.2f})"
        else:
            shown = "(" + ", ".join(f"{v:.2f}" for v in values) + ")"
        lines.append(f"    {name} {'.' * max(2, 40 - len(name))}: {shown}")
    return lines, {name: max(values) for name, values in per_rank.items()}
