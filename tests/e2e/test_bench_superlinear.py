"""bench/bench_superlinear.py end to end: it runs every plan side by side and reports measured
and predicted step times and the ratio of the mixed plan to the chip types alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))

from bench_superlinear import MIXED, PIPELINES  # noqa: E402


@pytest.mark.e2e
def test_bench_runs_every_plan_and_reports_ratios(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_superlinear.py"), "--rounds", "1",
         "--steps", "1", "--skip", "1", "--global-batch-size", "4", "--max-wait", "0",
         "--budget", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert set(rows) == {"fast", "big", MIXED}
    assert rows["fast"]["plan"] == "fast 8 full"
    for row in rows.values():
        assert row["measured"] > 0 and row["predicted"] > 0 and len(row["steps_ms"]) == 1
        assert 0 < row["cores_used"]
    ratios = result["ratios"]
    alone = rows["fast"]["measured"] + rows["big"]["measured"]
    assert ratios["measured"] == pytest.approx(rows[MIXED]["measured"] / alone)
    assert ratios["rounds"] == [ratios["measured"]] and ratios["all_rounds"] == 1
    assert "mixed / sum of the chip types alone, per round" in proc.stdout
    assert "side by side, all used" in proc.stdout  # the three plans ran at once


@pytest.mark.e2e
def test_bench_runs_a_plan_of_pipelines_against_its_types_alone(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_superlinear.py"), "--pipelines",
         "--rounds", "1", "--steps", "1", "--skip", "1", "--global-batch-size", "4",
         "--max-wait", "0", "--budget", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"fast", "big", PIPELINES}
    assert rows[PIPELINES]["plan"].startswith("[fast 8 full] ")  # one pipeline per type
    assert rows[PIPELINES]["processes"] == 2
    for row in rows.values():
        assert row["measured"] > 0 and row["predicted"] > 0
    assert "pipelines / sum of the chip types alone, per round" in proc.stdout
