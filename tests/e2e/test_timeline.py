"""The pipeline timeline across processes: each rank's events gathered and written as one trace
by rank 0, with the summary."""

from __future__ import annotations

import json

import pytest

from megatron_h2.monitoring.timeline import Timeline, gather_and_write
from tests.helpers.dist_utils import run_distributed
from tests.unit.monitoring.test_timeline import T0


def _gather_worker(rank: int, world_size: int, path: str):
    timeline = Timeline(rank, stage=rank, enabled=True, label=f"stage {rank}")
    timeline.set_iteration(1)
    timeline.record("forward", 0, T0 + rank, T0 + rank + 1.0)
    return gather_and_write(timeline, path)


@pytest.mark.e2e
def test_gather_and_write_across_processes(tmp_path):
    path = tmp_path / "trace.json"
    results = run_distributed(_gather_worker, 2, str(path))
    assert results[1] is None
    assert results[0][0]["compute_s"] == pytest.approx(1.0)
    assert results[0][1]["bubble"] == pytest.approx(0.5)
    trace = json.loads(path.read_text())
    spans = sorted((e["tid"], e["ts"]) for e in trace["traceEvents"] if e["ph"] == "X")
    assert spans == [(0, 0.0), (1, pytest.approx(1.0e6, abs=1))]
