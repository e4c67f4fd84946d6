"""A rank that stops responding is named by the heartbeat long before the collective timeout
(a SIGSTOPped rank used to be found only by the 10-minute timeout, with tracebacks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.dist_utils import free_port
from tests.helpers.paths import ROOT
from tests.helpers.procs import process_table
from tests.unit.training.test_parallel_training import MODEL


def _descendants(pid: int) -> dict[int, str]:
    """``{pid: state}`` of the processes under ``pid`` (state as in /proc: R, S, T, Z, ...)."""
    table = process_table()

    def under(p: int) -> bool:
        while p in table and p != pid:
            p = table[p][1]
        return p == pid

    return {p: state for p, (state, _) in table.items() if p != pid and under(p)}


@pytest.mark.e2e
def test_a_stopped_rank_is_named_in_one_line(corpus, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(ROOT / "pretrain_gpt.py"), *MODEL, "--data-path", corpus,
           "--pipeline-model-parallel-size", "2", "--train-iters", "50",
           "--heartbeat-timeout", "5", "--distributed-timeout-minutes", "10"]
    err = tmp_path / "stderr.txt"
    with open(err, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=fh, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1",
                                         MEGATRON_H2_INJECT_FAULT="1:3:stop"))
    try:
        # once rank 0 has named it and ended, torchrun SIGTERMs the stopped rank, which cannot
        # act on it, and SIGKILLs it only after a fixed 30 s: kill it then, as torchrun would
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if "stopped responding" in err.read_text():
                alive = {p: s for p, s in _descendants(proc.pid).items() if s not in "ZX"}
                if alive and set(alive.values()) == {"T"}:
                    for pid in alive:
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        assert proc.poll() is not None, "the job did not end"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    stderr = err.read_text()
    assert proc.returncode != 0
    ours = [line for line in stderr.splitlines() if line.startswith(("error:", "[rank"))]
    assert len(ours) == 1, stderr[-3000:]
    assert ours[0].startswith("error: [rank 0] rank 1 (host ")
    assert ", stage 1, chip default) stopped responding: no heartbeat for " in ours[0]
    assert "(--heartbeat-timeout 5); stopping the job" in ours[0]
    assert "frame #" not in stderr and "gloo" not in stderr
