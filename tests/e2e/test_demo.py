"""The README's main command: measure this machine, plan the CPU-emulated cluster with that
profile, train the plan on the embedded corpus under torchrun, draw the timelines and compare
the step times (scripts/demo.sh, shortened: quick measurements, 2 iterations)."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.e2e  # every test here starts processes



def test_demo_runs_the_whole_path(tmp_path):
    out = tmp_path / "demo"
    quick = "--max-wait 0 --reps 2 --warmup 1 --window 0.1 --micro-batch-sizes 1"
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), ITERS="2",
               MEGATRON_H2_CACHE=str(tmp_path / "cache"), PROFILE_FLAGS=quick)
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
    assert proc.stdout.count("building default corpus:") == 1  # once for the whole job
    # planned with this machine's measurements: the profile (measured as the plan's processes,
    # all at once) and the cluster file with gloo's bandwidths
    assert "# measured by tools/profile_chip.py --emulate" in (out / "profile.yaml").read_text()
    assert "bandwidths fitted to gloo" in (out / "cluster.yaml").read_text()
    # and with what the plan's processes got of the cores together, each pass's CPU time
    host_cores = yaml.safe_load((out / "cluster.yaml").read_text())["host_cores"]
    assert 0 < host_cores <= 2 * os.cpu_count()
    profile = yaml.safe_load((out / "profile.yaml").read_text())
    assert profile["model"]["hidden_dropout"] == 0.0  # measured with the run's dropout
    fast = profile["chips"]["fast"]
    assert 0 < fast["cpu_micro_batch_sizes"][1]["layer_forward_ms"]
    assert "predicted step time:" in proc.stdout and "measured step time:" in proc.stdout
