#!/usr/bin/env python3
"""Planner scale benchmark (not a test): time to plan the example clusters on this machine.

Targets (2 CPU cores, measured when nothing else runs): the 1,024-chip four-type example in at
most 3 s, the 10,000-chip six-type cluster in at most 60 s. Both search every pipeline schedule
(1f1b, interleaved with V = 2..4, zero-bubble) unless ``--schedules`` narrows it. The search stops
at its time limit (55 s by default) and then reports how close to the optimum its best plan is
proven to be.

    python bench/bench_planner.py [--time-limit 55] [--top 5] [--schedules 1f1b,zero-bubble]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from megatron_h2.planner import (
    Cluster,
    CostConfig,
    CostModel,
    SearchOptions,
    model_from_yaml,
    search,
)
from megatron_h2.planner.report import dp_label, search_summary, stage_summary
from megatron_h2.planner.simulator import schedule_label

ROOT = Path(__file__).resolve().parent.parent
CASES = (
    ("1,024 chips, 4 types", "examples/clusters/hetero_1024.yaml", 2048, 3.0),
    ("10,000 chips, 6 types", "examples/clusters/hetero_10k_6types.yaml", 4096, 60.0),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=55.0)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--schedules", default="1f1b,interleaved,zero-bubble")
    args = parser.parse_args()
    schedules = tuple(name.strip() for name in args.schedules.split(","))
    model = model_from_yaml(ROOT / "examples/models/llama_100b.yaml")
    print(
        f"model: examples/models/llama_100b.yaml, distributed optimizer, top {args.top},"
        f" schedules {', '.join(schedules)}; load average before: {_load()}"
    )
    for name, path, global_batch, target in CASES:
        started, cpu = time.perf_counter(), time.process_time()
        cost = CostModel(
            Cluster.from_yaml(ROOT / path), model, CostConfig(use_distributed_optimizer=True)
        )
        options = SearchOptions(
            global_batch, top_k=args.top, time_limit_s=args.time_limit, schedules=schedules
        )
        result = search(cost, options)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        best = result.best
        verdict = "OK" if elapsed <= target else "SLOW"
        print(
            f"\n{name} (global batch {global_batch}): planned in {elapsed:.1f} s"
            f" ({cpu:.1f} s of CPU; target {target:.0f} s: {verdict})"
        )
        print(
            f"  best: step {best.estimate.step_time_s:.3f} s,"
            f" {best.estimate.tokens_per_s:,.0f} tokens/s,"
            f" MFU {100 * best.estimate.mfu:.1f}%, DP {dp_label(best.plan)},"
            f" micro-batch {best.plan.micro_batch_size}, {schedule_label(best.plan)}"
        )
        print(f"  stages: {stage_summary(best.plan)}")
        print(f"  {search_summary(result)}")
    print(f"\nload average after: {_load()} (other processes on the 2 cores slow the search)")
    return 0


def _load() -> str:
    try:
        return " ".join(f"{value:.1f}" for value in os.getloadavg())
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
