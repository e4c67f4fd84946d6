"""Part 3 of ``bench_parallel.py`` (``--part schedules``): pipeline schedules at PP=4.

Four gloo processes (one thread each) build their rank as ``training.main.train`` does and time
real ``StepRunner.train_step`` calls, per micro-batch count m (``--schedule-micro-batches``), of
1F1B, interleaved 1F1B with V=2 and zero-bubble (ZB-H1), alternated within each round.

So that four processes fit on two cores shared with other work, every forward, backward and
weight pass is padded with sleep to a fixed length: ``--unit-ms`` per layer for a forward, an
input-gradient pass or a weight pass, twice that for a whole backward. The real compute of a small
model runs first and takes a fraction of it; actions that overrun are counted and flagged.
Padding to a fixed length rather than by a factor (``emulate_slowdown``) keeps other processes'
noise from being multiplied into the figures; the schedule, the point-to-point traffic and the
backward split are the runtime's own. Ideal = the slowest stage's compute in that step (its
padded actions, m micro-batches); bubble = measured / ideal - 1. The planner's simulator
(``megatron_h2.planner.simulator.simulate``, its public API) predicts each plan with the same
nominal layer times; where it cannot model a plan yet, the table says so.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.distributed as dist
from bench_parallel import LR, SyncProbe, load_dataset, med, ms, now

from megatron_h2.config import DataConfig, ModelConfig, OptimizerConfig, RunConfig, TrainingConfig
from megatron_h2.devices import get_accelerator
from megatron_h2.distributed.topology import build_topology
from megatron_h2.models.gpt import GPTModel, init_parameters
from megatron_h2.optimizer.distributed_optimizer import build_data_parallel_optimizer
from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec
from megatron_h2.training.step import StepRunner
from tests.helpers.dist_utils import run_distributed

SCHEDULES = (("1F1B", "1f1b", 1), ("interleaved V=2", "interleaved", 2),
             ("zero-bubble", "zero-bubble", 1))
CHUNKS = {name: chunks for name, _, chunks in SCHEDULES}
PP4 = 4
# nominal time of one layer's work, in units: forward 1, whole backward 2 (input gradient 1 +
# weight gradients 1), as the zero-bubble paper assumes
UNITS = {"forward": 1, "backward": 2, "backward_input": 1, "backward_weight": 1}


class FixedCompute:
    """Compute observer that pads every forward / backward / weight pass with sleep to a fixed
    length: ``unit_s`` x the units of its kind x the chunk's layers (a whole backward deferred
    to the weight pass, on the first virtual stage, counts 2). Actions whose real compute is
    longer are not padded and are counted (``overruns``)."""

    def __init__(self, unit_s: float, layers: list[int], first_stage: bool) -> None:
        self.unit_s, self.layers, self.first_stage = unit_s, layers, first_stage
        self.compute_s, self.overruns = 0.0, 0

    @contextlib.contextmanager
    def compute(self, kind: str, micro_batch: int, chunk: int = 0):
        start = now()
        yield
        units = 2 if kind == "backward_weight" and self.first_stage and chunk == 0 \
            else UNITS[kind]
        target = self.unit_s * units * self.layers[chunk]
        left = target - (now() - start)
        if left > 0:
            time.sleep(left)
        else:
            self.overruns += 1
        self.compute_s += now() - start

    def take(self) -> float:
        value, self.compute_s = self.compute_s, 0.0
        return value


def schedule_model(a: argparse.Namespace) -> ModelConfig:
    return ModelConfig(num_layers=a.schedule_layers, hidden_size=a.schedule_hidden_size,
                       num_attention_heads=a.num_attention_heads, seq_length=a.schedule_seq_length,
                       vocab_size=DataConfig().padded_vocab_size(a.vocab_size))


def schedule_plan(a: argparse.Namespace, schedule: str, chunks: int, m: int) -> HeteroPlan:
    """PP=4 on one chip type, V chunks of equal layers per stage."""
    per_chunk = a.schedule_layers // (PP4 * chunks)
    stages = [StageSpec("cpu", 1, per_chunk * chunks,
                        chunk_layers=(per_chunk,) * chunks if chunks > 1 else ())
              for _ in range(PP4)]
    return HeteroPlan(data_parallel_size=1, micro_batch_size=a.micro_batch_size,
                      global_batch_size=m * a.micro_batch_size, chips={"cpu": ChipSpec("cpu")},
                      stages=stages, schedule=schedule)


def schedule_runners(a: argparse.Namespace, rank: int, world: int) -> tuple[dict, dict]:
    """A StepRunner per (schedule, m) on shared models (one per chunk count), and the probe on
    each model's gradient sync."""
    acc, model_cfg = get_accelerator("cpu"), schedule_model(a)
    runners, models = {}, {}
    for name, schedule, chunks in SCHEDULES:
        for m in a.schedule_micro_batches:
            topo = build_topology(schedule_plan(a, schedule, chunks, m), rank, world)
            if chunks not in models:
                model = GPTModel(model_cfg, acc.kernels, pre_process=topo.is_first_stage,
                                 post_process=topo.is_last_stage, chunks=topo.chunk_ranges)
                init_parameters(model, model_cfg, a.seed)
                opt = build_data_parallel_optimizer(model, OptimizerConfig(lr=LR), None)
                models[chunks] = (model, opt, SyncProbe(opt.grad_buckets, None))
            model, opt, _ = models[chunks]
            cfg = RunConfig(model=model_cfg, optimizer=OptimizerConfig(lr=LR, lr_warmup_iters=0),
                            training=TrainingConfig(micro_batch_size=a.micro_batch_size,
                                                    global_batch_size=m * a.micro_batch_size,
                                                    train_iters=10**6, seed=a.seed,
                                                    device="cpu"))
            runner = StepRunner(cfg, acc, topo, topo.tp_context(), model, opt)
            runner.clock = FixedCompute(a.unit_ms / 1e3, [b - f for f, b in topo.chunk_ranges],
                                        topo.is_first_stage)
            runners[(name, m)] = runner
    return runners, {chunks: probe for chunks, (_, _, probe) in models.items()}


def schedules_worker(rank: int, world: int, a: argparse.Namespace, prefix: str) -> dict:
    """Every (schedule, m) once per round in rotating order; per step: start, end of the
    schedule (the gradient sync is entered right after), this stage's compute, overruns."""
    torch.set_num_threads(1)
    dataset = load_dataset(prefix, a.schedule_seq_length, a.seed, rank, world)
    runners, probes = schedule_runners(a, rank, world)
    keys, steps = list(runners), 0
    out: dict[str, list[dict]] = {f"{name}|{m}": [] for name, m in keys}
    for i in range(1 + a.schedule_rounds):  # one untimed round first
        for name, m in keys[i % len(keys):] + keys[:i % len(keys)]:
            runner, probe = runners[(name, m)], probes[CHUNKS[name]]
            gbs, steps = m * a.micro_batch_size, steps + 1
            runner.clock.take()
            overruns = runner.clock.overruns
            dist.barrier()
            t0 = now()
            runner.train_step(dataset, (steps * gbs) % (len(dataset) - gbs), steps, LR)
            if i > 0:
                out[f"{name}|{m}"].append({"start": t0, "end": probe.enter,
                                           "compute": runner.clock.take(),
                                           "overruns": runner.clock.overruns - overruns})
    return out


def simulate_schedules(a: argparse.Namespace) -> dict:
    """The simulator's step time and bubble of every (schedule, m) for the nominal times (a
    layer's forward 1 unit, backward 2, nothing else); ``{key: (step_s, bubble) or error}``."""
    from megatron_h2.measurement.chip_timing import PROFILE_MODEL_KEYS
    from megatron_h2.planner import Cluster, CostModel, ProfileTable, simulate

    model = schedule_model(a)
    times = {"layer_forward_ms": a.unit_ms, "layer_backward_ms": 2 * a.unit_ms}
    profile = ProfileTable.from_dict({"model": {k: getattr(model, k) for k in PROFILE_MODEL_KEYS},
                                      "chips": {"cpu": {"micro_batch_sizes": {
                                          a.micro_batch_size: times}}}})
    # links: gloo on loopback moves one activation ([2, 64, 64] fp32, 32 KiB) in ~0.1 ms
    chip = {"device": "cpu", "count": PP4, "chips_per_node": PP4, "tflops_bf16": 0.1,
            "memory_gib": 8, "intra_node_gb_per_s": 1.0, "inter_node_gb_per_s": 1.0}
    cost = CostModel(Cluster.from_dict({"chips": {"cpu": chip}}), model, profile=profile)
    out: dict = {}
    for name, schedule, chunks in SCHEDULES:
        for m in a.schedule_micro_batches:
            try:
                result = simulate(schedule_plan(a, schedule, chunks, m), cost)
                out[f"{name}|{m}"] = (result.step_time_s,
                                      result.step_time_s / max(result.busy_s) - 1.0)
            except Exception as exc:  # noqa: BLE001 - a simulator that cannot run a plan yet
                out[f"{name}|{m}"] = f"{type(exc).__name__}: {exc}"
    return out


def summarize_schedules(results: list[dict], predicted: dict, a: argparse.Namespace) -> list:
    rows = []
    for m in a.schedule_micro_batches:
        for name, _, _ in SCHEDULES:
            key = f"{name}|{m}"
            per_round = list(zip(*[res[key] for res in results]))  # [round][rank]
            spans = [max(x["end"] for x in rnd) - min(x["start"] for x in rnd)
                     for rnd in per_round]
            ideals = [max(x["compute"] for x in rnd) for rnd in per_round]
            rows.append({"m": m, "schedule": name, "schedule_s": med(spans), "ideal_s": med(ideals),
                         "bubble": med([s / i - 1 for s, i in zip(spans, ideals)]),
                         "theory_1f1b": (PP4 - 1) / m,
                         "overruns": sum(x["overruns"] for rnd in per_round for x in rnd),
                         "stage_compute_s": [med([rnd[r]["compute"] for rnd in per_round])
                                             for r in range(PP4)],
                         "rounds_s": spans, "predicted": predicted.get(key)})
    same: dict[int, set] = {}  # a simulator that ignores the schedule predicts one step for all
    for row in rows:
        if isinstance(row["predicted"], tuple):
            same.setdefault(row["m"], set()).add(round(row["predicted"][0], 9))
    for row in rows:
        row["simulator_ignores_schedule"] = len(same.get(row["m"], ())) == 1
    return rows


def print_schedules(rows: list, a: argparse.Namespace, took: float) -> None:
    print(f"\nPart 3: PP=4 schedules, {a.schedule_layers} layers (hidden "
          f"{a.schedule_hidden_size}, seq {a.schedule_seq_length}, micro-batch "
          f"{a.micro_batch_size}), a "
          f"layer's forward padded to {a.unit_ms:g} ms, its backward to 2 x {a.unit_ms:g} ms "
          f"(took {took:.0f} s); ms, medians of {a.schedule_rounds} rounds")
    print("   m | schedule         |   ideal  measured  bubble | simulated  bubble | "
          "stage compute 0/1/2/3")
    for r in rows:
        pred = r["predicted"]
        sim = (f"{ms(pred[0])}  {100 * pred[1]:5.1f}%" if isinstance(pred, tuple)
               else f"{'n/a':>8}       -")
        comp = "/".join(f"{c * 1e3:.0f}" for c in r["stage_compute_s"])
        print(f"{r['m']:4d} | {r['schedule']:<16} |{ms(r['ideal_s'])}{ms(r['schedule_s'], 10)}"
              f"  {100 * r['bubble']:5.1f}% | {sim} | {comp}")
    print("  ideal = slowest stage's compute in the step (its padded forwards, backwards and "
          "weight passes); measured = first\n  start to last schedule end over the ranks; "
          "bubble = measured / ideal - 1 (1F1B in theory (p - 1) / m); simulated: "
          "planner.simulate\n  with the same nominal layer times")
    overruns = [f"m={r['m']} {r['schedule']}: {r['overruns']}" for r in rows if r["overruns"]]
    print("  actions whose real compute exceeded the padded length (those rows are disturbed): "
          + (", ".join(overruns) if overruns else "none"))
    for error in {r["predicted"] for r in rows if isinstance(r["predicted"], str)}:
        print(f"  simulator could not predict some plans: {error}")
    if any(r["simulator_ignores_schedule"] for r in rows):
        print("  the simulator predicts the same step for every schedule: it does not model "
              "virtual stages or the split backward yet")
    for m in a.schedule_micro_batches:
        text = ", ".join(f"{r['schedule']} {100 * r['bubble']:.1f}%" for r in rows
                         if r["m"] == m)
        print(f"summary schedules m={m}: measured bubble {text}")


def run_schedules(a: argparse.Namespace, prefix: str) -> list:
    """Measure, predict and print; returns the table rows (for --json)."""
    start, predicted = now(), simulate_schedules(a)
    results = run_distributed(schedules_worker, PP4, a, prefix, timeout=1800)
    rows = summarize_schedules(results, predicted, a)
    print_schedules(rows, a, now() - start)
    return rows
