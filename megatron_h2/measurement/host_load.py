"""What other processes do to this machine's cores while something is measured (no torch).

Timings taken on shared CPUs are only as good as the quiet they were taken in. :class:`OtherLoad`
measures the cores that processes other than this one and its children used while a block ran;
:func:`wait_for_quiet` waits for them to leave the cores first.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from pathlib import Path

BUSY_CORES = 0.5
"""Other processes above this many cores disturb a measurement."""


def load_average() -> float:
    """The 1-minute load average (NaN where /proc/loadavg is missing)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class OtherLoad:
    """CPU used by processes other than this one and its children while a block runs, in cores.

    /proc/stat counts every process's CPU time; this process's children report theirs through
    getrusage once they have been waited for (so wait for them inside the block). The
    difference over the block's wall time is what others took (NaN where /proc/stat is missing).
    ``own_cores`` is what this process and its waited-for children used meanwhile.
    """

    def __enter__(self) -> OtherLoad:
        self.start = (self._busy(), self._ours(), time.perf_counter())
        self.cores = float("nan")
        self.own_cores = float("nan")
        return self

    def __exit__(self, *exc: object) -> None:
        busy, ours, now = self._busy(), self._ours(), time.perf_counter()
        if now > self.start[2]:
            self.own_cores = (ours - self.start[1]) / (now - self.start[2])
        if busy is not None and self.start[0] is not None and now > self.start[2]:
            other = (busy - self.start[0]) - (ours - self.start[1])
            self.cores = max(other, 0.0) / (now - self.start[2])

    @property
    def disturbed(self) -> bool:
        """Whether others used at least :data:`BUSY_CORES` (False when unknown)."""
        return self.cores >= BUSY_CORES

    @staticmethod
    def _busy() -> float | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _ours() -> float:
        usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return sum(u.ru_utime + u.ru_stime for u in usage)


def wait_for_quiet(budget: list[float], threshold: float = BUSY_CORES,
                   log_wait: Callable[[float], None] | None = None) -> float:
    """Wait (from ``budget[0]`` seconds left overall, which it uses up) until other processes
    use under ``threshold`` cores over one second; returns the last reading."""
    while True:
        with OtherLoad() as probe:
            time.sleep(1.0)
        if probe.cores < threshold or budget[0] <= 0 or probe.cores != probe.cores:
            return probe.cores
        if log_wait:
            log_wait(probe.cores)
        budget[0] -= 1.0
