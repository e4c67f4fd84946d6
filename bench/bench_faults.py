"""Faults against checkpoints: kill -9 during saves, and two jobs writing to one directory.

* Kill during save: a run that saves every iteration (a model big enough that writing and
  hashing the checkpoint is most of each iteration) is killed with SIGKILL at a random moment,
  then the newest checkpoint is loaded with every checksum checked, and the run is started again
  from there (which takes the save directory over from the dead job and removes the half-written
  save). Repeated ``--kills`` times for one process and for PP 2 under torchrun (agent and
  workers killed at once).
* Two writers: two jobs are started at the same moment with the same ``--save``; exactly one may
  train, the other must stop at start with one line naming the owner. Repeated ``--tries``
  times.

Counts are printed (a figure, not a test: the kill moments are random)::

    .venv/bin/python bench/bench_faults.py                 # 20 + 20 kills, 5 two-writer tries
    .venv/bin/python bench/bench_faults.py --kills 5 --tries 2 --json results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the test helpers (tests/helpers/dist_utils.py) are no part of the installed package: the
# repository root goes on sys.path for them
sys.path.insert(0, str(ROOT))

from megatron_h2.checkpointing import find_latest_iteration, load_checkpoint  # noqa: E402
from megatron_h2.errors import ConfigError  # noqa: E402
from tests.helpers.dist_utils import write_counting_corpus  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "384", "--num-attention-heads", "8",
         "--num-query-groups", "8", "--ffn-hidden-size", "1024", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--lr", "1e-4", "--train-iters", "100000", "--log-interval", "1", "--eval-iters", "0",
         "--eval-interval", "100000", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
         "--split", "100,0,0", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], pp: int, log: Path) -> subprocess.Popen:
    """Start a run (its output appended to ``log``)."""
    if pp == 1:
        cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(pp),
               "--master-addr", "127.0.0.1", "--master-port", str(_port()),
               str(ROOT / "pretrain_gpt.py"), *args, "--pipeline-model-parallel-size", str(pp)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "a") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the job and every process under it at once (torchrun starts its workers in
    sessions of their own, so killing the process group is not enough)."""
    family, frontier = [proc.pid], [proc.pid]
    while frontier:
        parents, frontier = set(frontier), []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if ppid in parents:
                    frontier.append(int(entry.name))
        family += frontier
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _latest(save: Path) -> int:
    try:
        return find_latest_iteration(save) or 0
    except ConfigError:
        return 0


def kill_during_save(corpus: str, work: Path, pp: int, kills: int, rng: random.Random) -> dict:
    """``kills`` SIGKILLs at random moments of a run that saves every iteration."""
    save, log = work / f"ckpt_pp{pp}", work / f"pp{pp}.log"
    args = [*MODEL, "--data-path", corpus, "--data-cache-path", str(work / "cache"),
            "--save", str(save), "--load", str(save), "--save-interval", "1",
            "--most-recent-k", "2"]
    counts = {"kills": 0, "loadable": 0, "mid_save": 0, "resumed": 0, "restart_failed": 0}
    period = None
    for trial in range(kills):
        before = _latest(save)
        proc = launch(args, pp, log)
        started = time.monotonic()
        while _latest(save) < before + 2 and proc.poll() is None:  # saving: two saves seen
            time.sleep(0.05)
            if time.monotonic() - started > 600:
                break
        if proc.poll() is not None:
            counts["restart_failed"] += 1
            print(f"  trial {trial}: the run ended by itself (exit {proc.returncode}); see {log}")
            continue
        counts["resumed"] += trial > 0 and before > 0
        if period is None:  # one save + iteration, measured on the first run
            t0, it0 = time.monotonic(), _latest(save)
            while _latest(save) < it0 + 3:
                time.sleep(0.01)
            period = (time.monotonic() - t0) / 3
        time.sleep(rng.uniform(0.0, 2.0 * period))
        kill_job(proc)
        counts["kills"] += 1
        counts["mid_save"] += any(save.glob(".iter_*.incomplete"))
        try:
            ckpt = load_checkpoint(save)  # every checksum checked
            counts["loadable"] += ckpt is not None and ckpt.iteration == _latest(save)
        except ConfigError as exc:
            print(f"  trial {trial}: NOT loadable: {exc}")
    counts["period_s"] = round(period or 0.0, 3)
    return counts


def two_writers(corpus: str, work: Path, tries: int) -> dict:
    """Two jobs started at the same moment on one --save directory."""
    counts = {"tries": 0, "one_refused": 0, "refusal_one_line": 0}
    for trial in range(tries):
        save = work / f"shared_{trial}"
        logs = [work / f"writer{trial}_{k}.log" for k in (0, 1)]
        args = [*MODEL, "--data-path", corpus, "--data-cache-path", str(work / "cache"),
                "--save", str(save), "--save-interval", "2"]
        procs = [launch(args, 1, log) for log in logs]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.1)
        time.sleep(5.0)  # the survivor keeps training and saving meanwhile
        codes = [p.poll() for p in procs]
        for p in procs:
            if p.poll() is None:
                kill_job(p)
        counts["tries"] += 1
        refused = [k for k, code in enumerate(codes) if code == 2]
        if len(refused) == 1 and codes[1 - refused[0]] is None:
            counts["one_refused"] += 1
            errors = [line for line in logs[refused[0]].read_text().splitlines()
                      if line.startswith("error:")]
            counts["refusal_one_line"] += (len(errors) == 1
                                           and "in use by another running job" in errors[0])
        else:
            print(f"  try {trial}: exit codes {codes}; see {logs}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="append the results as one JSON line")
    ns = parser.parse_args()
    rng = random.Random(ns.seed)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = write_counting_corpus(work, 400, (80, 300), 256)
        for pp in (1, 2):
            started = time.time()
            results[f"kill_pp{pp}"] = kill_during_save(corpus, work, pp, ns.kills, rng)
            r = results[f"kill_pp{pp}"]
            print(f"kill -9 during saves, {'one process' if pp == 1 else 'PP 2 (torchrun)'}: "
                  f"{r['loadable']}/{r['kills']} left a loadable checkpoint (checksums checked); "
                  f"{r['mid_save']} kills landed while a save was being written; "
                  f"{r['resumed']}/{max(r['kills'] - 1, 0)} restarts resumed; "
                  f"save+iteration period {r['period_s']} s ({time.time() - started:.0f} s)")
        r = results["two_writers"] = two_writers(corpus, work, ns.tries)
        print(f"two jobs on one --save: {r['one_refused']}/{r['tries']} second writer refused "
              f"({r['refusal_one_line']} with one line naming the owner)")
    if ns.json:
        with open(ns.json, "a") as fh:
            fh.write(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
