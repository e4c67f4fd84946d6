"""Elastic re-planning: a 6-process, 2-chip-type plan loses a chip at iteration 8; the launcher
re-plans for the chips left and finishes, exactly as an uninterrupted run of the new plan from
the same checkpoint. Also the SLURM requeue path of scripts/run_elastic.sh."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_h2.plan.schema import HeteroPlan
from tests.helpers.dist_utils import losses
from tests.helpers.fork_run import fork_run
from tests.helpers.paths import ROOT

# Small memories force a pipeline over every chip, as in examples/clusters/cpu_2types.yaml.
CLUSTER = """chips:
  fast: {device: cpu, count: 4, chips_per_node: 4, tflops_bf16: 0.2, memory_gib: 0.0015,
         intra_node_gb_per_s: 5, inter_node_gb_per_s: 1}
  slow: {device: cpu, count: 2, chips_per_node: 2, tflops_bf16: 0.1, memory_gib: 0.003,
         intra_node_gb_per_s: 5, inter_node_gb_per_s: 1}
cross_chip_gb_per_s: 1
"""

MODEL = ["--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32",
         "--max-position-embeddings", "32", "--global-batch-size", "8", "--lr", "3e-3",
         "--micro-batch-size", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--lr-warmup-iters", "2", "--seed", "11", "--train-iters", "20", "--log-interval", "1",
         "--eval-interval", "1000", "--eval-iters", "0", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "256", "--split", "90,10,0",
         # LLaMA-style, the architecture the cluster's memories are sized for
         "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--group-query-attention"]


@pytest.mark.e2e
def test_a_lost_chip_is_replanned_and_training_resumes_exactly(corpus, tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    save, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    train = [*MODEL, "--data-path", corpus, "--data-cache-path", str(tmp_path / "cache"),
             "--save", str(save), "--save-interval", "5", "--log-jsonl", str(log)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATRON_H2_INJECT_FAULT="3:8:kill")
    proc = subprocess.run([sys.executable, "-m", "megatron_h2.elastic.launcher", "--cluster",
                           str(cluster), "--max-restarts", "2", "--planner-time-limit", "10",
                           "--", *train], capture_output=True, text=True, env=env, timeout=400,
                          cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    first = HeteroPlan.from_yaml(save / "elastic" / "plan_attempt0.yaml")
    second = HeteroPlan.from_yaml(save / "elastic" / "plan_attempt1.yaml")
    assert first.world_size == 6 and {s.chip for s in first.stages} == {"fast", "slow"}
    lost = first.stages[first.rank_coordinates(3)[0]].chip
    assert f"rank 3 (chip type '{lost}') is lost" in out
    others = "slow" if lost == "fast" else "fast"
    counts = {"fast": 4, "slow": 2}
    assert re.search(rf"chips available: .*{lost} {counts[lost]} -> {counts[lost] - 1}", out)
    assert f"{others} {counts[others]} -> {counts[others]}" in out
    assert second.world_size <= 5 and second.global_batch_size == first.global_batch_size
    assert "stages: " in out and "expected throughput (cost model): " in out
    assert "resuming from iteration 5" in out
    recovery = re.search(r"recovery took ([0-9.]+) s from detecting the failure to the first "
                         r"iteration \(6\)", out)
    assert recovery, out[-4000:]
    print(f"recovery: {recovery.group(1)} s")

    rows = [json.loads(line) for line in log.read_text().splitlines()]
    iterations = [r["iteration"] for r in rows]
    restart = iterations.index(6, iterations.index(6) + 1)  # the second run of iteration 6
    assert iterations[:restart] == list(range(1, 8))  # killed while running iteration 8
    assert iterations[restart:] == list(range(6, 21))
    assert all(r["consumed_samples"] == r["iteration"] * 8 for r in rows)  # nothing skipped
    after = {r["iteration"]: r["lm_loss"] for r in rows[restart:]}

    # the same new plan, uninterrupted, from the same checkpoint
    ref = tmp_path / "ref"
    ref.mkdir()
    shutil.copytree(save / "iter_0000005", ref / "iter_0000005")
    (ref / "latest_checkpointed_iteration.txt").write_text("5\n")
    ref_log = tmp_path / "ref.jsonl"
    ref_train = [a if a != str(log) else str(ref_log) for a in train]
    ref_train = ref_train[:ref_train.index("--save")] + ref_train[ref_train.index("--save") + 4:]
    done = fork_run(second.world_size, [*ref_train, "--hetero-plan",
                                        str(save / "elastic" / "plan_attempt1.yaml"),
                                        "--load", str(ref)])
    assert done.returncode == 0, done.stderr[-3000:]
    want = losses(ref_log)
    assert sorted(want) == sorted(after) == list(range(6, 21))
    worst = max(abs(after[i] - want[i]) / abs(want[i]) for i in want)
    print(f"largest relative loss difference after the restart: {worst:.2e}")
    assert worst <= 1e-5


def _stub(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.e2e
@pytest.mark.parametrize("status, restarts, requeued", [(75, "0", True), (0, "0", False),
                                                        (2, "0", False), (75, "3", False)])
def test_run_elastic_requeues_under_slurm(tmp_path, status, restarts, requeued):
    """The script under stand-in scontrol and launcher: exit 75 requeues the SLURM job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    _stub(bin_dir / "scontrol", f"#!/bin/sh\necho \"scontrol $*\" >> {calls}\n")
    _stub(bin_dir / "python3", f"#!/bin/sh\necho \"launcher $*\" >> {calls}\nexit {status}\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242",
               SLURM_RESTART_COUNT=restarts)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "run_elastic.sh"), "--cluster", "c.yaml",
                           "--", "--save", "x"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == status
    lines = calls.read_text().splitlines()
    assert lines[0] == "launcher -m megatron_h2.elastic.launcher --cluster c.yaml -- --save x"
    assert ("scontrol requeue 4242" in lines) == requeued


@pytest.mark.e2e
def test_run_elastic_requeues_after_a_signal_with_everything_saved(tmp_path):
    """SLURM's time-limit SIGTERM: the launcher saves and exits 0; the script requeues the job
    (training is not over) and exits 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    started = tmp_path / "started"
    _stub(bin_dir / "scontrol", f"#!/bin/sh\necho \"scontrol $*\" >> {calls}\n")
    _stub(bin_dir / "python3", "#!/bin/sh\n"
          f"trap 'echo \"launcher saved\" >> {calls}; exit 0' TERM\n"
          f"touch {started}\nwhile true; do sleep 0.1; done\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242",
               SLURM_RESTART_COUNT="0")
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "run_elastic.sh"), "--cluster",
                             "c.yaml", "--", "--save", "x"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    lines = calls.read_text().splitlines()
    assert lines == ["launcher saved", "scontrol requeue 4242"]
