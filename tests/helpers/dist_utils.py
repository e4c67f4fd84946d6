"""Run a function in several real processes joined by a gloo process group (CPU)."""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.paths import ROOT

# What the ranks' server process imports once, before it forks them: no rank pays the start-up
# (about 2 s of CPU for torch) again.
PRELOAD = ["torch", "torch.distributed", "tests.helpers.dist_utils", "megatron_h2.training.main"]


def _worker(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple,
            queue: Any, backend: str, environ: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment now, not the server's when it started
    os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180,
                    backend: str = "gloo") -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks of a ``backend`` (default
    gloo) process group; return their results.

    ``fn`` must be a module-level function; results must be picklable. A failing rank's
    traceback is raised here as an AssertionError. The ranks are forked from a server process
    that has imported :data:`PRELOAD` once (multiprocessing's "forkserver"), with this process's
    environment as it is now.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        environ = dict(os.environ)
        procs = [ctx.Process(target=_worker,
                             args=(r, world_size, init_file, fn, args, queue, backend, environ))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        try:
            for _ in range(world_size):
                rank, status, payload = queue.get(timeout=timeout)
                if status == "error":
                    raise AssertionError(f"rank {rank} failed:\n{payload}")
                results[rank] = payload
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(world_size)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list[str], env_extra: dict | None = None,
             timeout: float = 240):
    """``python -m torch.distributed.run --standalone ... pretrain_gpt.py ARGS`` on this host,
    one thread per process; returns the CompletedProcess (text output captured).

    ``--standalone``: the launcher's rendezvous store binds a port the system picks and keeps it,
    so launches running at once (``pytest -n``) cannot race for a port chosen beforehand."""
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), str(ROOT / "pretrain_gpt.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def losses(path) -> dict[int, float]:
    """``{iteration: lm_loss}`` from a ``--log-jsonl`` file."""
    import json
    from pathlib import Path

    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return {r["iteration"]: r["lm_loss"] for r in rows if "lm_loss" in r}


def tiny_model_flags(num_layers: int = 4, seed: int = 5, train_iters: int = 10) -> list[str]:
    """pretrain_gpt.py flags of a tiny GPT on the NullTokenizer corpus (tests/conftest.py),
    logging every iteration and never evaluating: runs to compare with one process."""
    return ["--num-layers", str(num_layers), "--hidden-size", "64", "--num-attention-heads",
            "4", "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--max-position-embeddings", "32", "--lr", "3e-3", "--lr-warmup-iters", "2",
            "--seed", str(seed), "--train-iters", str(train_iters), "--log-interval", "1",
            "--eval-interval", "1000", "--eval-iters", "0", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "256", "--split", "90,10,0"]


def write_counting_corpus(folder, num_docs: int, lengths: tuple[int, int], vocab: int,
                          modulo: int = 250) -> str:
    """Counting documents (each token is the previous plus one modulo ``modulo``, so a tiny
    model learns fast) preprocessed into Megatron's format by the real tool; returns the data
    prefix."""
    import json
    import random
    import subprocess
    import sys
    from pathlib import Path

    folder = Path(folder)
    rng = random.Random(0)
    with open(folder / "docs.jsonl", "w") as fh:
        for _ in range(num_docs):
            start, n = rng.randrange(modulo), rng.randrange(*lengths)
            fh.write(json.dumps({"text": " ".join(str((start + i) % modulo) for i in range(n))})
                     + "\n")
    subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input",
                    str(folder / "docs.jsonl"), "--output-prefix", str(folder / "count"),
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
                    "--append-eod", "--workers", "1"], check=True, capture_output=True)
    return str(folder / "count_text_document")


def assert_losses_close(got: dict[int, float], want: dict[int, float],
                        rel: float = 1e-5) -> None:
    """The same iterations, each loss within ``rel`` (relative) of the reference's."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for it, value in want.items():
        assert abs(got[it] - value) <= rel * abs(value), (it, got[it], value)
