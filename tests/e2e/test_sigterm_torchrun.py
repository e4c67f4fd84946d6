"""SIGTERM to torchrun (as SLURM sends at a time limit) with --exit-signal-handler: every worker
saves and stops, and the launch exits 0 (torchrun itself exits 1 with a SignalException
traceback); a worker that did not save makes it non-zero."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_h2.checkpointing import find_latest_iteration, load_checkpoint
from tests.helpers.dist_utils import free_port
from tests.helpers.paths import ROOT
from tests.unit.training.test_parallel_training import MODEL


def _launch(corpus: str, save: Path, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_h2.commands.torchrun", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(ROOT / "pretrain_gpt.py"), *MODEL, "--data-path", corpus,
           "--pipeline-model-parallel-size", "2", "--train-iters", "100000", "--save", str(save),
           "--save-interval", "1000", "--log-interval", "1", *extra]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def _sigterm_after_iteration(proc: subprocess.Popen, log: Path, iteration: int) -> str:
    deadline = time.monotonic() + 240
    while f"iteration {iteration:>8}/" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=240)[1]


@pytest.mark.e2e
def test_sigterm_with_the_signal_handler_exits_0_after_every_rank_saved(corpus, tmp_path):
    save, log = tmp_path / "ckpt", tmp_path / "out.log"
    proc = _launch(corpus, save, log, "--exit-signal-handler")
    err = _sigterm_after_iteration(proc, log, 2)
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM received; all 2 workers of this node saved and stopped" in log.read_text()
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    stopped = find_latest_iteration(save)
    assert stopped >= 2 and load_checkpoint(save).iteration == stopped


@pytest.mark.e2e
def test_sigterm_without_the_handler_is_non_zero(corpus, tmp_path):
    save, log = tmp_path / "ckpt", tmp_path / "out.log"
    proc = _launch(corpus, save, log)
    err = _sigterm_after_iteration(proc, log, 2)
    assert proc.returncode == 1
    assert "error: SIGTERM received; local rank(s) 0, 1 of 2 did not save and stop" in err
