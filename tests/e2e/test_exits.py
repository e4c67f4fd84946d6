"""--exit-signal-handler: a SIGTERM to a training process saves and stops it cleanly; without
the flag the process ends at once (Megatron's default)."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.tiny_runs import MODEL


def _signal_run(tmp: Path, corpus: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    log, ckpt = tmp / "log.jsonl", tmp / "ckpt"
    argv = [sys.executable, str(ROOT / "pretrain_gpt.py"), *MODEL, "--data-path", corpus,
            "--train-iters", "100000", "--global-batch-size", "4", "--save", str(ckpt),
            "--log-jsonl", str(log), *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (log.exists() and log.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    return proc, ckpt


@pytest.mark.e2e
def test_exit_signal_handler(corpus, tmp_path):
    """With --exit-signal-handler SIGTERM saves and stops cleanly; without it the process ends
    at once (Megatron's default), leaving no checkpoint."""
    proc, ckpt = _signal_run(tmp_path / "on", corpus, "--exit-signal-handler")
    assert proc.returncode == 0
    assert int((ckpt / "latest_checkpointed_iteration.txt").read_text()) >= 2
    proc, ckpt = _signal_run(tmp_path / "off", corpus)
    assert proc.returncode == -signal.SIGTERM and not list(ckpt.glob("iter_*"))
