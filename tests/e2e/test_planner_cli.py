"""tools/plan.py run as a script: it writes a plan, and bad input is one line with exit
status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_planner_cli_main import CPU_CLUSTER, TINY
from tests.helpers.paths import ROOT


@pytest.mark.e2e
def test_tools_plan_py_runs_as_a_script(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/plan.py"),
            "--cluster",
            CPU_CLUSTER,
            "--model",
            TINY,
            "--micro-batch-size",
            "2",
            "--output",
            str(tmp_path / "p.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    bad = subprocess.run(
        [sys.executable, str(ROOT / "tools/plan.py"), "--cluster", CPU_CLUSTER],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        bad.returncode == 2
        and bad.stderr.startswith("error: ")
        and len(bad.stderr.strip().splitlines()) == 1
    )
