"""``tools/plan.py``: plan a model on a heterogeneous cluster and write the plan and launch script.

Example::

    python tools/plan.py --cluster examples/clusters/hetero_1024.yaml \\
        --model examples/models/llama_100b.yaml --use-distributed-optimizer \\
        --output runs/plan_100b.yaml --timeline runs/plan_100b.png --compare-homogeneous

Bad input prints one ``error: ...`` line and exits with status 2 (no traceback).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from megatron_h2.errors import ConfigError
from megatron_h2.plan.orders import SCHEDULES
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner.alternatives import schedule_alternatives
from megatron_h2.planner.cluster import Cluster
from megatron_h2.planner.compare import compare_homogeneous
from megatron_h2.planner.cost_model import CostConfig, CostModel
from megatron_h2.planner.launch import launch_script
from megatron_h2.planner.model_input import add_model_arguments, describe, model_from_arguments
from megatron_h2.planner.moe_report import moe_why
from megatron_h2.planner.pipelines_cost import PipelinesSimulation, simulate_pipelines
from megatron_h2.planner.pipelines_report import (
    Choice,
    comparison_pipelines_line,
    pipelines_table,
    pipelines_why,
)
from megatron_h2.planner.pipelines_search import PipelinesCandidate, search_pipelines
from megatron_h2.planner.profile import ProfileTable
from megatron_h2.planner.report import (
    candidates_table,
    comparison_text,
    explain,
    plan_detail,
    search_summary,
    stage_summary,
)
from megatron_h2.planner.search import OWN_DP_SPACES, SearchOptions, SearchResult, search
from megatron_h2.planner.simulator import (
    SimulationResult,
    schedule_label,
    simulate,
    write_chrome_trace,
    write_timeline_png,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage dump
        raise ConfigError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface of tools/plan.py."""
    parser = _Parser(
        prog="tools/plan.py",
        description=(
            "Find the fastest heterogeneous plan (HeteroPP) that fits in every chip's memory."
        ),
    )
    parser.add_argument(
        "--cluster", required=True, metavar="FILE", help="cluster YAML (docs/planner.md)"
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--output", required=True, metavar="PLAN.yaml", help="where to write the best plan"
    )
    parser.add_argument(
        "--launch-script", metavar="FILE", help="launch script (default: PLAN with .sh)"
    )
    parser.add_argument("--top", type=int, default=5, metavar="K", help="plans to list (default 5)")
    parser.add_argument(
        "--timeline", metavar="FILE.png", help="draw the simulated step of the best plan"
    )
    parser.add_argument(
        "--trace", metavar="FILE.json", help="Chrome/Perfetto trace of the simulated step"
    )
    parser.add_argument("--profile", metavar="FILE", help="profile table YAML (measured times)")
    parser.add_argument(
        "--compare-homogeneous",
        action="store_true",
        help="also plan each chip type alone and compare throughput",
    )
    parser.add_argument(
        "--micro-batch-size", type=int, metavar="N", help="fix the micro-batch size"
    )
    parser.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="shard optimizer state over DP (as pretrain_gpt.py's flag)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=55.0,
        metavar="S",
        help="stop the search after S seconds and report the proven gap (default 55)",
    )
    parser.add_argument(
        "--compute-efficiency",
        type=float,
        metavar="F",
        help="fraction of peak TFLOPS reached where no profile says otherwise (default 0.5)",
    )
    parser.add_argument(
        "--schedules",
        default=",".join(SCHEDULES),
        metavar="LIST",
        help="pipeline schedules to consider, comma-separated (default: all of "
        + ", ".join(SCHEDULES)
        + ")",
    )
    parser.add_argument(
        "--max-virtual-stages",
        type=int,
        default=4,
        metavar="V",
        help="most model chunks per stage for the interleaved schedule (default 4)",
    )
    parser.add_argument(
        "--own-dp",
        choices=OWN_DP_SPACES,
        default="all",
        help="plans where chip types have their own DP degrees (each type then uses all its"
        " chips): every such plan (all, default; re-splits of the best one-DP plans first),"
        " the re-splits only with the rest bounded (derived), or none",
    )
    parser.add_argument(
        "--data-parallel-pipelines",
        choices=("search", "none"),
        default="search",
        help="also search plans of several data-parallel pipelines (groupings of the chip types,"
        " batch splits; in what the one-pipeline search leaves of --time-limit) and write them"
        " when faster than one pipeline (default search)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the planner; returns the exit status (0, or 2 on bad input)."""
    try:
        return _run(build_parser().parse_args(argv))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    model, global_batch = model_from_arguments(args)
    cluster = Cluster.from_yaml(args.cluster)
    profile = ProfileTable.from_yaml(args.profile) if args.profile else None
    config_args = {"use_distributed_optimizer": args.use_distributed_optimizer}
    if args.compute_efficiency is not None:
        config_args["compute_efficiency"] = args.compute_efficiency
    cost = CostModel(cluster, model, CostConfig(**config_args), profile)
    sizes = None if args.micro_batch_size is None else (args.micro_batch_size,)
    schedules = tuple(name.strip() for name in args.schedules.split(",") if name.strip())
    options = SearchOptions(
        global_batch,
        args.top,
        sizes,
        time_limit_s=args.time_limit,
        schedules=schedules,
        max_virtual_stages=args.max_virtual_stages,
        own_dp=args.own_dp,
    )
    for target in (args.output, args.launch_script, args.timeline, args.trace):
        if target:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
    print(f"model: {describe(model)}; global batch {global_batch}")
    print(f"cluster: {args.cluster}: " + ", ".join(f"{c.count} x {c.name}" for c in cluster.chips))
    result = search(cost, options)
    left = options.time_limit_s - result.stats.elapsed_s  # one time limit for both searches
    pipelines = (search_pipelines(cost, options, left, result.best.estimate.step_time_s)
                 if args.data_parallel_pipelines == "search" else None)
    choice = Choice(result, pipelines)
    best = result.best
    simulation = simulate(best.plan, cost)
    print(f"\nbest {len(result.candidates)} plans of one pipeline (predicted by the cost model):")
    print(candidates_table(result))
    multi = choice.multi
    if multi is None:
        print("\nplan 1 in detail (busy = simulated forward+backward share of the step):")
        print(plan_detail(best, simulation))
    else:
        many = simulate_pipelines(cost, multi.plan)
        print(f"\nchosen: {multi.plan.num_pipelines} data-parallel pipelines, step"
              f" {multi.estimate.step_time_s:.3f} s, {multi.estimate.tokens_per_s:,.0f} tokens/s,"
              f" MFU {100 * multi.estimate.mfu:.1f}%:")
        print(pipelines_table(multi, many))
    print("\nwhy:")
    if multi is None:
        alternatives = schedule_alternatives(cost, best.plan, options)
        for line in explain(best, simulation, cluster, alternatives) + moe_why(cost, best):
            print(f"  - {line}")
        print(f"  - {search_summary(result)}")
    for line in pipelines_why(choice, None if multi is None else many):
        print(f"  - {line}")
    if multi is None:
        _write_outputs(args, result, cost, simulation)
    else:
        _write_pipelines(args, multi, cost, many)
    if args.compare_homogeneous:
        comparison = compare_homogeneous(cost, options, choice.tokens_per_s,
                                         None if multi else best)
        print("\neach chip type alone vs together:")
        print(comparison_text(comparison))
        print(comparison_pipelines_line(comparison, choice))
    return 0


def _write_outputs(
    args: argparse.Namespace, result: SearchResult, cost: CostModel, simulation: SimulationResult
) -> None:
    best = result.best
    est = best.estimate
    script_path = args.launch_script or str(Path(args.output).with_suffix(".sh"))
    header = "\n".join(
        [
            "Written by tools/plan.py (megatron_h2 HeteroAuto).",
            f"model: {describe(cost.model)}",
            f"cluster: {args.cluster}",
            f"schedule: {schedule_label(best.plan)}; predicted step {est.step_time_s:.3f} s"
            f" (simulation {simulation.step_time_s:.3f} s),"
            f" {est.tokens_per_s:,.0f} tokens/s, MFU {100 * est.mfu:.1f}%",
            f"stages: {stage_summary(best.plan)}",
            f"run with: {script_path}",
        ]
    )
    best.plan.to_yaml(args.output, header=header)
    _write_script_and_pictures(args, best.plan, cost, script_path, simulation,
                               " (open in ui.perfetto.dev or chrome://tracing)", "")


def _write_script_and_pictures(args: argparse.Namespace, plan: HeteroPlan, cost: CostModel,
                               script_path: str, simulation: SimulationResult, trace_note: str,
                               timeline_note: str) -> None:
    """The launch script of ``plan``, and the trace and timeline of ``simulation`` if asked."""
    kind, text = launch_script(
        plan, cost.cluster, cost.model, args.output, args.use_distributed_optimizer
    )
    Path(script_path).write_text(text)
    Path(script_path).chmod(0o755)
    print(f"\nwrote {args.output} and {script_path} ({kind})")
    if args.trace:
        write_chrome_trace(simulation, args.trace)
        print(f"wrote {args.trace}{trace_note}")
    if args.timeline:
        write_timeline_png(simulation, args.timeline)
        print(f"wrote {args.timeline}{timeline_note}")


def _write_pipelines(args: argparse.Namespace, chosen: PipelinesCandidate, cost: CostModel,
                     simulation: PipelinesSimulation) -> None:
    """Write a plan of several pipelines, its launch script and (of its slowest pipeline) the
    simulated timeline."""
    est, plan = chosen.estimate, chosen.plan
    script_path = args.launch_script or str(Path(args.output).with_suffix(".sh"))
    header = "\n".join([
        "Written by tools/plan.py (megatron_h2 HeteroAuto).",
        f"model: {describe(cost.model)}",
        f"cluster: {args.cluster}",
        f"{plan.num_pipelines} data-parallel pipelines; predicted step {est.step_time_s:.3f} s"
        f" (simulation {simulation.step_time_s:.3f} s), {est.tokens_per_s:,.0f} tokens/s,"
        f" MFU {100 * est.mfu:.1f}%",
        *(f"pipeline {k}: {schedule_label(p)}; {stage_summary(p)}"
          for k, p in enumerate(plan.pipelines)),
        f"run with: {script_path}",
    ])
    plan.to_yaml(args.output, header=header)
    note = f": the simulated step of pipeline {est.slowest} (the slowest)"
    _write_script_and_pictures(args, plan, cost, script_path,
                               simulation.pipelines[est.slowest], note, note)
