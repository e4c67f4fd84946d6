"""The planner's time limits count this process's CPU seconds in these tests, not wall seconds,
so that a test whose search must finish within its limit gets the same work done on a machine
that other processes share (as ``bench/bench_planner.py --cpu-clock`` does for the bench)."""

from __future__ import annotations

import importlib
import time
from types import SimpleNamespace

import pytest

CPU_CLOCK = SimpleNamespace(monotonic=time.process_time)


@pytest.fixture(autouse=True)
def cpu_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("search", "pipelines_search"):
        module = importlib.import_module(f"megatron_h2.planner.{name}")
        monkeypatch.setattr(module, "time", CPU_CLOCK)
