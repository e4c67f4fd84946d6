#!/usr/bin/env python3
"""Planner scale benchmark (not a test): time to plan the example clusters on this machine.

Targets (2 CPU cores, measured when nothing else runs): the 1,024-chip four-type example in at
most 3 s, the 10,000-chip six-type cluster in at most 60 s. Both search every pipeline schedule
(1f1b, interleaved with V = 2..4, zero-bubble) unless ``--schedules`` narrows it. The search stops
at its time limit (55 s by default) and then reports how close to the optimum its best plan is
proven to be.

    python bench/bench_planner.py [--time-limit 55] [--top 5] [--schedules 1f1b,zero-bubble]

``--family`` times a seeded family of random clusters and models instead (planner_family.py):
per cluster size the median, 90th percentile and maximum search time and proven gap, against
the targets (every 1,024-chip member under 5 s, every 10,000-chip member under 30 s with a gap
under 2%, 100,000 chips of 8 types under 60 s with a gap under 5%); each search's time limit is
its size's target, so a member that does not finish in time shows as a gap.

    python bench/bench_planner.py --family [--sizes 64,1024,10000,100000] [--members 5]

``--scaling`` searches the same seeds' clusters with one of chip types (2 to 8), chips or layers
varied (``--axes "chip types"`` for one axis): CPU seconds, proven gap, prefixes and prefixes
per CPU second.

    python bench/bench_planner.py --scaling [--axes "chip types"] [--members 2] [--time-limit 10]

``--cpu-clock`` makes every time limit count this process's CPU seconds instead of wall
seconds: on a machine that other work shares, the search then gets the same work done whatever
the load, so that runs compare (the targets are wall seconds on an idle machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from planner_family import member, use_cpu_clock

from megatron_h2.errors import ConfigError
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
    parser.add_argument("--family", action="store_true", help="time the random family")
    parser.add_argument("--sizes", default="64,1024,10000,100000")
    parser.add_argument("--members", type=int, default=5, help="family members per size")
    parser.add_argument("--seed", type=int, default=0, help="first seed of the family")
    parser.add_argument(
        "--scaling", action="store_true", help="how the search grows with types, chips, layers"
    )
    parser.add_argument(
        "--axes", default="", help="--scaling: only these axes (chip types, chips, layers)"
    )
    parser.add_argument(
        "--cpu-clock", action="store_true", help="time limits in CPU seconds, not wall seconds"
    )
    args = parser.parse_args()
    schedules = tuple(name.strip() for name in args.schedules.split(","))
    if args.cpu_clock:
        use_cpu_clock()
        print("time limits count CPU seconds of this process (--cpu-clock)")
    if args.scaling:
        axes = [name.strip() for name in args.axes.split(",") if name.strip()]
        return scaling(args.members, args.seed, args.top, schedules, args.time_limit, axes)
    if args.family:
        sizes = [int(size) for size in args.sizes.split(",")]
        return family(sizes, args.members, args.seed, args.top, schedules)
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


TARGETS = {64: (5.0, None), 1024: (5.0, None), 10_000: (30.0, 0.02), 100_000: (60.0, 0.05)}
"""Cluster size -> (search time target in s, proven gap target); also each search's limit.

A size without a gap target must finish: a search that stops at its limit did not plan in
under that time, whatever gap it proved."""


def family(sizes: list[int], members: int, first: int, top: int, schedules: tuple) -> int:
    """Search every member of the family per size; print each and the size's statistics."""
    print(f"family: seeds {first}-{first + members - 1}, top {top}; load before: {_load()}")
    for size in sizes:
        limit, gap_target = TARGETS.get(size, (60.0, None))
        times, cpus, gaps = [], [], []
        print(f"\n{size:,} chips (time limit {limit:.0f} s):")
        for seed in range(first, first + members):
            item = member(seed, size)
            started, cpu = time.perf_counter(), time.process_time()
            options = SearchOptions(
                item.global_batch_size, top_k=top, time_limit_s=limit, schedules=schedules
            )
            try:
                result = search(item.cost, options)
            except ConfigError as error:
                print(f"  {item.label}: no plan fits ({str(error)[:60]})")
                continue
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
            times.append(elapsed)
            cpus.append(cpu)
            gaps.append(result.gap)
            s = result.stats
            print(
                f"  {item.label}: {elapsed:.1f} s ({cpu:.1f} s CPU), gap {100 * result.gap:.1f}%,"
                f" step {result.best.estimate.step_time_s:.3f} s, {s.nodes:,} prefixes,"
                f" {s.splits_solved:,} splits"
            )
        if not times:
            continue
        gap_ok = max(gaps) == 0 if gap_target is None else max(gaps) < gap_target
        ok = max(times) <= limit * 1.05 and gap_ok
        print(
            f"  time s: median {statistics.median(times):.1f}, p90 {_p90(times):.1f},"
            f" max {max(times):.1f} (CPU: median {statistics.median(cpus):.1f},"
            f" max {max(cpus):.1f}); gap %: median {100 * statistics.median(gaps):.1f},"
            f" p90 {100 * _p90(gaps):.1f}, max {100 * max(gaps):.1f};"
            f" finished (gap 0) {sum(g == 0 for g in gaps)}/{len(gaps)};"
            f" target {'met' if ok else 'missed'}; load {_load()}"
        )
    return 0


SCALING = (  # (axis, [(size, types, model)]): one axis varies, the others stay
    ("chip types", [(1024, t, "70B") for t in range(2, 9)]),
    ("chips", [(n, 4, "70B") for n in (256, 1024, 10_000, 100_000)]),
    ("layers", [(1024, 4, m) for m in ("7B", "70B", "405B")]),
)


def scaling(
    members: int, first: int, top: int, schedules: tuple, limit: float, axes: list[str]
) -> int:
    """Per axis of :data:`SCALING` named in ``axes`` (all if empty), the same seeds' clusters
    with one of types, chips or layers varied: CPU seconds, proven gap, prefixes (and prefixes
    per CPU second) of each search."""
    print(f"scaling: seeds {first}-{first + members - 1}, limit {limit:g} s; load {_load()}")
    for axis, points in SCALING:
        if axes and axis not in axes:
            continue
        print(f"\n{axis}:")
        for size, types, model in points:
            cpus, gaps, nodes, rates = [], [], [], []
            for seed in range(first, first + members):
                item = member(seed, size, types, model)
                cpu = time.process_time()
                options = SearchOptions(
                    item.global_batch_size, top_k=top, time_limit_s=limit, schedules=schedules
                )
                try:
                    result = search(item.cost, options)
                except ConfigError:
                    continue
                cpus.append(time.process_time() - cpu)
                gaps.append(result.gap)
                nodes.append(result.stats.nodes)
                rates.append(result.stats.nodes / max(cpus[-1], 1e-9))
            if cpus:
                print(
                    f"  {size:>7,} chips, {types} types, {model}: CPU s median"
                    f" {statistics.median(cpus):.1f} max {max(cpus):.1f}; gap % median"
                    f" {100 * statistics.median(gaps):.1f} max {100 * max(gaps):.1f}; prefixes"
                    f" median {statistics.median(nodes):,.0f}"
                    f" ({statistics.median(rates):,.0f} per CPU s); finished"
                    f" {sum(g == 0 for g in gaps)}/{len(gaps)}; load {_load()}"
                )
    return 0


def _p90(values: list[float]) -> float:
    """The 90th percentile (nearest rank)."""
    ordered = sorted(values)
    return ordered[max(0, -(-9 * len(ordered) // 10) - 1)]


def _load() -> str:
    try:
        return " ".join(f"{value:.1f}" for value in os.getloadavg())
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
