"""Helpers of the CPU-emulated benches (bench_planner_accuracy.py, bench_superlinear.py).

Every emulated chip is a single-threaded process of this machine; a plan file runs for real with
`torchrun pretrain_gpt.py --hetero-plan PLAN` (OMP_NUM_THREADS=1) over a small synthetic corpus,
and its step time is the median `iteration_ms` after the warm-up iterations. While a run lasts,
:class:`~megatron_h2.measurement.host_load.OtherLoad` records the cores other processes took and the
cores the run itself used.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from megatron_h2.config import ModelConfig
from megatron_h2.measurement.host_load import OtherLoad, wait_for_quiet
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner.calibration import steady_rows, steady_step_ms
from megatron_h2.planner.model_input import model_flags

ROOT = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    print(message, flush=True)


def add_quiet_arguments(parser: argparse.ArgumentParser, budget_s: float) -> None:
    """--max-wait, --budget and --busy: how long to wait for other processes to leave the
    cores, and when a disturbed run is no longer repeated."""
    parser.add_argument("--max-wait", type=float, default=90.0,
                        help="seconds in all to wait for other processes to leave the cores "
                             "before runs (default 90; 0: never wait)")
    parser.add_argument("--budget", type=float, default=budget_s,
                        help="no more repeats of disturbed runs once the script has run this "
                             f"many seconds (default {budget_s:g})")
    parser.add_argument("--busy", type=float, default=0.5,
                        help="other processes' cores above which a run waits first and is "
                             "flagged as disturbed (default 0.5)")


def quiet_waiter(args: argparse.Namespace):
    """A function that waits (out of --max-wait seconds in all) until other processes use
    under --busy cores, saying so every 10 s."""
    budget = [args.max_wait]

    def quiet() -> None:
        wait_for_quiet(budget, args.busy, lambda c: log(
            f"  waiting: other processes use {c:.1f} cores ({budget[0]:.0f} s of waiting left)")
            if budget[0] % 10 == 0 else None)
    return quiet


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env1() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def torchrun_cmd(nproc: int, script: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *args]


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env1(),
                          cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n"
                           f"{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
    return proc


def write_corpus(work: Path, vocab: int) -> str:
    """A preprocessed corpus of runs of consecutive token ids below ``vocab`` (NullTokenizer)."""
    rng = random.Random(0)
    docs = work / "docs.jsonl"
    with open(docs, "w") as fh:
        for _ in range(400):
            start, n = rng.randrange(vocab), rng.randrange(100, 400)
            fh.write(json.dumps({"text": " ".join(str((start + i) % vocab)
                                                  for i in range(n))}) + "\n")
    run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(docs),
         "--output-prefix", str(work / "corpus"), "--tokenizer-type", "NullTokenizer",
         "--vocab-size", str(vocab), "--append-eod"])
    return str(work / "corpus_text_document")


def train_flags(model: ModelConfig, vocab: int, data: str, iters: int) -> list[str]:
    """pretrain_gpt.py flags of a run of ``iters`` iterations, logged every iteration (the
    model's own flags, dropout included, as the profile measured it)."""
    return [*model_flags(model, vocab=False),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
            "--data-path", data, "--split", "100,0,0", "--train-iters", str(iters),
            "--log-interval", "1", "--eval-interval", "1000000", "--eval-iters", "0",
            "--lr", "1e-4", "--lr-warmup-iters", "1"]


def measure(plan_path: Path, flags: list[str], skip: int, out: Path,
            timeout: float = 300) -> dict:
    """Run the plan for real (one process per rank); the median iteration_ms after ``skip``
    warm-up iterations, the cores other processes (``load``) and the run (``cores``) used."""
    out.unlink(missing_ok=True)
    nproc = HeteroPlan.from_yaml(plan_path).world_size
    cmd = torchrun_cmd(nproc, ROOT / "pretrain_gpt.py",
                       [*flags, "--hetero-plan", str(plan_path), "--log-jsonl", str(out)])
    started = time.perf_counter()
    with OtherLoad() as other:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  env=env1(), cwd=ROOT)
        except subprocess.TimeoutExpired:
            proc = None
    wall = time.perf_counter() - started
    load, cores = other.cores, other.own_cores
    if proc is None:
        return {"error": "timed out", "load": load, "cores": cores}
    if proc.returncode != 0 or not out.exists():
        return {"error": (proc.stderr or proc.stdout)[-2000:], "load": load, "cores": cores}
    times = steady_step_ms(out, skip)
    if not times:
        return {"error": "no iteration_ms after the warm-up", "load": load, "cores": cores}
    return {"ms": statistics.median(times), "iterations_ms": [round(t, 1) for t in times],
            "wall_s": round(wall, 1), "load": load, "cores": cores}


def common_window(steps: dict[str, list[tuple[float, float]]]) -> tuple[float, float]:
    """The span in which every run was training a measured step: from the latest first start to
    the earliest last end (``steps``: each run's (start, end) Unix times after its warm-up)."""
    return (max(spans[0][0] for spans in steps.values()),
            min(spans[-1][1] for spans in steps.values()))


def measure_side_by_side(plans: dict[str, Path], flags: list[str], skip: int, work: Path,
                         minutes: float, timeout: float = 600) -> dict[str, dict]:
    """Run every plan at the same time (one torchrun each), each for ``minutes`` of training
    (``--exit-duration-in-mins``), so that all meet the same host: what other processes take,
    and how fast this machine's cores run, drift over minutes. Each run's step time is the
    median ``iteration_ms`` of its steps after ``skip`` warm-up iterations that lie wholly in
    the window in which every run was past its warm-up (:func:`common_window`; all of its steps
    after the warm-up when one run has none there). ``load``: the cores other processes took
    meanwhile; ``cores``: what all the runs used together (start-up included)."""
    procs, outs = {}, {}
    with OtherLoad() as other:
        for name, path in plans.items():
            outs[name] = work / f"side_{name}.jsonl"
            outs[name].unlink(missing_ok=True)
            cmd = torchrun_cmd(HeteroPlan.from_yaml(path).world_size, ROOT / "pretrain_gpt.py",
                               [*flags, "--hetero-plan", str(path), "--log-jsonl",
                                str(outs[name]), "--exit-duration-in-mins", f"{minutes:.3f}"])
            procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True, env=env1(), cwd=ROOT)
        started, results = time.perf_counter(), {}
        for name, proc in procs.items():
            try:
                _, err = proc.communicate(timeout=max(1.0, timeout - (time.perf_counter()
                                                                      - started)))
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                err = "timed out\n" + err
            if proc.returncode != 0:
                results[name] = {"error": err[-2000:]}
    steps = {}
    for name in plans:
        rows = steady_rows(outs[name], skip) if outs[name].exists() else []
        if name not in results and not rows:
            results[name] = {"error": "no iteration_ms after the warm-up"}
        elif name not in results:
            steps[name] = [(r["time"] - r["iteration_ms"] / 1e3, r["time"]) for r in rows]
    for result in results.values():
        result.update(load=other.cores, cores=other.own_cores)
    if len(steps) < len(plans):
        return results
    low, high = common_window(steps)
    for name, spans in steps.items():
        inside = [end - start for start, end in spans if start >= low and end <= high]
        times = [1e3 * t for t in (inside or [end - start for start, end in spans])]
        results[name] = {"ms": statistics.median(times),
                         "iterations_ms": [round(t, 1) for t in times],
                         "in_window": len(inside), "window_s": round(high - low, 1),
                         "load": other.cores, "cores": other.own_cores}
    return results


def profile_chips(work: Path, tag: str, model: ModelConfig, chips: list[str],
                  sizes: tuple[int, ...], emulate: Path | None = None) -> tuple[dict, str]:
    """tools/profile_chip.py --threads 1 for ``chips`` (all this same CPU) at the micro-batch
    ``sizes`` (``emulate``: measured by one paced process per rank of that plan at once,
    ``--emulate``); the caller waits for quiet cores. Returns the table and the tool's output."""
    out = work / f"profile_{tag}.yaml"
    proc = run([sys.executable, str(ROOT / "tools" / "profile_chip.py"),
                *(x for chip in chips for x in ("--chip", chip)), *model_flags(model),
                "--micro-batch-sizes", ",".join(map(str, sizes)),
                *(("--emulate", str(emulate)) if emulate else ()),
                "--threads", "1", "--max-wait", "0", "--output", str(out)],
               timeout=900)  # a loaded host stretches the paced measurement
    return yaml.safe_load(out.read_text()), proc.stdout


def median_profile(tables: list[dict]) -> dict:
    """Per-entry median over the rounds' profile tables (same shape)."""
    merged = copy.deepcopy(tables[0])
    for name, chip in merged["chips"].items():
        for entry in ("optimizer_ns_per_param", "optimizer_cpu_ns_per_param"):
            if entry in chip:
                chip[entry] = round(statistics.median(
                    t["chips"][name][entry] for t in tables), 4)
        for times in ("micro_batch_sizes", "cpu_micro_batch_sizes"):  # wall and CPU times
            for size, row in chip.get(times, {}).items():
                for key in row:
                    row[key] = round(statistics.median(
                        t["chips"][name][times][size][key] for t in tables), 4)
    return merged


def plan_label(plan: HeteroPlan) -> str:
    """``DP 2 x fast 5 | slow 3 full`` (per-stage DP and TP written on the stage); a plan of
    data-parallel pipelines: each pipeline's label with its batch share, ``[fast 8] 11 + [big 8]
    5``."""
    if plan.pipelines:
        return " + ".join(f"[{plan_label(pipe)}] {pipe.global_batch_size}"
                          for pipe in plan.pipelines)
    parts = []
    for i, s in enumerate(plan.stages):
        layers = "+".join(map(str, s.chunks)) if len(s.chunks) > 1 else str(s.num_layers)
        text = f"{s.chip} {layers}"
        text += {"none": "", "selective": " sel", "full": " full"}[s.recompute]
        if s.tensor_parallel_size != 1:
            text = f"TP{s.tensor_parallel_size} {text}"
        if not plan.uniform_dp and plan.stage_dp(i) > 1:
            text = f"DP{plan.stage_dp(i)} {text}"
        parts.append(text)
    extra = f" (mb {plan.micro_batch_size})" if plan.micro_batch_size != 1 else ""
    dp = f"DP {plan.data_parallel_size} x " if plan.uniform_dp and plan.data_parallel_size > 1 \
        else ""
    return dp + " | ".join(parts) + extra
