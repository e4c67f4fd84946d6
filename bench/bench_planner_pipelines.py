#!/usr/bin/env python3
"""Planner benchmark for the data-parallel pipelines search (not a test): CPU seconds of the
one-pipeline search and of the pipelines search after it, as `tools/plan.py` runs them (the
pipelines search given the one-pipeline step to beat where the code takes it), with the count of
pipeline searches and the "why" lines about plans of pipelines.

    python bench/bench_planner_pipelines.py [--model examples/models/mixtral_8x7b.yaml]
        [--cluster examples/clusters/moe_mixed_1024.yaml] [--zero] [--time-limit 55]
        [--cpu-clock]

``--model bench-superlinear`` takes `bench/bench_superlinear.py`'s model (global batch 16,
micro-batch 1, for `examples/clusters/cpu_superlinear.yaml`). Run the same script from two trees
side by side (before / after) in the same minutes: the machine's load moves both alike. Times
are `time.process_time` (this process's CPU seconds), with wall seconds and the load average.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from megatron_h2.plan.yaml_io import load_yaml_mapping  # noqa: E402
from megatron_h2.planner.cluster import Cluster  # noqa: E402
from megatron_h2.planner.cost_model import CostConfig, CostModel  # noqa: E402
from megatron_h2.planner.model_input import model_from_yaml  # noqa: E402
from megatron_h2.planner.pipelines_report import Choice, pipelines_why  # noqa: E402
from megatron_h2.planner.pipelines_search import search_pipelines  # noqa: E402
from megatron_h2.planner.search import SearchOptions, search  # noqa: E402


def _model(path: str):  # type: ignore[no-untyped-def]
    """(model, global batch, micro-batch sizes) of a model file or the superlinear bench's."""
    if path == "bench-superlinear":
        from bench_superlinear import MODEL, planner_model

        return planner_model(), MODEL["global_batch_size"], (1,)
    return model_from_yaml(path), int(load_yaml_mapping(path, "model")["global_batch_size"]), None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "examples/models/mixtral_8x7b.yaml"))
    parser.add_argument("--cluster", default=str(ROOT / "examples/clusters/moe_mixed_1024.yaml"))
    parser.add_argument("--zero", action="store_true", help="--use-distributed-optimizer")
    parser.add_argument("--time-limit", type=float, default=55.0,
                        help="seconds for both searches (tools/plan.py's default)")
    parser.add_argument("--cpu-clock", action="store_true",
                        help="the time limit counts this process's CPU seconds, not wall seconds")
    args = parser.parse_args()
    if args.cpu_clock:  # the searches read their clocks through their modules' ``time``
        for name in ("search", "pipelines_search"):
            module = importlib.import_module(f"megatron_h2.planner.{name}")
            module.time = SimpleNamespace(monotonic=time.process_time)  # type: ignore[attr-defined]
    model, batch, sizes = _model(args.model)
    cost = CostModel(Cluster.from_yaml(args.cluster), model,
                     CostConfig(use_distributed_optimizer=args.zero))
    options = SearchOptions(batch, 5, sizes, time_limit_s=args.time_limit)
    cpu, wall = time.process_time(), time.monotonic()
    one = search(cost, options)
    one_cpu, one_wall = time.process_time() - cpu, time.monotonic() - wall
    left = options.time_limit_s - one.stats.elapsed_s
    extra = {}
    if "incumbent_s" in inspect.signature(search_pipelines).parameters:  # as tools/plan.py
        extra["incumbent_s"] = one.best.estimate.step_time_s
    cpu, wall = time.process_time(), time.monotonic()
    pipes = search_pipelines(cost, options, left, **extra)
    pipes_cpu, pipes_wall = time.process_time() - cpu, time.monotonic() - wall
    print(f"tree {ROOT}; load average {os.getloadavg()[0]:.1f}")
    print(f"one-pipeline search: {one_cpu:.2f} s CPU ({one_wall:.1f} s wall), best "
          f"{one.best.estimate.step_time_s:.3f} s, gap {100 * one.gap:.1f}%")
    print(f"pipelines search: {pipes_cpu:.2f} s CPU ({pipes_wall:.1f} s wall), "
          f"{pipes.searches} pipeline searches, {pipes.splits_tried} splits, exhaustive "
          f"{pipes.exhaustive}")
    print(f"both: {one_cpu + pipes_cpu:.2f} s CPU ({one_wall + pipes_wall:.1f} s wall)")
    for line in pipelines_why(Choice(one, pipes)):
        print(f"  - {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
