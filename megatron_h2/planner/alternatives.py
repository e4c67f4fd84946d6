"""Why this schedule: the chosen plan's stages under every pipeline schedule the search considers.

For the best plan's structure (the chip type and TP degree of its stages in pipeline order,
micro-batch size and DP degree) :func:`schedule_alternatives` solves the layer split again under
each other schedule and ``V`` (exactly, as the search does) and reports the step time, or why the
schedule cannot run that pipeline (the micro-batch rule, equal chunks, memory). A plan whose
stages have their own DP degrees is shown under interleaving with its own layer split in ``V``
equal chunks per stage, unless the runtime's routed orders stall there
(:func:`~megatron_h2.planner.interleaved_dp.order_stall`: simulated step over 10% above the
formula's), which is then the reason given.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_h2.errors import ConfigError
from megatron_h2.plan.orders import schedule_problem
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.cost_model import CostModel
from megatron_h2.planner.interleaved_dp import interleaved_variant, order_stall
from megatron_h2.planner.search import Candidate, SearchOptions
from megatron_h2.planner.structure import Found, solve_structure, to_plan


@dataclass(frozen=True)
class Alternative:
    """One schedule for the chosen stages: its best plan, or why there is none."""

    schedule: str
    chunks: int
    candidate: Candidate | None
    reason: str = ""

    @property
    def label(self) -> str:
        """``1f1b``, ``zero-bubble`` or ``interleaved V=2``."""
        return (
            f"{self.schedule} V={self.chunks}" if self.schedule == "interleaved" else self.schedule
        )


def schedule_alternatives(
    cost: CostModel, plan: HeteroPlan, options: SearchOptions
) -> list[Alternative]:
    """The stages of ``plan`` under each schedule variant of ``options`` (best split each)."""
    layers = cost.model.num_layers
    p, m = plan.pipeline_parallel_size, plan.stage_micro_batches(0)
    out = []
    for schedule, chunks in options.schedule_variants(layers):
        problem = None
        if schedule == "interleaved" and len(set(cost.layer_is_moe)) > 1:
            out.append(Alternative(schedule, chunks, None, "not searched for a model with "
                                   "dense and MoE layers (one chunk per stage)"))
            continue
        if schedule == "interleaved" and not plan.uniform_dp:
            out.append(_own_dp_interleaved(cost, plan, chunks))
            continue
        if schedule_problem(schedule, p, m, chunks) is not None:
            problem = "needs two or more stages"
            if p > 1 and m % p:
                problem = f"{m} micro-batches are not a multiple of {p} stages"
        elif layers < p * chunks:
            problem = f"{layers} layers cannot give {p} stages {chunks} chunks each"
        if problem is not None:
            out.append(Alternative(schedule, chunks, None, problem))
            continue
        dp = plan.data_parallel_size if plan.uniform_dp else None  # the search's shape
        shape = BatchShape(
            cost, plan.global_batch_size, plan.micro_batch_size, schedule, chunks, dp, lazy=True
        )
        kinds = [(k.name, k.tp, k.dp, k.ep) for k in shape.kinds]
        blocks: list[list[int]] = []
        for index, stage in enumerate(plan.stages):
            dp = plan.stage_dp(index)
            ep = cost.stage_expert_parallel(stage, dp)
            kind = kinds.index((stage.chip, stage.tensor_parallel_size, dp, ep))
            if blocks and blocks[-1][0] == kind:
                blocks[-1][1] += 1
            else:
                blocks.append([kind, 1])
        suffix = tuple((kind, count) for kind, count in blocks)
        split = solve_structure(shape, suffix)
        if split is None:
            out.append(Alternative(schedule, chunks, None, "no layer split fits in memory"))
            continue
        found = Found(split.step_time_s, shape.mbs, schedule, chunks, suffix, split, shape.kinds)
        alternative = to_plan(found, cost, plan.global_batch_size)
        out.append(
            Alternative(schedule, chunks, Candidate(alternative, cost.evaluate(alternative)))
        )
    return out


def _own_dp_interleaved(cost: CostModel, plan: HeteroPlan, chunks: int) -> Alternative:
    """A per-stage-DP plan's stages in ``chunks`` equal chunks under interleaving, or why not
    (the chunks, the micro-batch rule, memory, or the routed orders stalling)."""
    try:
        variant = interleaved_variant(plan, chunks)
        estimate = cost.evaluate(variant)
    except ConfigError as exc:
        return Alternative("interleaved", chunks, None, str(exc))
    if not estimate.fits:
        return Alternative("interleaved", chunks, None, "the stages' layers do not fit in memory")
    stall = order_stall(cost, variant)
    if stall is not None:
        return Alternative("interleaved", chunks, None, stall)
    return Alternative("interleaved", chunks, Candidate(variant, estimate))
