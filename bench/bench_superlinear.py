#!/usr/bin/env python3
"""Superlinear benchmark (not a test): a mixed cluster against the sum of its chip types alone.

H2's claim: chips that are weak alone (too little memory, so full recompute) become efficient
next to chips that complement them, so a mixed cluster can train faster than the sum of what each
chip type trains alone. On this machine's CPU, with `examples/clusters/cpu_superlinear.yaml`
(`fast`: memory for the model only under full recompute; `big`: memory to spare, three times
slower; one single-threaded process each, padded with sleep to `emulate_slowdown` 4 and 12), the
script

1. measures the chips with `tools/profile_chip.py --threads 1 --emulate` (micro-batch 1): one
   paced process per process of the runs below, measuring at once, so that the profile sees the
   cores as the runs do (`--sequential`: one process alone, unpaced, as each run then is);
2. plans through the planner's API (`search` and `compare_homogeneous`, what
   `tools/plan.py --compare-homogeneous` runs): each chip type alone on its own chips, and the
   mixed cluster, and writes the three plan files; the planner's memory limits decide recompute,
   so `fast` alone runs full recompute for real;
3. runs the three plans for real (`torchrun pretrain_gpt.py --hetero-plan PLAN`, gloo,
   OMP_NUM_THREADS=1) side by side: all three start together and each trains for the same
   minutes (`--exit-duration-in-mins`, enough for the slowest plan's warm-up and `--steps`
   steps), so that every plan meets the same host (its speed and what other processes take
   drift over minutes, and a ratio of runs made at different times divides that drift); a run's
   step time is the median `iteration_ms` of its steps after `--skip` warm-up iterations that
   lie wholly in the window in which all three were past their warm-up (the rows' `time`).
   `--sequential` runs them one after the other instead, in alternating order each round. Every
   round re-profiles first;
4. prints the measured and the predicted tokens/s of each (`CostModel.evaluate` and the
   simulator, with the per-entry median of the rounds' profiles), the ratio mixed / (sum of the
   chip types alone), measured (each round's and their median) and predicted (targets: measured
   >= 1.05, predicted within 10% of it), and the cores: those the processes need by design (sum
   of 1 / emulate_slowdown over the ranks: 0.33 for the mixed plan, 0.67 for the three side by
   side, well under the host's 2), those the runs used (CPU time of torchrun and its workers /
   wall time, start-up included) and those other processes took meanwhile. A round with a run
   they disturbed (>= --busy cores) is compared only when no round is calm; while none is and
   --budget lasts, the bench runs one more.

Plans with per-stage data parallelism run as they are (the process count is the plan's world
size). `--pipelines` runs the planner's best plan of data-parallel pipelines instead of its
best plan of one pipeline (here one pipeline per chip type, each with its share of the batch,
gradients summed across the two after every step: case `pipelines`), against the same chip
types alone, side by side; predicted with the pipelines cost model
(`megatron_h2.planner.pipelines_cost`).

    .venv/bin/python bench/bench_superlinear.py                  # ~7 minutes on 2 quiet cores
    .venv/bin/python bench/bench_superlinear.py --rounds 1 --json results.json
    .venv/bin/python bench/bench_superlinear.py --pipelines       # two pipelines vs alone
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from emulated_runs import (
    ROOT,
    add_quiet_arguments,
    log,
    measure,
    measure_side_by_side,
    median_profile,
    plan_label,
    profile_chips,
    quiet_waiter,
    train_flags,
    write_corpus,
)

from megatron_h2.errors import ConfigError
from megatron_h2.measurement.host_load import OtherLoad, load_average
from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec
from megatron_h2.planner import (
    Cluster,
    CostConfig,
    CostModel,
    ProfileTable,
    SearchOptions,
    compare_homogeneous,
    model_from_dict,
    search,
)
from megatron_h2.planner.pipelines_cost import evaluate_plan, simulate_plan
from megatron_h2.planner.pipelines_search import search_pipelines

CLUSTER = ROOT / "examples" / "clusters" / "cpu_superlinear.yaml"
# hidden 128 / seq 256 / 8 layers, LLaMA-style, no dropout (profiled, planned and trained alike:
# dropout's random masks would double a layer's forward on this CPU): a layer's forward takes
# ~2.6 ms and its backward ~4.5 ms on one core, so a step is 3-13 s at the slowdowns; 1.6M
# parameters, whose weights and optimizer state (27.6 MiB) leave `fast` room for one
# micro-batch's activations only under full recompute.
MODEL = {"num_layers": 8, "hidden_size": 128, "ffn_hidden_size": 352, "num_attention_heads": 4,
         "group_query_attention": True, "num_query_groups": 2, "seq_length": 256,
         "max_position_embeddings": 256, "vocab_size": 512, "global_batch_size": 16,
         "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
         "disable_bias_linear": True, "untie_embeddings_and_output_weights": True,
         "hidden_dropout": 0.0, "attention_dropout": 0.0}
VOCAB = MODEL["vocab_size"]  # NullTokenizer(512): a multiple of 128, nothing padded
MICRO_BATCH_SIZES = (1,)  # what the profile measures; every plan uses it
MIXED = "mixed"
PIPELINES = "pipelines"  # the case of --pipelines: a plan of data-parallel pipelines
TOGETHER = (MIXED, PIPELINES)
STARTUP_S = 15.0  # seconds from launch to the first iteration, several runs starting at once


def planner_model():
    """The bench's model as the planner and pretrain_gpt.py see it."""
    return model_from_dict({k: v for k, v in MODEL.items() if k != "global_batch_size"})


@dataclass(frozen=True)
class Case:
    """One plan the bench runs: a chip type alone (``name`` = the type) or the mixed cluster."""

    name: str
    plan: HeteroPlan
    predicted_tokens_per_s: float


def plan_cases(cluster: Cluster, profile: ProfileTable | None,
               global_batch: int = MODEL["global_batch_size"],
               time_limit_s: float = 30.0, pipelines: bool = False) -> list[Case]:
    """The planner's best plan for each chip type alone, then for the whole cluster: one
    pipeline (case ``mixed``) or, with ``pipelines``, the best plan of data-parallel pipelines
    (case ``pipelines``)."""
    cost = CostModel(cluster, planner_model(), CostConfig(), profile)
    options = SearchOptions(global_batch, 1, MICRO_BATCH_SIZES, time_limit_s=time_limit_s)
    if pipelines:
        found = search_pipelines(cost, options).best
        if found is None:
            raise ConfigError("no plan of data-parallel pipelines fits the cluster")
        together = Case(PIPELINES, found.plan, found.estimate.tokens_per_s)
    else:
        mixed = search(cost, options).best
        together = Case(MIXED, mixed.plan, mixed.estimate.tokens_per_s)
    comparison = compare_homogeneous(cost, options, together.predicted_tokens_per_s)
    cases = []
    for alone in comparison.homogeneous:
        if alone.candidate is None:
            raise ConfigError(f"chip type {alone.chip} alone: {alone.reason}")
        cases.append(Case(alone.chip, alone.candidate.plan, alone.tokens_per_s))
    cases.append(together)
    return cases


def side_by_side_processes(cluster: Cluster, path: Path) -> Path:
    """A plan file whose ranks are the processes of the side-by-side runs (every chip twice:
    once in its type's plan alone, once in the mixed plan), for ``profile_chip.py --emulate``:
    one stage per rank, the layers split evenly (only each rank's chip matters there)."""
    chips = [c.name for c in cluster.chips for _ in range(2 * c.count)]
    layers = MODEL["num_layers"]
    if len(chips) > layers:
        raise ConfigError(f"{len(chips)} side-by-side processes exceed the {layers} layers; "
                          "profile with --sequential")
    split = [layers // len(chips) + (i < layers % len(chips)) for i in range(len(chips))]
    HeteroPlan(
        data_parallel_size=1, micro_batch_size=1, global_batch_size=MODEL["global_batch_size"],
        chips={c.name: ChipSpec(c.device, c.emulate_slowdown) for c in cluster.chips},
        stages=[StageSpec(chip, 1, n) for chip, n in zip(chips, split)],
    ).to_yaml(path, header="bench_superlinear: the side-by-side runs' processes")
    return path


def cores_needed(plan: HeteroPlan) -> float:
    """Cores the plan's processes need while all compute: 1 / emulate_slowdown per rank (of
    every pipeline of a plan of several)."""
    return sum(1.0 / plan.chips[plan.rank_chip(r)].emulate_slowdown
               for r in range(plan.world_size))


def schedules(plan: HeteroPlan) -> str:
    """The plan's schedule, or each pipeline's (``1f1b + zero-bubble``)."""
    return " + ".join(str(pipe.schedule) for pipe in plan.pipeline_plans)


def tokens_per_s(step_ms: float, global_batch: int) -> float:
    return global_batch * MODEL["seq_length"] / (step_ms / 1e3)


def ratio(values: dict[str, float]) -> float:
    """mixed (or pipelines) / sum of the chip types alone."""
    alone = sum(v for name, v in values.items() if name not in TOGETHER)
    return sum(v for name, v in values.items() if name in TOGETHER) / alone


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of profiling + running every plan (default 3)")
    parser.add_argument("--sequential", action="store_true",
                        help="run the plans one after the other (default: side by side, all "
                             "at once, so that every plan meets the same host)")
    parser.add_argument("--steps", type=int, default=3,
                        help="side by side: measured steps of the slowest plan; the runs last "
                             "as long as its warm-up and these steps are predicted to take")
    parser.add_argument("--iters", type=int, default=5,
                        help="--sequential: training iterations per run")
    parser.add_argument("--skip", type=int, default=2, help="warm-up iterations not counted")
    parser.add_argument("--global-batch-size", type=int, default=MODEL["global_batch_size"],
                        help="samples per step (default 16; smaller for a quick check)")
    parser.add_argument("--time-limit", type=float, default=30.0, help="planner time limit (s)")
    parser.add_argument("--pipelines", action="store_true",
                        help="run the planner's best plan of data-parallel pipelines (one per "
                             "chip type here) instead of its best plan of one pipeline")
    add_quiet_arguments(parser, 480.0)
    parser.add_argument("--workdir", help="keep the files here (default: a temporary folder)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.iters <= args.skip:
        parser.error("--iters must exceed --skip")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.perf_counter()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="superlinear_"))
    work.mkdir(parents=True, exist_ok=True)
    model = planner_model()
    cluster = Cluster.from_yaml(CLUSTER)
    log(f"superlinear bench on this machine: {os.cpu_count()} cores, load average "
        f"{load_average():.2f}; cluster {CLUSTER.relative_to(ROOT)}: "
        + ", ".join(f"{c.count} x {c.name} ({c.memory_gib:g} GiB, slowdown "
                    f"{c.emulate_slowdown:g})" for c in cluster.chips) + f"; files in {work}")
    log(f"model: {model.num_layers} layers, hidden {model.hidden_size}, seq {model.seq_length}, "
        f"vocab {model.vocab_size}, {model.num_parameters() / 1e6:.1f}M params; global batch "
        f"{args.global_batch_size}, micro-batch 1; OMP_NUM_THREADS=1 per process")
    data = write_corpus(work, VOCAB)
    flags = train_flags(model, VOCAB, data, args.iters)

    quiet = quiet_waiter(args)

    # side by side, the chips are profiled as they run: one paced process per process of the
    # three runs, measuring at once (sequential runs: one unpaced process, as each run alone)
    emulate = (None if args.sequential
               else side_by_side_processes(cluster, work / "profile_processes.yaml"))
    profiles: list[dict] = []
    profile_load: list[float] = []

    def profile(r: int) -> None:
        quiet()
        with OtherLoad() as other:
            table, _ = profile_chips(work, f"r{r}", model, cluster.names, MICRO_BATCH_SIZES,
                                     emulate)
        profiles.append(table)
        profile_load.append(other.cores)
        row = table["chips"][cluster.names[0]]["micro_batch_sizes"][1]
        log(f"profile round {r + 1} (others {other.cores:.2f} cores): layer "
            f"{row['layer_forward_ms']:.2f}/{row['layer_backward_ms']:.2f} ms, head "
            f"{row['head_forward_ms']:.2f}/{row['head_backward_ms']:.2f} ms (forward/backward)")

    # ---- plan each chip type alone and the mixed cluster with the first profile
    profile(0)
    cases = plan_cases(cluster, ProfileTable.from_dict(profiles[0]), args.global_batch_size,
                       args.time_limit, args.pipelines)
    paths = {}
    for case in cases:
        paths[case.name] = work / f"plan_{case.name}.yaml"
        case.plan.to_yaml(paths[case.name], header=f"bench_superlinear: {case.name}")
        log(f"plan {case.name:<6}: {plan_label(case.plan)} ({schedules(case.plan)}), "
            f"{case.plan.world_size} processes needing {cores_needed(case.plan):.2f} cores")

    # ---- rounds: every plan once, back to back, alternating the order
    rounds: list[dict[str, dict]] = []

    def run_case(case: Case, tag: str) -> None:
        quiet()
        result = measure(paths[case.name], flags, args.skip, work / "log.jsonl")
        rounds[-1][case.name] = result
        text = (f"{result['ms']:.0f} ms (iterations {result['iterations_ms']}, "
                f"{result['wall_s']} s)" if "ms" in result
                else f"FAILED: {result['error'].strip().splitlines()[-1:]}")
        flag = " DISTURBED" if result["load"] >= args.busy else ""
        log(f"{tag} {case.name:<6} used {result['cores']:.2f} cores, others "
            f"{result['load']:.2f}{flag}: {text}")

    # side by side: every plan trains as long as the slowest one is predicted to need for its
    # warm-up and --steps measured steps (x 1.25), after a start-up of about STARTUP_S
    slowest_s = max(args.global_batch_size * MODEL["seq_length"] / case.predicted_tokens_per_s
                    for case in cases)
    minutes = (STARTUP_S + 1.25 * (args.skip + args.steps) * slowest_s) / 60.0
    side_flags = train_flags(model, VOCAB, data, 1_000_000)  # --exit-duration-in-mins ends them
    if not args.sequential:
        log(f"side by side: the {len(cases)} plans start together and train {minutes:.2f} "
            f"minutes each, needing {sum(cores_needed(c.plan) for c in cases):.2f} cores in all")

    def run_together(tag: str) -> None:
        quiet()
        results = measure_side_by_side(paths, side_flags, args.skip, work, minutes)
        rounds[-1].update(results)
        first = next(iter(results.values()))
        flag = " DISTURBED" if first["load"] >= args.busy else ""
        log(f"{tag}: side by side, all used {first['cores']:.2f} cores, others "
            f"{first['load']:.2f}{flag}")
        for case in cases:
            result = results[case.name]
            text = (f"{result['ms']:.0f} ms (steps {result['iterations_ms']}, "
                    f"{result['in_window']} in the common {result['window_s']} s)"
                    if "ms" in result
                    else f"FAILED: {result['error'].strip().splitlines()[-1:]}")
            log(f"  {case.name:<6} {text}")

    def calm(one: dict[str, dict]) -> bool:
        return all("ms" in m and not m["load"] >= args.busy for m in one.values())

    # a round that other processes disturbed is not compared with one they did not; while no
    # round is calm and the budget lasts, one more round
    while len(rounds) < args.rounds or (
            not any(calm(one) for one in rounds) and time.perf_counter() - started < args.budget):
        r = len(rounds)
        if r > 0:
            profile(r)
        rounds.append({})
        if not args.sequential:
            run_together(f"round {r + 1}")
            continue
        for case in cases if r % 2 == 0 else cases[::-1]:
            run_case(case, f"round {r + 1}")
    compared = [one for one in rounds if calm(one)] or rounds
    measured = {case.name: [one[case.name] for one in compared] for case in cases}

    # ---- predictions with the median profile, ratios
    median = median_profile(profiles)
    (work / "profile_median.yaml").write_text(yaml.safe_dump(median, sort_keys=False))
    cost = CostModel(cluster, model, CostConfig(), ProfileTable.from_dict(median))
    rows = {}
    for case in cases:
        runs = [m for m in measured[case.name] if "ms" in m]
        step = statistics.median(m["ms"] for m in runs) if runs else None
        rows[case.name] = {
            "plan": plan_label(case.plan), "schedule": schedules(case.plan),
            "processes": case.plan.world_size, "cores_needed": cores_needed(case.plan),
            "predicted": evaluate_plan(cost, case.plan).tokens_per_s,
            "simulated": tokens_per_s(1e3 * simulate_plan(cost, case.plan).step_time_s,
                                      args.global_batch_size),
            "measured": None if step is None else tokens_per_s(step, args.global_batch_size),
            "steps_ms": [round(m["ms"], 1) for m in runs],
            "cores_used": max((m["cores"] for m in runs), default=None),
            "others": max((m["load"] for m in runs), default=None)}
    log("\ntokens/s of each plan (predicted with the median profile; measured: median over "
        "the rounds used)")
    head = (f"{'case':<6} {'plan':<30} {'proc':>4} {'cores':>5} {'model':>7} {'sim':>7} "
            f"{'measured':>8} {'steps ms':<16} {'used':>5} {'others':>6}")
    log(head)
    log("-" * len(head))
    for name, row in rows.items():
        meas = "-" if row["measured"] is None else f"{row['measured']:.0f}"
        used = "-" if row["cores_used"] is None else f"{row['cores_used']:.2f}"
        others = "-" if row["others"] is None else f"{row['others']:.2f}"
        log(f"{name:<6} {row['plan']:<30} {row['processes']:>4} {row['cores_needed']:>5.2f} "
            f"{row['predicted']:>7.0f} {row['simulated']:>7.0f} {meas:>8} "
            f"{','.join(f'{x:.0f}' for x in row['steps_ms']):<16} {used:>5} {others:>6}")
    used_by = ("the most any run of the plan used" if args.sequential
               else "the most all plans side by side used together")
    log(f"(cores: needed by design, sum of 1/emulate_slowdown; used: {used_by}, start-up "
        "included; others: the most other processes took during a run; "
        f"during profiling: {', '.join(f'{x:.2f}' for x in profile_load)})")
    summary = {"predicted": ratio({n: r["predicted"] for n, r in rows.items()}),
               "simulated": ratio({n: r["simulated"] for n, r in rows.items()})}
    per_round = [ratio({n: tokens_per_s(m["ms"], args.global_batch_size)
                        for n, m in one.items()})
                 for one in compared if all("ms" in m for m in one.values())]
    if per_round:
        summary.update(measured=statistics.median(per_round), rounds=per_round,
                       calm_rounds=sum(calm(one) for one in rounds), all_rounds=len(rounds))
        agree = abs(summary["predicted"] / summary["measured"] - 1) <= 0.10
        summary.update(superlinear=summary["measured"] >= 1.05, agree_within_10pct=agree)
        which = (f"{len(compared)} undisturbed round(s)" if compared is not rounds
                 else f"all {len(rounds)} rounds, every one disturbed")
        target = ("" if args.pipelines else  # the superlinear target is the mixed plan's
                  f" (target >= 1.05: {'OK' if summary['superlinear'] else 'MISSED'})")
        log(f"\n{cases[-1].name} / sum of the chip types alone, per round "
            f"({', '.join(f'{x:.3f}' for x in per_round)}; {which}): measured median "
            f"{summary['measured']:.3f}{target}, predicted "
            f"{summary['predicted']:.3f} (simulator {summary['simulated']:.3f}; within 10% of "
            f"the measured: {'yes' if agree else 'NO'})")
    else:
        log(f"\nsome plan failed; predicted {cases[-1].name} / sum {summary['predicted']:.3f}")
    elapsed = time.perf_counter() - started
    log(f"total {elapsed:.0f} s; load average now {load_average():.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": dict(MODEL, global_batch_size=args.global_batch_size),
             "cluster": cluster.to_dict(), "planned_rounds": args.rounds, "iterations": args.iters,
             "skip": args.skip, "profile": median, "rows": rows,
             "ratios": summary, "profile_other_cores": profile_load, "rounds": rounds,
             "seconds": elapsed}, indent=1))
        log(f"wrote {args.json}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["measured"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
