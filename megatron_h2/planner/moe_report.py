"""The "why" lines of a mixture-of-experts plan: where the MoE and dense layers went, the
experts' share of each chip type's memory, expert parallelism and the dispatch's share of the
slowest stage's time (what :class:`~megatron_h2.planner.cost_model.CostModel` charges for them).
"""

from __future__ import annotations

from megatron_h2.planner.cost_model import CostModel
from megatron_h2.planner.search_options import Candidate

GIB = 2**30


def stage_dispatch_s(cost: CostModel, candidate: Candidate, stage: int) -> float:
    """Seconds of all-to-all (dispatch and combine, forward and backward; again in the
    recomputed forward under full recompute) stage ``stage`` spends per micro-batch."""
    plan, model = candidate.plan, cost.model
    spec, dp = plan.stages[stage], plan.stage_dp(stage)
    ep = cost.stage_expert_parallel(spec, dp)
    layers = [i for r in plan.chunk_layer_ranges()[stage] for i in r]
    moe_layers = sum(cost.layer_is_moe[i] for i in layers)
    imbalance = cost.config.moe_imbalance if ep > 1 else 1.0
    tokens = plan.micro_batch_size * model.seq_length
    chip, dispatched = cost.cluster.chip(spec.chip), model.moe_dispatch_bytes(tokens) / \
        spec.tensor_parallel_size * imbalance
    one = cost.alltoall_s(dispatched, ep, chip)
    if spec.expert_tp != spec.tensor_parallel_size:  # + the all-gather over expert TP
        one += cost.expert_tp_exchange_s(dispatched, spec.expert_tp, chip)
    per_layer = (6 if spec.recompute == "full" else 4) * one
    return moe_layers * per_layer


def moe_why(cost: CostModel, candidate: Candidate) -> list[str]:
    """Reasons about the MoE layers of ``candidate`` (empty for a dense model)."""
    model, plan, est = cost.model, candidate.plan, candidate.estimate
    if not model.is_moe:
        return []
    ranges = plan.chunk_layer_ranges()
    lines = []
    for chip in dict.fromkeys(s.chip for s in plan.stages):
        stages = [i for i, s in enumerate(plan.stages) if s.chip == chip]
        layers = [j for i in stages for r in ranges[i] for j in r]
        moe = sum(cost.layer_is_moe[j] for j in layers)
        eps = sorted({plan.stages[i].expert_model_parallel_size for i in stages})
        share = max(_expert_bytes(cost, candidate, i) / est.stages[i].memory_bytes
                    for i in stages)
        lines.append(
            f"MoE on {chip}: {moe} MoE and {len(layers) - moe} dense layers on "
            f"{len(stages)} stage(s), EP {'/'.join(map(str, eps))}; the experts' weights, "
            f"gradients and optimizer state are up to {100 * share:.0f}% of a stage's peak "
            f"memory ({est.stages[stages[0]].capacity_bytes / GIB:.0f} GiB usable per chip)")
    k = est.bottleneck
    dispatch = stage_dispatch_s(cost, candidate, k)
    imbalance = cost.config.moe_imbalance
    lines.append(
        f"MoE dispatch: the all-to-all takes {1e3 * dispatch:.2f} ms of the slowest stage's "
        f"{1e3 * est.stages[k].work_s:.1f} ms per micro-batch "
        f"({100 * dispatch / est.stages[k].work_s:.1f}%); expert-parallel stages are charged "
        f"a token imbalance of {imbalance:g}x on their experts' compute and dispatch")
    return lines


def _expert_bytes(cost: CostModel, candidate: Candidate, stage: int) -> float:
    """Bytes per chip of the routed experts' weights, gradients and optimizer state on
    ``stage`` (ZeRO-1 over the expert-data-parallel group with the distributed optimizer)."""
    plan, model = candidate.plan, cost.model
    spec, dp = plan.stages[stage], plan.stage_dp(stage)
    ep = cost.stage_expert_parallel(spec, dp)
    layers = [i for r in plan.chunk_layer_ranges()[stage] for i in r]
    moe_layers = sum(cost.layer_is_moe[i] for i in layers)
    tp, etp = spec.tensor_parallel_size, cost.stage_expert_tp(spec)
    experts = model.moe_layer_params_per_chip(tp, ep, etp)[1]
    return moe_layers * experts * cost.config.bytes_per_param(tp * dp // (etp * ep))
