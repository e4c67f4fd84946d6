#!/usr/bin/env python3
"""Planner benchmark for mixture-of-experts models (not a test): search time and the chosen
plan for the example MoE models on the 1,024-chip memory-rich / compute-rich example cluster.

Target (issue 20): the search under 10 s at 1,024 chips. Prints the search's CPU time (this
process) and wall time with the machine's load average, whether the search finished (proven
optimal for the cost model) and the three best plans.

    python bench/bench_planner_moe.py [--model examples/models/mixtral_8x7b.yaml]
        [--cluster examples/clusters/moe_mixed_1024.yaml] [--time-limit 600] [--cpu-clock]
        [--no-merge-ep]
    python bench/bench_planner_moe.py --family 10 [--seed 0] --time-limit 60 --cpu-clock

``--family N`` searches N members of a seeded family of MoE models on 1,024-chip clusters of
2-4 random chip types (``planner_family.moe_member``) and prints the median, 90th percentile
and worst search CPU time and proven gap.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from planner_family import moe_member  # noqa: E402

from megatron_h2.plan.yaml_io import load_yaml_mapping  # noqa: E402
from megatron_h2.planner.cluster import Cluster  # noqa: E402
from megatron_h2.planner.cost_model import CostConfig, CostModel  # noqa: E402
from megatron_h2.planner.model_input import model_from_yaml  # noqa: E402
from megatron_h2.planner.report import stage_summary  # noqa: E402
from megatron_h2.planner.search import SearchOptions, SearchResult, search  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "examples/models/mixtral_8x7b.yaml"))
    parser.add_argument("--cluster", default=str(ROOT / "examples/clusters/moe_mixed_1024.yaml"))
    parser.add_argument("--time-limit", type=float, default=600.0)
    parser.add_argument("--merge-ep", action=argparse.BooleanOptionalAction, default=True,
                        help="search over kinds merged across EP degrees (the default)")
    parser.add_argument("--cpu-clock", action="store_true",
                        help="the time limit counts this process's CPU seconds, not wall seconds")
    parser.add_argument("--family", type=int, default=0, metavar="N",
                        help="search N members of the seeded MoE family instead")
    parser.add_argument("--seed", type=int, default=0, help="first seed of the family")
    args = parser.parse_args()
    if args.cpu_clock:  # the search reads its clock through its module's ``time``
        module = importlib.import_module("megatron_h2.planner.search")
        module.time = SimpleNamespace(monotonic=time.process_time)  # type: ignore[attr-defined]
    if args.family:
        return family(args.family, args.seed, args.time_limit, args.merge_ep)
    model = model_from_yaml(args.model)
    batch = int(load_yaml_mapping(args.model, "model")["global_batch_size"])
    cluster = Cluster.from_yaml(args.cluster)
    cost = CostModel(cluster, model, CostConfig(use_distributed_optimizer=True))
    result, cpu, wall = _timed(cost, batch, args.time_limit, args.merge_ep)
    stats = result.stats
    chips = sum(c.count for c in cluster.chips)
    print(f"{Path(args.model).name} on {Path(args.cluster).name} ({chips} chips): search"
          f" {cpu:.1f} s CPU, {wall:.1f} s wall, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"{'proven optimal' if stats.exhaustive else 'time limit hit'}, "
          f"proven within {_gap(result):.1%}, "
          f"{stats.splits_solved} layer splits")
    for cand in result.candidates[:3]:
        est = cand.estimate
        print(f"  {est.step_time_s:.3f} s  {est.tokens_per_s:,.0f} tokens/s  {cand.plan.schedule}"
              f"  {stage_summary(cand.plan)}")
    return 0


def _timed(cost: CostModel, batch: int, limit: float, merge: bool
           ) -> tuple[SearchResult, float, float]:
    """The search, its CPU and wall seconds."""
    cpu, wall = time.process_time(), time.monotonic()
    result = search(cost, SearchOptions(global_batch_size=batch, time_limit_s=limit,
                                        merge_ep=merge))
    return result, time.process_time() - cpu, time.monotonic() - wall


def _gap(result: SearchResult) -> float:
    """How far above the proven lower bound the best plan is (0: proven optimal)."""
    return result.best.estimate.step_time_s / result.stats.lower_bound_s - 1


def family(members: int, first: int, limit: float, merge: bool) -> int:
    """Search the seeded MoE family (planner_family.moe_member); per member and the median,
    90th percentile and worst of the search's CPU time and proven gap."""
    print(f"MoE family: seeds {first}-{first + members - 1}, time limit {limit:g} s, "
          f"{'merged' if merge else 'every'} EP kinds; load before {os.getloadavg()[0]:.1f}")
    cpus, gaps = [], []
    for seed in range(first, first + members):
        item = moe_member(seed)
        result, cpu, wall = _timed(item.cost, item.global_batch_size, limit, merge)
        cpus.append(cpu)
        gaps.append(_gap(result))
        print(f"  {item.label}: {cpu:.1f} s CPU ({wall:.1f} s wall, load "
              f"{os.getloadavg()[0]:.1f}), {'proven optimal' if result.stats.exhaustive else ''}"
              f"{'' if result.stats.exhaustive else f'within {gaps[-1]:.1%}'}; best "
              f"{result.best.estimate.step_time_s:.3f} s {stage_summary(result.best.plan)}")
    for name, values, unit in (("CPU", cpus, "s"), ("gap", [100 * g for g in gaps], "%")):
        ordered = sorted(values)
        p90 = ordered[max(0, -(-9 * len(ordered) // 10) - 1)]
        print(f"{name}: median {statistics.median(values):.1f} {unit}, p90 {p90:.1f} {unit}, "
              f"worst {ordered[-1]:.1f} {unit}")
    print(f"finished {sum(g <= 1e-12 for g in gaps)}/{len(gaps)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
