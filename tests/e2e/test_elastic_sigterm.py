"""SIGTERM to the elastic launcher (as SLURM sends at a time limit) during training: with
--exit-signal-handler every worker saves and stops and the launcher exits 0 without a traceback;
without it the workers end unsaved, and the launcher exits non-zero naming them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_h2.checkpointing import find_latest_iteration, load_checkpoint
from megatron_h2.elastic.launcher import EXIT_TEMPFAIL
from tests.e2e.test_elastic import MODEL
from tests.e2e.test_sigterm_torchrun import _sigterm_after_iteration
from tests.helpers.paths import ROOT

CLUSTER = """chips:
  cpu: {device: cpu, count: 2, chips_per_node: 2, tflops_bf16: 0.2, memory_gib: 1,
        intra_node_gb_per_s: 5, inter_node_gb_per_s: 1}
cross_chip_gb_per_s: 1
"""


def _launch(corpus: str, tmp_path: Path, log: Path, *extra: str) -> subprocess.Popen:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    at = MODEL.index("--train-iters")
    train = [*MODEL[:at], *MODEL[at + 2:], "--train-iters", "100000", "--data-path", corpus,
             "--data-cache-path", str(tmp_path / "cache"), "--save", str(tmp_path / "ckpt"),
             "--save-interval", "1000", *extra]
    cmd = [sys.executable, "-m", "megatron_h2.elastic.launcher", "--cluster", str(cluster),
           "--max-restarts", "2", "--planner-time-limit", "5", "--", *train]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)


@pytest.mark.e2e
def test_sigterm_to_the_elastic_launcher_exits_0_after_every_worker_saved(corpus, tmp_path):
    log = tmp_path / "out.log"
    proc = _launch(corpus, tmp_path, log, "--exit-signal-handler")
    _sigterm_after_iteration(proc, log, 2)
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    line = "elastic: attempt 0 stopped by signal SIGTERM; 2 of 2 workers saved and stopped"
    assert line in out and "failed" not in out, out[-4000:]
    assert "Traceback" not in out and "SignalException" not in out, out[-4000:]
    stopped = find_latest_iteration(tmp_path / "ckpt")
    assert stopped >= 2 and load_checkpoint(tmp_path / "ckpt").iteration == stopped


@pytest.mark.e2e
def test_sigterm_to_the_elastic_launcher_with_unsaved_workers_is_non_zero(corpus, tmp_path):
    log = tmp_path / "out.log"
    proc = _launch(corpus, tmp_path, log)  # no --exit-signal-handler: workers end unsaved
    _sigterm_after_iteration(proc, log, 2)
    out = log.read_text()
    assert proc.returncode == EXIT_TEMPFAIL, out[-4000:]
    assert ("elastic: attempt 0 stopped by signal SIGTERM; 0 of 2 workers saved and stopped; "
            "rank(s) 0, 1 did not save") in out, out[-4000:]
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()
