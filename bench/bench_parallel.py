"""Pipeline (PP=2, 1F1B) efficiency and data-parallel (DP=2) gradient-communication cost on CPU.

Two gloo processes (``tests/helpers/dist_utils.run_distributed``, one thread each) build their rank
as ``training.main.train`` does (plan, topology, stage ``GPTModel``, data-parallel optimizer,
``StepRunner``) over a synthetic indexed corpus and time real ``train_step`` calls.

* PP=2: per micro-batch count m, each round runs (order rotating) one real step, the stages'
  forward/backward of m micro-batches with the pipeline traffic replaced by fixed tensors (both
  stages at once), and the same with each stage alone. Ideal 1F1B time = (m + p - 1) / m x the
  slower stage's compute; measured / ideal shows what the schedule and its traffic add.
* DP=2: steps with the bucket all-reduces overlapped with the last backward and not
  (``GradBuckets.overlap`` toggled between steps: same buckets). ``finish_sync`` is timed on the
  instance: with overlap it is the exposed wait; without (after a barrier, so the slower rank's
  backward is not counted) it is the whole communication.

* Schedules, PP=4 (four processes): 1F1B, interleaved 1F1B (V=2) and zero-bubble against the
  ideal and the planner's simulator; see ``bench_schedules.py``.

Medians over the timed rounds; ``time.perf_counter`` is one system-wide monotonic clock on
Linux, so the ranks' timestamps are compared directly. Examples::

    .venv/bin/python bench/bench_parallel.py                     # all parts, ~2-3 minutes
    .venv/bin/python bench/bench_parallel.py --part pp --micro-batches 2,4,8,16
    .venv/bin/python bench/bench_parallel.py --part dp --bucket-mb 25 --json results.jsonl
    .venv/bin/python bench/bench_parallel.py --part schedules --schedule-micro-batches 4,8,16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median as med

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# the test helpers (tests/helpers/dist_utils.py) are no part of the installed package: the
# repository root goes on sys.path for them
sys.path.insert(0, str(ROOT))

from megatron_h2.config import (  # noqa: E402
    LLAMA_ARCHITECTURE,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
)
from megatron_h2.data import (  # noqa: E402
    GPTDataset,
    IndexedDatasetBuilder,
    build_gpt_datasets,
    get_bin_path,
    get_idx_path,
)
from megatron_h2.devices import Accelerator, get_accelerator  # noqa: E402
from megatron_h2.distributed.topology import Topology, build_topology  # noqa: E402
from megatron_h2.models.gpt import GPTModel, init_parameters  # noqa: E402
from megatron_h2.optimizer.distributed_optimizer import (  # noqa: E402
    DataParallelOptimizer,
    build_data_parallel_optimizer,
)
from megatron_h2.pipeline.schedule_runner import run_schedule  # noqa: E402
from megatron_h2.plan.orders import one_f_one_b  # noqa: E402
from megatron_h2.training.layout import uniform_plan  # noqa: E402
from megatron_h2.training.step import StepRunner  # noqa: E402
from tests.helpers.dist_utils import run_distributed  # noqa: E402

WORLD, LR, NUM_SAMPLES = 2, 1e-4, 2048  # processes, learning rate, samples in the dataset
DISTURBED = "\nwarning: other processes took the cores during this run; the figures are disturbed"
now = time.perf_counter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--part", choices=("all", "pp", "dp", "schedules"), default="all")
    for flag, default in (("num-layers", 4), ("hidden-size", 256), ("num-attention-heads", 8),
                          ("seq-length", 128), ("micro-batch-size", 2), ("vocab-size", 256)):
        p.add_argument("--" + flag, type=int, default=default)
    p.add_argument("--micro-batches", default="2,4,8", help="PP part: micro-batch counts m")
    p.add_argument("--dp-micro-batches", type=int, default=4,
                   help="DP part: micro-batches per replica and step")
    p.add_argument("--bucket-mb", type=float, default=2.0,
                   help="gradient bucket MiB (the training default 25 is one bucket here)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", metavar="FILE", default=None, help="append one JSON line")
    p.add_argument("--schedule-micro-batches", default="4,8,16",
                   help="schedules part (PP=4): micro-batch counts m (multiples of 4)")
    p.add_argument("--schedule-layers", type=int, default=8,
                   help="schedules part: layers (a multiple of 8: 4 stages x 2 chunks)")
    p.add_argument("--schedule-hidden-size", type=int, default=64)
    p.add_argument("--schedule-seq-length", type=int, default=64)
    p.add_argument("--unit-ms", type=float, default=25.0,
                   help="schedules part: a layer's forward (and weight pass, input-gradient "
                        "pass) padded to this; a whole backward to twice")
    p.add_argument("--schedule-rounds", type=int, default=3, help="schedules part: timed rounds")
    args = p.parse_args(argv)
    args.micro_batches = [int(m) for m in args.micro_batches.split(",")]
    args.schedule_micro_batches = [int(m) for m in args.schedule_micro_batches.split(",")]
    return args


# ----------------------------------------------------------------------------- setup per rank
def make_corpus(directory: str, vocab: int, seed: int, num_tokens: int = 400_000) -> str:
    """A Megatron indexed dataset of random-token documents; returns its prefix."""
    prefix, rng = os.path.join(directory, "synthetic"), np.random.default_rng(seed)
    builder, written = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.int32), 0
    while written < num_tokens:
        doc = rng.integers(0, vocab, size=int(rng.integers(64, 512)), dtype=np.int32)
        builder.add_document(doc, [doc.size])
        written += doc.size
    builder.finalize(get_idx_path(prefix))
    return prefix


def run_config(a: argparse.Namespace, pp: int, global_batch: int) -> RunConfig:
    model = ModelConfig(num_layers=a.num_layers, hidden_size=a.hidden_size,
                        num_attention_heads=a.num_attention_heads, seq_length=a.seq_length,
                        vocab_size=DataConfig().padded_vocab_size(a.vocab_size),
                        hidden_dropout=0.0, attention_dropout=0.0, **LLAMA_ARCHITECTURE)
    training = TrainingConfig(micro_batch_size=a.micro_batch_size, global_batch_size=global_batch,
                              train_iters=10**6, seed=a.seed, device="cpu")
    return RunConfig(model=model, optimizer=OptimizerConfig(lr=LR, lr_warmup_iters=0),
                     training=training, parallel=ParallelConfig(pipeline_model_parallel_size=pp))


class SyncProbe:
    """Replaces ``finish_sync`` of one GradBuckets instance by a timed call of the original; with
    ``align``, after a DP barrier (waiting for a slower rank's backward is not communication)."""

    def __init__(self, buckets, group: dist.ProcessGroup | None) -> None:
        self._inner, self.group = buckets.finish_sync, group
        self.align, self.enter, self.enter_cpu, self.aligned, self.exit = False, 0, 0, 0, 0
        buckets.finish_sync = self

    def __call__(self, combine=None) -> None:
        self.enter, self.enter_cpu = now(), time.thread_time()
        if self.align and self.group is not None:
            dist.barrier(group=self.group)
        self.aligned = now()
        self._inner(combine=combine)
        self.exit = now()


@dataclass
class Rank:
    """What ``train`` builds on one rank, plus the probe on its gradient sync."""

    args: argparse.Namespace
    acc: Accelerator
    topo: Topology
    model: GPTModel
    optimizer: DataParallelOptimizer
    dataset: GPTDataset
    probe: SyncProbe
    steps: int = 0

    def runner(self, num_micro: int) -> StepRunner:
        """A StepRunner for steps of ``num_micro`` micro-batches per data-parallel replica."""
        a, topo = self.args, self.topo
        cfg = run_config(a, topo.pp_size, num_micro * a.micro_batch_size * topo.dp_size)
        tp = topo.tp_context(cfg.parallel.sequence_parallel)
        return StepRunner(cfg, self.acc, topo, tp, self.model, self.optimizer)

    def next_start(self, runner: StepRunner) -> int:
        """First sample of the next global batch (wraps around the dataset)."""
        gbs = runner.cfg.training.global_batch_size
        self.steps += 1
        return (self.steps * gbs) % (len(self.dataset) - gbs)


def build_rank(a: argparse.Namespace, rank: int, pp: int, prefix: str) -> Rank:
    """Plan, topology, stage model, optimizer and dataset, as ``training.main.train`` does."""
    cfg = run_config(a, pp, a.micro_batch_size * WORLD // pp)
    acc = get_accelerator("cpu")
    topo = build_topology(uniform_plan(cfg.parallel, cfg.model, cfg.training, WORLD,
                                       acc.device_type), rank, WORLD)
    tp = topo.tp_context(cfg.parallel.sequence_parallel)
    model = GPTModel(cfg.model, acc.kernels, topo.layer_range, topo.is_first_stage,
                     topo.is_last_stage, tp)
    init_parameters(model, cfg.model, cfg.training.seed)
    optimizer = build_data_parallel_optimizer(model, cfg.optimizer, topo.dp_group,
                                              bucket_size_mb=a.bucket_mb, kernels=acc.kernels)
    dataset = load_dataset(prefix, a.seq_length, a.seed, rank, WORLD)
    probe = SyncProbe(optimizer.grad_buckets, topo.dp_group)
    return Rank(a, acc, topo, model, optimizer, dataset, probe)


def load_dataset(prefix: str, seq_length: int, seed: int, rank: int, world: int) -> GPTDataset:
    """The training split of the synthetic corpus; rank 0 writes the index cache first."""
    dataset = None
    for builder in range(world):
        if rank == builder:
            dataset = build_gpt_datasets([prefix], "100,0,0", seq_length, seed,
                                         (NUM_SAMPLES, 0, 0), cache_dir=prefix + "_cache")[0]
        dist.barrier()
    return dataset


# ----------------------------------------------------------------------------- timed pieces
class LocalComm:
    """PipeComm.exchange answered with fixed neighbour tensors (nothing is sent)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.act = torch.randn(shape)
        self.grad = torch.randn(shape) * 1e-3

    def exchange(self, sends, recv) -> torch.Tensor | None:
        if recv is None:
            return None
        return self.act.clone().requires_grad_() if recv[0] == "forward" else self.grad


def timed_step(r: Rank, runner: StepRunner) -> dict[str, float]:
    """One real ``train_step`` after a barrier: phase timestamps, thread CPU up to grad sync."""
    start = r.next_start(runner)
    dist.barrier()
    t0, c0 = now(), time.thread_time()
    runner.train_step(r.dataset, start, r.steps, LR)
    t1, p = now(), r.probe
    return {"start": t0, "sync_enter": p.enter, "sync_aligned": p.aligned,
            "sync_exit": p.exit, "end": t1, "cpu": p.enter_cpu - c0}


def local_compute(r: Rank, runner: StepRunner, num_micro: int) -> tuple[float, float]:
    """Wall and CPU seconds (this thread) of this stage's forward + backward of ``num_micro``
    micro-batches without pipeline traffic."""
    batch = num_micro * runner.cfg.training.micro_batch_size
    samples = runner._replica_samples(r.dataset, r.next_start(runner), list(range(num_micro)))
    # the step function train_step uses (loss divided by the batch's token count)
    step = runner._forward_step(samples, [], batch, float(batch * runner.cfg.model.seq_length))
    order = one_f_one_b(0, 1, range(num_micro))  # forward, backward, forward, ...
    t0, c0 = now(), time.thread_time()
    run_schedule(order, step, LocalComm(runner.comm.shape), runner.chunks)
    elapsed = now() - t0, time.thread_time() - c0
    r.optimizer.zero_grad()
    return elapsed


# ----------------------------------------------------------------------------- workers
def pp_round(r: Rank, runner: StepRunner, m: int, order: list[str]) -> dict:
    """Each PP variant once, in ``order``."""
    out: dict = {}
    for variant in order:
        if variant == "pipeline":
            out["pipeline"] = timed_step(r, runner)
        elif variant == "together":
            dist.barrier()
            out["together"], out["together_cpu"] = local_compute(r, runner, m)
        else:  # each stage alone while the other waits in a barrier
            for stage in range(r.topo.pp_size):
                dist.barrier()
                if stage == r.topo.stage:
                    out["alone"] = local_compute(r, runner, m)[0]
            dist.barrier()
    return out


def pp_worker(rank: int, world: int, a: argparse.Namespace, prefix: str) -> dict:
    r = build_rank(a, rank, pp=world, prefix=prefix)
    variants = ["pipeline", "together", "alone"]
    by_m: dict[int, list[dict]] = {m: [] for m in a.micro_batches}
    for m in a.micro_batches:
        runner = r.runner(m)
        for i in range(a.warmup + a.rounds):
            result = pp_round(r, runner, m, variants[i % 3:] + variants[:i % 3])
            if i >= a.warmup:
                by_m[m].append(result)
    return {"params": sum(p.numel() for p in r.model.parameters()), "by_m": by_m}


def dp_worker(rank: int, world: int, a: argparse.Namespace, prefix: str) -> dict:
    r = build_rank(a, rank, pp=1, prefix=prefix)
    runner, buckets = r.runner(a.dp_micro_batches), r.optimizer.grad_buckets
    records: dict[str, list[dict]] = {"overlap": [], "no_overlap": []}
    for i in range(a.warmup + a.rounds):
        for variant in (["overlap", "no_overlap"] if i % 2 == 0 else ["no_overlap", "overlap"]):
            buckets.overlap = variant == "overlap"  # same buckets, launched from hooks or not
            r.probe.align = not buckets.overlap
            record = timed_step(r, runner)
            if i >= a.warmup:
                records[variant].append(record)
    return {"records": records,
            "bucket_bytes": [b.buffer.numel() * b.buffer.element_size() for b in buckets.buckets]}


# ----------------------------------------------------------------------------- analysis
def span(recs: list[list[dict]], first: str, last: str, first_of=min) -> list[float]:
    """Per round of ``recs[rank][round]``: max over ranks of ``last`` - first_of ``first``."""
    return [max(x[last] for x in rs) - first_of(x[first] for x in rs) for rs in zip(*recs)]


def summarize_pp(results: list[dict], m: int) -> dict:
    rounds = [res["by_m"][m] for res in results]  # [rank][round]
    pipe = [[x["pipeline"] for x in rk] for rk in rounds]
    schedules, steps = span(pipe, "start", "sync_enter"), span(pipe, "start", "end")
    together = [[x["together"] for x in rk] for rk in rounds]
    alone = [med([x["alone"] for x in rk]) for rk in rounds]
    bubble = (m + len(results) - 1) / m
    ideal = bubble * max(med(t) for t in together)
    # the ratio of each round (its pipeline step against its compute), then the median
    paired = [s / (bubble * max(ts)) for s, ts in zip(schedules, zip(*together))]
    return {"m": m, "stage_together_s": [med(t) for t in together], "stage_alone_s": alone,
            "ideal_s": ideal, "ideal_from_alone_s": bubble * max(alone),
            "schedule_s": med(schedules), "step_s": med(steps),
            "ratio": med(schedules) / ideal, "ratio_paired": med(paired),
            "ratio_best": min(schedules) / (bubble * max(min(t) for t in together)),
            "busy_on_core": [med([x["together_cpu"] / x["together"] for x in rk])
                             for rk in rounds],
            "ratio_alone": med(schedules) / (bubble * max(alone)), "schedule_rounds_s": schedules,
            "rank_wall_s": [med([x["sync_enter"] - x["start"] for x in rk]) for rk in pipe],
            "rank_cpu_s": [med([x["cpu"] for x in rk]) for rk in pipe]}


def summarize_dp(results: list[dict]) -> dict:
    out: dict = {"bucket_bytes": results[0]["bucket_bytes"]}
    for variant in ("overlap", "no_overlap"):
        recs = [res["records"][variant] for res in results]
        begin = "sync_enter" if variant == "overlap" else "sync_aligned"
        iterations = span(recs, "start", "end")
        out[variant] = {"iteration_s": med(iterations),
                        "fwd_bwd_s": med(span(recs, "start", "sync_enter")),
                        "comm_s": med(span(recs, begin, "sync_exit", first_of=max)),
                        "skew_s": med(span(recs, "sync_enter", "sync_enter")),
                        "on_core": min(med([x["cpu"] / (x["sync_enter"] - x["start"]) for x in rk])
                                       for rk in recs),
                        "iteration_rounds_s": iterations}
    pairs = zip(out["overlap"]["iteration_rounds_s"], out["no_overlap"]["iteration_rounds_s"])
    out["saved_paired_s"] = med([off - on for on, off in pairs])
    return out


# ----------------------------------------------------------------------------- output
def ms(seconds: float, width: int = 8) -> str:
    return f"{seconds * 1e3:{width}.1f}"


def print_pp(rows: list[dict], params: list[int], took: float) -> None:
    print(f"\nPart 1: PP=2, 1F1B (stage parameters {params[0] / 1e6:.2f}M / "
          f"{params[1] / 1e6:.2f}M; took {took:.0f} s); ms, medians")
    print("   m | busy.0  busy.1 | alone.0 alone.1 |   ideal    1F1B | ratio paired  best "
          "alone |    step")
    for r in rows:
        (t0, t1), (a0, a1) = r["stage_together_s"], r["stage_alone_s"]
        print(f"{r['m']:4d} |{ms(t0, 7)}{ms(t1)} |{ms(a0)}{ms(a1)} |{ms(r['ideal_s'])}"
              f"{ms(r['schedule_s'])} | {r['ratio']:5.3f} {r['ratio_paired']:5.3f} "
              f"{r['ratio_best']:5.3f} {r['ratio_alone']:5.3f} |{ms(r['step_s'])}")
    print("  busy/alone.s: stage s's forward+backward of m micro-batches, no traffic, the other "
          "stage busy/idle; ideal = (m+1)/m x max(busy);\n  1F1B: real schedule; ratio = 1F1B / "
          "ideal (paired: median per round; best: of minima; alone: vs alone); step: + optimizer")
    cpu = ", ".join(f"m={r['m']} " + "/".join(f"{c * 1e3:.0f}" for c in r["rank_cpu_s"]) + " of "
                    + "/".join(f"{w * 1e3:.0f}" for w in r["rank_wall_s"]) for r in rows)
    print(f"  inside 1F1B, stage 0/1 main thread on CPU (ms) of its wall time: {cpu}")
    shares = ", ".join(f"m={r['m']} " + "/".join(f"{100 * x:.0f}%" for x in r["busy_on_core"])
                       for r in rows)
    print(f"  busy compute had its core {shares} of the time (stage 0/1; thread CPU / wall)"
          + DISTURBED * (min(min(r["busy_on_core"]) for r in rows) < 0.9))
    ratios = ", ".join(f"{r['ratio']:.2f} (m={r['m']})" for r in rows)
    print(f"summary PP: measured 1F1B / ideal = {ratios}")


def print_dp(res: dict, num_micro: int, took: float) -> None:
    on, off, sizes = res["overlap"], res["no_overlap"], res["bucket_bytes"]
    print(f"\nPart 2: DP=2, {num_micro} micro-batches per replica, {len(sizes)} gradient "
          f"buckets of {', '.join(f'{s / 2**20:.2f}' for s in sizes)} MiB "
          f"({sum(sizes) / 2**20:.2f} MiB; took {took:.0f} s); ms, medians")
    print("  variant      | iteration | fwd+bwd | comm wait after bwd | share of iter. | rank skew")
    for name, v in (("overlap on", on), ("overlap off", off)):
        print(f"  {name:12s} | {ms(v['iteration_s'])}  |{ms(v['fwd_bwd_s'])} | "
              f"{ms(v['comm_s'])}            | {100 * v['comm_s'] / v['iteration_s']:7.1f} %    "
              f"|{ms(v['skew_s'])}")
    print("  comm wait: in finish_sync; overlap on: buckets launched from the grad hooks of the "
          "last backward;\n  off: all buckets all-reduced after a barrier (all of the comm.); "
          f"fwd+bwd had its core {100 * on['on_core']:.0f}% / {100 * off['on_core']:.0f}% of "
          "the time (main thread CPU / wall, lower rank)"
          + DISTURBED * (min(on["on_core"], off["on_core"]) < 0.9))
    gbps = sum(sizes) / off["comm_s"] / 1e9
    print(f"summary DP: gradient all-reduce alone {off['comm_s'] * 1e3:.1f} ms ({gbps:.2f} GB/s,"
          f" {100 * off['comm_s'] / off['iteration_s']:.1f}% of an iteration); exposed with "
          f"overlap {on['comm_s'] * 1e3:.1f} ms ({100 * on['comm_s'] / on['iteration_s']:.1f}%);"
          f" iteration off - on (paired median) {res['saved_paired_s'] * 1e3:.1f} ms")


def print_header(a: argparse.Namespace) -> None:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"torch {torch.__version__} | {platform.machine()} | {os.cpu_count()} CPUs, load "
          f"average {load} | {WORLD} gloo processes (schedules part: 4), 1 thread each "
          "(torch.set_num_threads(1), "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})")
    print(f"model: {a.num_layers} layers, hidden {a.hidden_size}, heads {a.num_attention_heads}"
          f", seq {a.seq_length}, vocab {a.vocab_size}, micro-batch {a.micro_batch_size}, fp32 | "
          f"{a.warmup} warm-up + {a.rounds} timed rounds, variants alternated in each round")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    print_header(a)
    report: dict = {"config": vars(a), "torch": torch.__version__, "cpus": os.cpu_count(),
                    "threads_per_process": 1, "load_average": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        prefix = make_corpus(tmp, a.vocab_size, a.seed)
        if a.part in ("all", "pp"):
            t, results = now(), run_distributed(pp_worker, WORLD, a, prefix, timeout=900)
            report["pp"] = [summarize_pp(results, m) for m in a.micro_batches]
            print_pp(report["pp"], [res["params"] for res in results], now() - t)
        if a.part in ("all", "dp"):
            t, results = now(), run_distributed(dp_worker, WORLD, a, prefix, timeout=900)
            report["dp"] = summarize_dp(results)
            print_dp(report["dp"], a.dp_micro_batches, now() - t)
        if a.part in ("all", "schedules"):
            from bench_schedules import run_schedules  # Part 3 lives in its own file

            report["schedules"] = run_schedules(a, prefix)
    if a.json:
        with open(a.json, "a") as fh:
            fh.write(json.dumps(report) + "\n")
        print(f"results appended to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
