"""Workers never outlive their launcher: kill -9 of the torchrun agent makes its workers save
and stop instead of training on as orphans."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_h2.checkpointing import load_checkpoint
from tests.helpers.dist_utils import free_port
from tests.helpers.paths import ROOT
from tests.helpers.procs import process_table
from tests.helpers.tiny_runs import flags


def _children(pid: int) -> list[int]:
    return [p for p, (_, parent) in process_table().items() if parent == pid]


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.e2e
def test_killing_the_agent_makes_its_workers_save_and_exit(corpus, tmp_path):
    save, out = tmp_path / "ckpt", tmp_path / "out.txt"
    args = flags(corpus, tmp_path, "--train-iters", "100000", "--lr-warmup-iters", "1",
                 "--log-interval", "1", "--save", str(save), "--eval-iters", "0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(ROOT / "pretrain_gpt.py"), *args]
    with open(out, "w") as fh:
        agent = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, OMP_NUM_THREADS="1"))
    workers: list[int] = []
    try:
        log = tmp_path / "log.jsonl"
        deadline = time.monotonic() + 120
        while not (log.exists() and len(log.read_text().splitlines()) >= 2):
            assert agent.poll() is None, out.read_text()[-3000:]
            assert time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.2)
        workers = _children(agent.pid)
        assert len(workers) == 2
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        deadline = time.monotonic() + 90
        while any(_running(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        text = out.read_text()
        assert not any(_running(w) for w in workers), text[-3000:]
    finally:
        for pid in workers:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    assert f"the launcher (pid {agent.pid}) is gone: saving and stopping" in text
    last = json.loads(log.read_text().splitlines()[-1])["iteration"]
    saved = load_checkpoint(save)  # complete and intact
    assert saved.iteration == last and saved.metadata["consumed_samples"] == last * 8
