#!/usr/bin/env python3
"""Planner benchmark for mixture-of-experts models (not a test): search time and the chosen
plan for the example MoE models on the 1,024-chip memory-rich / compute-rich example cluster.

Target (issue 20): the search under 10 s at 1,024 chips. Prints the search's CPU time (this
process) and wall time with the machine's load average, whether the search finished (proven
optimal for the cost model) and the three best plans.

    python bench/bench_planner_moe.py [--model examples/models/mixtral_8x7b.yaml]
        [--cluster examples/clusters/moe_mixed_1024.yaml] [--time-limit 600]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_h2.plan.yaml_io import load_yaml_mapping  # noqa: E402
from megatron_h2.planner.cluster import Cluster  # noqa: E402
from megatron_h2.planner.cost_model import CostConfig, CostModel  # noqa: E402
from megatron_h2.planner.model_input import model_from_yaml  # noqa: E402
from megatron_h2.planner.report import stage_summary  # noqa: E402
from megatron_h2.planner.search import SearchOptions, search  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "examples/models/mixtral_8x7b.yaml"))
    parser.add_argument("--cluster", default=str(ROOT / "examples/clusters/moe_mixed_1024.yaml"))
    parser.add_argument("--time-limit", type=float, default=600.0)
    parser.add_argument("--merge-ep", action=argparse.BooleanOptionalAction, default=True,
                        help="search over kinds merged across EP degrees (the default)")
    args = parser.parse_args()
    model = model_from_yaml(args.model)
    batch = int(load_yaml_mapping(args.model, "model")["global_batch_size"])
    cluster = Cluster.from_yaml(args.cluster)
    cost = CostModel(cluster, model, CostConfig(use_distributed_optimizer=True))
    cpu, wall = time.process_time(), time.monotonic()
    result = search(cost, SearchOptions(global_batch_size=batch, time_limit_s=args.time_limit,
                                         merge_ep=args.merge_ep))
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    stats = result.stats
    chips = sum(c.count for c in cluster.chips)
    print(f"{Path(args.model).name} on {Path(args.cluster).name} ({chips} chips): search"
          f" {cpu:.1f} s CPU, {wall:.1f} s wall, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"{'proven optimal' if stats.exhaustive else 'time limit hit'}, "
          f"{stats.splits_solved} layer splits")
    for cand in result.candidates[:3]:
        est = cand.estimate
        print(f"  {est.step_time_s:.3f} s  {est.tokens_per_s:,.0f} tokens/s  {cand.plan.schedule}"
              f"  {stage_summary(cand.plan)}")


if __name__ == "__main__":
    main()
