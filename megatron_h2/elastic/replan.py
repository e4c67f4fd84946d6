"""Re-planning for the elastic launcher: which chips survive, the best plan for them, and what
changed.

The planner (HeteroAuto) is run for the surviving chips with the same model and global batch
(plans of one pipeline and of several data-parallel pipelines); the candidates are taken best
first until one passes the runtime's own checks for the model
(TP dividing the padded vocabulary, ...). Checkpoints do not depend on the layout, so any plan
resumes any checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, replace

from megatron_h2.config import RunConfig
from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner import Cluster, CostConfig, CostModel, SearchOptions, search
from megatron_h2.planner.pipelines_cost import evaluate_plan
from megatron_h2.planner.pipelines_search import search_pipelines
from megatron_h2.planner.report import stage_summary
from megatron_h2.training.layout import check_plan_for_model, describe_dp


def with_counts(cluster: Cluster, counts: dict[str, int]) -> Cluster:
    """The cluster with ``counts[type]`` chips of each type (types with none are dropped)."""
    chips = tuple(replace(chip, count=counts[chip.name]) for chip in cluster.chips
                  if counts.get(chip.name, 0) > 0)
    if not chips:
        raise ConfigError("no chip is left to train on")
    return Cluster(chips, cluster.cross_chip_gb_per_s if len(chips) > 1 else None,
                   cluster.host_cores)


@dataclass(frozen=True)
class Planned:
    """A plan that fits the cluster and the runtime, with its predicted throughput."""

    plan: HeteroPlan
    tokens_per_s: float

    def describe(self) -> str:
        stages = " + ".join(f"[{stage_summary(p)}]" if self.plan.pipelines else stage_summary(p)
                            for p in self.plan.pipeline_plans)
        return (f"{stages} (DP {describe_dp(self.plan)}, micro-batch "
                f"{self.plan.micro_batch_size}, {self.plan.world_size} chips)")


def _cost(cluster: Cluster, cfg: RunConfig) -> CostModel:
    """The planner's cost model for ``cfg``'s model (``cfg.model`` holds the padded vocabulary
    after the data is prepared: the one description the planner and the runtime share)."""
    return CostModel(cluster, cfg.model,
                     CostConfig(use_distributed_optimizer=cfg.parallel.use_distributed_optimizer))


def evaluate(plan: HeteroPlan, cluster: Cluster, cfg: RunConfig) -> Planned:
    """Predicted throughput of a given plan (of one pipeline or several) on ``cluster``."""
    return Planned(plan, evaluate_plan(_cost(cluster, cfg), plan).tokens_per_s)


def best_plan(cluster: Cluster, cfg: RunConfig, global_batch: int, micro_batch: int | None,
              time_limit_s: float) -> Planned:
    """The planner's best plan for ``cluster`` that the runtime accepts for ``cfg``'s model."""
    sizes = None if micro_batch is None else (micro_batch,)
    cost = _cost(cluster, cfg)
    options = SearchOptions(global_batch, top_k=8, micro_batch_sizes=sizes,
                            time_limit_s=time_limit_s)
    result = search(cost, options)
    ranked = [Planned(c.plan, c.estimate.tokens_per_s) for c in result.candidates]
    # data-parallel pipelines, when faster than some plan ranked, in what is left of the limit
    slowest = max(c.estimate.step_time_s for c in result.candidates)
    multi = search_pipelines(cost, options, time_limit_s - result.stats.elapsed_s, slowest).best
    if multi is not None:
        ranked.append(Planned(multi.plan, multi.estimate.tokens_per_s))
        ranked.sort(key=lambda planned: -planned.tokens_per_s)
    reasons = []
    for planned in ranked:
        plan = planned.plan
        try:
            check_plan_for_model(plan, cfg.model, cfg.parallel, plan.world_size)
        except ConfigError as exc:
            reasons.append(str(exc))
            continue
        return planned
    raise ConfigError("no plan for " + ", ".join(f"{c.count} x {c.name}" for c in cluster.chips)
                      + (f" passes the runtime's checks ({reasons[0]})" if reasons else
                         " fits the model in memory"))


_PROBE = """
import json, sys, torch
from megatron_h2.devices import ACCELERATORS
found = {}
for name, device, count in json.loads(sys.argv[1]):
    if device not in ACCELERATORS or not ACCELERATORS[device].is_available():
        found[name] = 0
    elif device == "cpu":
        found[name] = count  # emulated chips: processes on this host's CPU
    else:
        module, healthy = getattr(torch, device), 0
        for index in range(module.device_count()):
            try:
                torch.ones(1, device=f"{device}:{index}").add_(1).cpu()
                healthy += 1
            except RuntimeError:
                pass
        found[name] = healthy
print(json.dumps(found))
"""


def probe_chips(cluster: Cluster, command: str | None = None) -> dict[str, int]:
    """Healthy chips per type on this host, probed in a fresh process (the launcher never
    initialises a device itself). ``command`` replaces the built-in probe: a shell command that
    prints a JSON object ``{"type": count, ...}``."""
    if command is None and all(c.device == "cpu" for c in cluster.chips):
        return {c.name: c.count for c in cluster.chips}  # emulated chips: nothing to touch
    spec = json.dumps([[c.name, c.device, c.count] for c in cluster.chips])
    if command:
        proc = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=300)
    else:
        proc = subprocess.run([sys.executable, "-c", _PROBE, spec], capture_output=True,
                              text=True, timeout=300)
    try:
        found = json.loads(proc.stdout.strip().splitlines()[-1])
        return {c.name: max(0, int(found.get(c.name, 0))) for c in cluster.chips}
    except (ValueError, IndexError, TypeError, AttributeError):
        raise ConfigError(f"the health probe failed (exit {proc.returncode}): "
                          f"{(proc.stderr or proc.stdout).strip()[-200:]}") from None


def change_summary(before: Planned, after: Planned, chips_before: dict[str, int],
                   chips_after: dict[str, int]) -> list[str]:
    """Log lines saying what a re-plan changed: chips, stages, predicted tokens/s."""
    types = list(dict.fromkeys([*chips_before, *chips_after]))
    chips = ", ".join(f"{t} {chips_before.get(t, 0)} -> {chips_after.get(t, 0)}" for t in types)
    ratio = after.tokens_per_s / before.tokens_per_s if before.tokens_per_s else float("nan")
    return [f"chips available: {chips}",
            f"stages: {before.describe()} -> {after.describe()}",
            f"expected throughput (cost model): {before.tokens_per_s:,.0f} -> "
            f"{after.tokens_per_s:,.0f} tokens/s ({ratio:.0%})"]
