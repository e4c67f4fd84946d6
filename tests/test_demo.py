"""The README's main command: plan the CPU-emulated cluster, train the plan on the embedded
corpus under torchrun, draw the timelines (scripts/demo.sh, shortened to 2 iterations)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e  # every test here starts processes

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs_the_whole_path(tmp_path):
    out = tmp_path / "demo"
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), ITERS="2",
               MEGATRON_H2_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], capture_output=True,
                          text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    plan = yaml.safe_load((out / "plan.yaml").read_text())
    assert {s["chip"] for s in plan["stages"]} == {"fast", "slow"}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["iteration"] == 2 and rows[-1]["lm_loss"] > 0
    for name in ("predicted_timeline.png", "measured_timeline.png", "timeline.json"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert "emulating a chip 2x slower" in proc.stdout and "bridge" in proc.stdout
