"""Fault probe: each fault a user's run can meet, tried a few times, each try sorted into
clean / traceback / hang / silently wrong.

* kill -9 during ``--async-save`` (one process): the newest checkpoint loads with every checksum
  checked and a restart resumes from it (clean);
* SIGTERM with ``--exit-signal-handler`` under ``megatron_h2.commands.torchrun`` (PP 2) and, for
  comparison, under plain torchrun: exit 0 and a loadable checkpoint at the stop (clean);
* a killed and a stopped (SIGSTOP) worker under a per-stage-DP plan (3 processes; stage 0 DP 2):
  non-zero exit, no Python traceback, and (stopped) a line naming the rank (clean);
* the elastic launcher losing a chip: re-planned and finished, exit 0 (clean);
* NaN loss, a spike (``$MEGATRON_H2_INJECT_NUMERIC``) and a flat line (``--lr 1e6``): a one-line
  stop whose ``latest`` is a verified checkpoint (clean);
* plan and cluster file corruptions (the generator of tests/e2e/test_fuzz_inputs.py): a
  one-line error or a load of exactly what the file says (clean).

"hang" is a try that outlived its limit; "silently wrong" a try that exited 0 or loaded
something other than what it should have. Small tries by default (a shared 2-core machine)::

    .venv/bin/python bench/bench_fault_probe.py --tries 3 --out bench/results/x.md
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/helpers and the fuzz generator are not installed

from megatron_h2.checkpointing import find_latest_iteration, load_checkpoint  # noqa: E402
from megatron_h2.errors import ConfigError  # noqa: E402
from tests.helpers.dist_utils import free_port, write_counting_corpus  # noqa: E402

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
         "--split", "100,0,0", "--eval-iters", "0", "--log-interval", "1", "--hidden-dropout",
         "0", "--attention-dropout", "0", "--lr-warmup-iters", "0", "--min-lr", "0"]
PER_STAGE_DP = """data_parallel_size: 1
micro_batch_size: 2
global_batch_size: 8
chips:
  c: {device: cpu}
stages:
  - {chip: c, tensor_parallel_size: 1, num_layers: 1, data_parallel_size: 2}
  - {chip: c, tensor_parallel_size: 1, num_layers: 1}
"""
KINDS = ("clean", "traceback", "hang", "silently wrong")


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", **extra)


def _pretrain(args: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "pretrain_gpt.py"), *args]


def _torchrun(nproc: int, args: list[str], ours: bool = True) -> list[str]:
    module = "megatron_h2.commands.torchrun" if ours else "torch.distributed.run"
    return [sys.executable, "-m", module, "--nproc-per-node", str(nproc), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), str(ROOT / "pretrain_gpt.py"), *args]


def _run(cmd: list[str], limit: float, env: dict | None = None) -> tuple[int | None, str]:
    """(exit status or None on a hang, output)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit,
                              env=env or _env(), cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        return None, (exc.stdout or b"").decode(errors="replace") if isinstance(
            exc.stdout, bytes) else (exc.stdout or "")
    return proc.returncode, proc.stdout + proc.stderr


def _wait_for(path_check: Callable[[], bool], proc: subprocess.Popen, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while not path_check():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _latest(save: Path) -> int:
    try:
        return find_latest_iteration(save) or 0
    except ConfigError:
        return 0


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def kill_async_save(corpus: str, work: Path, tries: int, rng: random.Random) -> str:
    save = work / "kill_async"
    args = [*MODEL, "--data-path", corpus, "--lr", "1e-3", "--lr-decay-iters", "100000",
            "--train-iters", "100000", "--save", str(save), "--load", str(save),
            "--save-interval", "1", "--async-save"]
    proc = subprocess.Popen(_pretrain(args), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=_env(), start_new_session=True)
    if not _wait_for(lambda: _latest(save) >= 2, proc, 300):
        _kill_tree(proc)
        return "hang"
    time.sleep(rng.uniform(0.0, 1.0))
    _kill_tree(proc)
    try:
        before = load_checkpoint(save).iteration  # every checksum checked
    except ConfigError:
        return "silently wrong"
    code, out = _run(_pretrain([*args, "--exit-interval", str(before + 2)]), 300)
    if code is None:
        return "hang"
    if "Traceback" in out:
        return "traceback"
    resumed = f"resumed from {save} at iteration {before}" in out
    return "clean" if code == 0 and resumed and _latest(save) == before + 2 else "silently wrong"


def sigterm(corpus: str, work: Path, tries: int, rng: random.Random, ours: bool = True) -> str:
    save = work / f"sigterm_{'ours' if ours else 'torchrun'}_{rng.random():.6f}"
    log = save.with_suffix(".log")
    args = [*MODEL, "--data-path", corpus, "--lr", "1e-3", "--train-iters", "100000",
            "--pipeline-model-parallel-size", "2", "--save", str(save), "--save-interval",
            "1000", "--exit-signal-handler"]
    with open(log, "w") as fh:
        proc = subprocess.Popen(_torchrun(2, args, ours), stdout=fh, stderr=subprocess.STDOUT,
                                env=_env())
        if not _wait_for(lambda: "iteration        2/" in log.read_text(), proc, 300):
            _kill_tree(proc)
            return "hang"
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            return "hang"
    out = log.read_text()
    if "Traceback" in out:
        return "traceback"
    loadable = _latest(save) >= 2 and load_checkpoint(save).iteration == _latest(save)
    return "clean" if code == 0 and loadable else "silently wrong"


def worker_fault(corpus: str, work: Path, mode: str) -> str:
    plan = work / "per_stage_dp.yaml"
    plan.write_text(PER_STAGE_DP)
    args = [*MODEL, "--data-path", corpus, "--lr", "1e-3", "--train-iters", "60",
            "--hetero-plan", str(plan), "--heartbeat-timeout", "5",
            "--distributed-timeout-minutes", "2"]
    code, out = _run(_torchrun(3, args), 240, _env(MEGATRON_H2_INJECT_FAULT=f"2:3:{mode}"))
    if code is None:
        return "hang"
    if "Traceback" in out or "frame #" in out:
        return "traceback"
    if code == 0:
        return "silently wrong"
    named = "rank 2 (host" in out or ("rank      : 2" in out and mode == "kill")
    return "clean" if named else "silently wrong"


def elastic(corpus: str, work: Path) -> str:
    from tests.e2e.test_elastic import CLUSTER
    from tests.e2e.test_elastic import MODEL as ELASTIC_MODEL

    cluster = work / "cluster.yaml"
    cluster.write_text(CLUSTER)
    save = work / f"elastic_{time.time_ns()}"
    train = [*ELASTIC_MODEL, "--data-path", corpus, "--save", str(save), "--save-interval", "5"]
    code, out = _run([sys.executable, "-m", "megatron_h2.elastic.launcher", "--cluster",
                      str(cluster), "--max-restarts", "2", "--planner-time-limit", "10", "--",
                      *train], 500, _env(MEGATRON_H2_INJECT_FAULT="3:8:kill"))
    if code is None:
        return "hang"
    if "Traceback" in out or "frame #" in out:
        return "traceback"
    return "clean" if code == 0 and _latest(save) == 20 else "silently wrong"


def numeric(corpus: str, work: Path, kind: str) -> str:
    save = work / f"numeric_{kind}_{time.time_ns()}"
    extra = {"nan": ["--lr", "1e-3"], "spike": ["--lr", "1e-3", "--check-for-spiky-loss"],
             "flat": ["--lr", "1e6"]}[kind]
    fault = {"nan": "4:nan-loss", "spike": "7:spike"}.get(kind)
    args = [*MODEL, "--data-path", corpus, "--train-iters", "12", "--save", str(save),
            "--save-interval", "1", *extra]
    code, out = _run(_pretrain(args), 300, _env(**({"MEGATRON_H2_INJECT_NUMERIC": fault}
                                                   if fault else {})))
    if code is None:
        return "hang"
    if "Traceback" in out:
        return "traceback"
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    want = {"nan": 2, "spike": 5, "flat": 0}[kind]  # the newest verified checkpoint
    good = code == 2 and len(errors) == 1 and _latest(save) == want
    return "clean" if good else "silently wrong"


def plan_corruptions(work: Path) -> dict[str, int]:
    from megatron_h2.plan.schema import HeteroPlan
    from megatron_h2.planner.cluster import Cluster
    from tests.e2e.test_fuzz_inputs import (
        CLUSTER,
        PLAN,
        YAML_CASES,
        _check_cluster,
        _check_plan,
        duplicated_key,
        yaml_mutations,
    )

    counts = dict.fromkeys(KINDS, 0)
    for text, loader, check in ((PLAN, HeteroPlan.from_yaml, _check_plan),
                                (CLUSTER, Cluster.from_yaml, _check_cluster)):
        for index, data in enumerate(yaml_mutations(text, random.Random(len(text) + 1),
                                                    YAML_CASES)):
            path = work / f"corrupt_{index}.yaml"
            path.write_bytes(data)
            try:
                result = loader(path)
            except ConfigError as exc:
                counts["clean" if "\n" not in str(exc) else "traceback"] += 1
                continue
            except Exception:  # noqa: BLE001 - what the probe counts
                counts["traceback"] += 1
                continue
            try:
                assert duplicated_key(data) is None
                check(result, data)
                counts["clean"] += 1
            except AssertionError:
                counts["silently wrong"] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=3)
    parser.add_argument("--elastic-tries", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the table (Markdown) to this file")
    parser.add_argument("--only", help="run only the probes whose name contains this text")
    ns = parser.parse_args()
    rng = random.Random(ns.seed)
    rows: list[tuple[str, dict[str, int], float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = write_counting_corpus(work, 300, (40, 120), 256)
        probes: list[tuple[str, int, Callable[[], str]]] = [
            ("kill -9 during --async-save (1 process)", ns.tries,
             lambda: kill_async_save(corpus, work, ns.tries, rng)),
            ("SIGTERM, megatron_h2.commands.torchrun (PP 2)", ns.tries,
             lambda: sigterm(corpus, work, ns.tries, rng, ours=True)),
            ("SIGTERM, plain torchrun (PP 2)", 1,
             lambda: sigterm(corpus, work, 1, rng, ours=False)),
            ("killed worker, per-stage-DP plan (3 ranks)", ns.tries,
             lambda: worker_fault(corpus, work, "kill")),
            ("stopped worker (SIGSTOP), per-stage-DP plan", ns.tries,
             lambda: worker_fault(corpus, work, "stop")),
            ("elastic launcher, a chip lost at iteration 8", ns.elastic_tries,
             lambda: elastic(corpus, work)),
            ("NaN loss at iteration 4", 1, lambda: numeric(corpus, work, "nan")),
            ("loss spike at iteration 7", 1, lambda: numeric(corpus, work, "spike")),
            ("flat line (--lr 1e6)", 1, lambda: numeric(corpus, work, "flat")),
        ]
        for name, tries, probe in probes:
            if ns.only and ns.only not in name:
                continue
            started = time.time()
            counts = dict.fromkeys(KINDS, 0)
            for _ in range(tries):
                counts[probe()] += 1
            rows.append((name, counts, time.time() - started))
            print(f"{name}: {counts} ({time.time() - started:.0f} s)", flush=True)
        started = time.time()
        if not ns.only or ns.only in "plan + cluster file corruptions":
            rows.append(("plan + cluster file corruptions (240 + 240)", plan_corruptions(work),
                         time.time() - started))
    lines = ["| fault | tries | clean | traceback | hang | silently wrong | seconds |",
             "|---|---|---|---|---|---|---|"]
    for name, counts, seconds in rows:
        lines.append(f"| {name} | {sum(counts.values())} | " + " | ".join(
            str(counts[k]) for k in KINDS) + f" | {seconds:.0f} |")
    table = "\n".join(lines)
    print(table)
    if ns.out:
        Path(ns.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
