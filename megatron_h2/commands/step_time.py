"""Predicted vs measured step time of a run: the cost model's step time of the plan (with the
cluster file and profile table it was planned with) against the median `iteration_ms` of the
run's steady-state iterations (its `--log-jsonl`, logged every iteration; the first --skip
iterations and any that include a validation pass are left out).

    python tools/step_time.py --plan runs/demo/plan.yaml --cluster runs/demo/cluster.yaml \\
        --profile runs/demo/profile.yaml --model examples/models/tiny.yaml \\
        --metrics runs/demo/metrics.jsonl --skip 5
"""

import argparse
import statistics
import sys
from pathlib import Path

from megatron_h2.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", required=True)
    p.add_argument("--cluster", required=True)
    p.add_argument("--model", required=True, help="model YAML (as given to tools/plan.py)")
    p.add_argument("--profile", help="profile table (as given to tools/plan.py)")
    p.add_argument("--metrics", required=True, help="the run's --log-jsonl")
    p.add_argument("--skip", type=int, default=5, help="warm-up iterations left out (default 5)")
    a = p.parse_args(argv)
    try:
        from megatron_h2.plan.schema import HeteroPlan
        from megatron_h2.planner.calibration import steady_step_ms
        from megatron_h2.planner.cluster import Cluster
        from megatron_h2.planner.cost_model import CostConfig, CostModel
        from megatron_h2.planner.model_input import model_from_yaml
        from megatron_h2.planner.pipelines_cost import evaluate_plan
        from megatron_h2.planner.profile import ProfileTable

        profile = ProfileTable.from_yaml(a.profile) if a.profile else None
        cost = CostModel(Cluster.from_yaml(a.cluster), model_from_yaml(a.model), CostConfig(),
                         profile)
        estimate = evaluate_plan(cost, HeteroPlan.from_yaml(a.plan))
        predicted = estimate.step_time_s
        if not Path(a.metrics).is_file():
            raise ConfigError(f"--metrics file {a.metrics} does not exist")
        times = steady_step_ms(a.metrics, a.skip)
    except ValueError as exc:  # ConfigError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"predicted step time: {predicted:.2f} s (cost model, {a.plan})")
    cores = cost.cluster.host_cores
    if cores is not None:  # CPU emulation: what bounds the step
        cpu = sum(e.host_cpu_s for e in getattr(estimate, "pipelines", (estimate,)))
        print(f"  CPU emulation: the ranks' passes take {cpu:.2f} s of CPU time per step; over "
              f"the {cores:.2f} cores the processes got when measured (host_cores) that is "
              f"{cpu / cores:.2f} s (other load on the cores since changes it)")
    if not times:
        print(f"measured step time: none (no logged iteration after the {a.skip} warm-up ones)")
        return 0
    measured = statistics.median(times) / 1e3
    print(f"measured step time:  {measured:.2f} s (median of {len(times)} iterations after the "
          f"first {a.skip}; {min(times) / 1e3:.2f}-{max(times) / 1e3:.2f} s)")
    print(f"measured / predicted: {measured / predicted:.2f}")
    return 0

