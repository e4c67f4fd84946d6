"""Interleaved schedules with per-stage DP degrees: whether the runtime's orders stall.

Where the stages of an interleaved plan have different DP degrees, the runtime runs the routed
orders of :func:`~megatron_h2.plan.orders.routed_orders`: each replica's warm-up grows until
the orders provably run, so early replicas hold many chunk-micro-batches and wait for
backwards that the step formula (:func:`~megatron_h2.planner.cost_model.step_time_terms`)
assumes flow. The event simulator (:func:`~megatron_h2.planner.simulator.simulate`) replays
exactly those orders. :func:`order_stall` compares the two: a plan whose simulated step is more
than :data:`STALL_LIMIT` times the formula's is one the planner does not offer, and the reason
is one line. :func:`interleaved_variant` re-chunks a plan's stages (same layers per stage,
``V`` equal chunks) so that the planner can report the interleaved schedule of a per-stage-DP
plan it chose under 1F1B or zero-bubble.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner.cost_model import CostModel
from megatron_h2.planner.simulator import simulate

STALL_LIMIT = 1.10
"""Largest simulated / formula step ratio of an interleaved per-stage-DP plan the planner
offers."""


def order_stall(cost: CostModel, plan: HeteroPlan) -> str | None:
    """Why ``plan``'s routed interleaved orders are excluded (one line), or None when the plan
    is not interleaved with per-stage DP or its simulated step is within :data:`STALL_LIMIT`
    of the formula."""
    if plan.pipelines or plan.schedule != "interleaved" or plan.uniform_dp:
        return None
    formula = cost.evaluate(plan).step_time_s
    simulated = simulate(plan, cost).step_time_s
    if simulated <= STALL_LIMIT * formula:
        return None
    return (f"the runtime's routed interleaved orders stall with per-stage DP "
            f"{'/'.join(str(plan.stage_dp(s)) for s in range(len(plan.stages)))}: simulated "
            f"{simulated:.3f} s, {simulated / formula:.2f}x the formula's {formula:.3f} s "
            f"(over {100 * (STALL_LIMIT - 1):.0f}%)")


def interleaved_variant(plan: HeteroPlan, chunks: int) -> HeteroPlan:
    """``plan``'s stages (chips, TP, DP, layers, recompute) under the interleaved schedule with
    ``chunks`` equal model chunks per stage; ConfigError when a stage's layers do not split."""
    stages = []
    for index, stage in enumerate(plan.stages):
        if stage.num_layers % chunks or stage.num_layers == 0:
            raise ConfigError(f"stage {index}'s {stage.num_layers} layers do not split into "
                              f"{chunks} equal chunks")
        stages.append(replace(stage, chunk_layers=(stage.num_layers // chunks,) * chunks))
    return replace(plan, stages=stages, schedule="interleaved")
