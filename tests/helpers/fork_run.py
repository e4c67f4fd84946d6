"""Training jobs whose ranks are forked rather than launched: :func:`fork_run` runs
``pretrain_gpt.py ARGS`` on ``nproc`` ranks as ``torchrun --standalone`` does, but each rank is
forked from the server process of :mod:`tests.helpers.dist_utils` (torch and the training entry
point imported once), not started as a fresh interpreter by a launcher that imports torch
itself: about 2-3 s of CPU saved per rank and per launch.

The ranks see the environment torchrun gives its workers (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT`` of a rendezvous store this process hosts, as
torchrun's agent does, ``TORCHELASTIC_RUN_ID``, one thread): the training code runs as under
torchrun. Tests of the launcher itself (failures, signals, restarts) keep the real torchrun
(:func:`tests.helpers.dist_utils.torchrun`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.dist_utils import PRELOAD


def _train_rank(args: list[str], environ: dict[str, str], out: str) -> None:
    """One rank: the launch's environment, stdout / stderr into files, ``main(args)``'s code as
    the exit code."""
    os.environ.clear()
    os.environ.update(environ)
    import torch

    torch.set_num_threads(1)
    with open(f"{out}.out", "w") as stdout, open(f"{out}.err", "w") as stderr:
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
        from megatron_h2.training.main import main

        try:
            code = main(args)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    sys.exit(code)


def fork_run(nproc: int, args: list[str], env_extra: dict | None = None,
             timeout: float = 240) -> subprocess.CompletedProcess:
    """``pretrain_gpt.py ARGS`` on ``nproc`` forked ranks; returns what
    :func:`~tests.helpers.dist_utils.torchrun` would: return code 0 when every rank ended with
    0 (else the first other code), the ranks' stdout and stderr one after the other."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK="0",
               TORCHELASTIC_RUN_ID=f"forked-{uuid.uuid4().hex[:8]}",
               TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_USE_AGENT_STORE="True",
               **(env_extra or {}))
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_train_rank, args=(
            args, {**env, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_WORLD_SIZE": str(nproc)},
            os.path.join(tmp, str(r)))) for r in range(nproc)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        late = [p for p in procs if p.is_alive()]
        for p in late:
            p.kill()
            p.join()
        stdout, stderr = ("".join(_read(Path(tmp, f"{r}.{kind}")) for r in range(nproc))
                          for kind in ("out", "err"))
    if late:
        raise subprocess.TimeoutExpired(args, timeout, stdout, stderr)
    code = next((p.exitcode for p in procs if p.exitcode != 0), 0)
    return subprocess.CompletedProcess(args, code, stdout, stderr)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""  # a rank that died before its redirect
