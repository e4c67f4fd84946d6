"""Cost model and simulator of a plan of several data-parallel pipelines.

A plan may list several pipelines (:mod:`megatron_h2.plan.schema`), each a whole pipeline that
computes the model on its share of the global batch. One step of such a plan, as the runtime
runs it (:mod:`megatron_h2.distributed.pipeline_sum`):

1. every pipeline runs its own step on its share (its schedule, its stages' DP syncs): the
   one-pipeline cost model (:meth:`CostModel.evaluate`) or simulator (:func:`simulate`) of
   ``plan.pipelines[k]``, whose ``global_batch_size`` is its share;
2. the pipelines sum their gradients: each rank holds the fp32 gradients of its DP shard of its
   stage's parameters (``params per chip / DP``) and receives that range from every other
   pipeline (one message per overlapping rank and bucket), over the link between its chip type
   and the other pipeline's chips that hold the same layers (``cross_chip_gb_per_s`` through the
   bridge where the chip types differ, else the type's ``inter_node_gb_per_s``), sending as much
   as it receives (full duplex); under the replicated optimizer each stage's DP group then
   all-gathers the summed ranges (fp32) again;
3. the optimizer steps.

:func:`exchange_s` is step 2 for every stage of every pipeline, counted after the slowest
pipeline has finished: the runtime sends a bucket as soon as its DP reduction ends during the
last backward, so this is an upper bound, as the one-pipeline formula's DP sync is. The step is

    step = max_k step_k + max over ranks of their exchange

and :func:`evaluate_plan` / :func:`simulate_plan` give it for a plan of one pipeline or several
alike (the one-pipeline estimate when there is one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner.cost_model import CostModel, PlanEstimate
from megatron_h2.planner.simulator import SimulationResult, simulate

FP32_BYTES = 4
"""What the exchange carries per element: the optimizer's fp32 gradients."""


@dataclass(frozen=True)
class PipelinesEstimate:
    """The cost model's prediction for a plan of several data-parallel pipelines."""

    step_time_s: float
    pipelines: tuple[PlanEstimate, ...]
    exchange_s: float
    """Slowest rank's cross-pipeline gradient exchange (step 2 of the module docstring)."""
    stage_exchange_s: tuple[tuple[float, ...], ...]
    """``[pipeline][stage]``: each stage's exchange time."""
    tokens_per_s: float
    mfu: float
    chips_used: dict[str, int]

    @property
    def fits(self) -> bool:
        """Whether every stage of every pipeline fits in memory."""
        return all(p.fits for p in self.pipelines)

    @property
    def slowest(self) -> int:
        """Index of the pipeline whose own step is the longest."""
        steps = [p.step_time_s for p in self.pipelines]
        return steps.index(max(steps))


@dataclass(frozen=True)
class PipelinesSimulation:
    """One simulated step of a plan of several pipelines: each pipeline's simulation, then the
    exchange after the last of them."""

    plan: HeteroPlan
    estimate: PipelinesEstimate
    pipelines: tuple[SimulationResult, ...]
    step_time_s: float


def _stage_layers(pipe: HeteroPlan, stage: int) -> set[int]:
    """Layers of ``stage`` with -1 for the embedding (first stage) and ``num_layers`` for the
    head (last stage)."""
    held: set[int] = set().union(*(set(r) for r in pipe.chunk_layer_ranges()[stage]))
    if stage == 0:
        held.add(-1)
    if stage == len(pipe.stages) - 1:
        held.add(pipe.num_layers)
    return held


def _stage_params(cost: CostModel, pipe: HeteroPlan, s: int) -> tuple[float, float]:
    """(dense, expert) parameters per chip of stage ``s``: the dense ones (embedding, head,
    attention, dense MLPs, routers, shared experts) synced over its DP group, the routed
    experts of its ``1 / EP`` share (split over expert TP) over its expert-DP group."""
    spec, model = pipe.stages[s], cost.model
    tp, ep, etp = spec.tensor_parallel_size, spec.expert_model_parallel_size, spec.expert_tp
    costs = cost.stage_costs(spec.chip, tp, pipe.micro_batch_size, pipe.stage_dp(s))
    first, last = s == 0, s == len(pipe.stages) - 1
    dense = costs.params(0, first, last)
    experts = 0.0
    for layer in sorted(set().union(*(set(r) for r in pipe.chunk_layer_ranges()[s]))):
        if cost.layer_is_moe[layer]:
            shared, routed = model.moe_layer_params_per_chip(tp, ep, etp)
            dense, experts = dense + shared, experts + routed
        else:
            dense += model.layer_params_per_chip(tp)
    return dense, experts


def stage_exchange_s(cost: CostModel, plan: HeteroPlan, k: int, s: int) -> float:
    """Seconds stage ``s`` of pipeline ``k`` spends receiving (and, full duplex, sending) its
    gradient range from every other pipeline, plus the replicated optimizer's all-gather (of
    MoE layers' routed experts over the expert-DP group of ``TP x DP / (ETP x EP)`` ranks, each
    holding that share of its chip's experts)."""
    pipes = plan.pipeline_plans
    pipe, spec = pipes[k], pipes[k].stages[s]
    dp, tp = pipe.stage_dp(s), spec.tensor_parallel_size
    edp = tp * dp // (spec.expert_tp * spec.expert_model_parallel_size)
    dense, experts = _stage_params(cost, pipe, s)
    shard = dense / dp + experts / edp
    layers = _stage_layers(pipe, s)
    own = cost.cluster.chip(spec.chip)
    total = 0.0
    for j, other in enumerate(pipes):
        if j == k:
            continue
        overlap = [t for t in range(len(other.stages)) if _stage_layers(other, t) & layers]
        chips = {other.stages[t].chip for t in overlap}
        gb_per_s = min(cost.cluster.link_gb_per_s(spec.chip, chip) for chip in chips)
        peers = sum(len(other.stage_ranks(t)) for t in overlap)
        total += (peers * cost.config.p2p_latency_s
                  + shard * FP32_BYTES / (gb_per_s * 1e9 * cost.config.comm_efficiency))
    if not cost.config.use_distributed_optimizer:
        local = own.chips_per_node % (dp * spec.tensor_parallel_size) == 0
        bandwidth = own.intra_node_gb_per_s if local else own.inter_node_gb_per_s
        for group, params in ((dp, dense), (edp, experts)):
            if group > 1 and params:  # all-gather: every rank ends with every range
                total += ((group - 1) * cost.config.collective_latency_s
                          + (group - 1) / group * params * FP32_BYTES
                          / (bandwidth * 1e9 * cost.config.comm_efficiency))
    return total


def model_params_tp1(cost: CostModel) -> float:
    """Parameters of the whole model as one TP rank of TP 1 holds them (embedding, head, every
    layer; a MoE layer's every expert): TP, EP and expert TP split the sharded part among
    ``TP`` (experts: ``ETP x EP``) ranks and replicate the rest, so the shards of any plan's
    ranks sum to at least this."""
    model = cost.model
    total = model.embedding_params_per_chip(1) + model.head_params_per_chip(1)
    for is_moe in cost.layer_is_moe:
        if is_moe:
            total += sum(model.moe_layer_params_per_chip(1, 1, 1))
        else:
            total += model.layer_params_per_chip(1)
    return total


def exchange_floor_s(cost: CostModel, groups: Sequence[Sequence[str]]) -> float:
    """A lower bound on the gradient exchange (:func:`stage_exchange_s`, the slowest rank's)
    of every plan whose pipelines run on the chip types ``groups`` (one group per pipeline),
    whatever each pipeline's shape, share or layer split.

    A rank of pipeline ``k`` pays at least one latency per other pipeline ``j`` and its shard
    over the fastest link between the two groups' types; its pipeline's ranks hold shards that
    sum to at least :func:`model_params_tp1` (each stage's parameters split over its TP, DP
    and expert ranks), on at most the group's chips, so some rank holds at least that over the
    group's chip count (the replicated optimizer's all-gather only adds)."""
    config, cluster = cost.config, cost.cluster
    params = model_params_tp1(cost)
    worst = 0.0
    for k, group in enumerate(groups):
        chips = sum(cluster.chip(name).count for name in group)
        total = 0.0
        for j, other in enumerate(groups):
            if j != k:
                fastest = max(cluster.link_gb_per_s(a, b) for a in group for b in other)
                total += config.p2p_latency_s + params / chips * FP32_BYTES / (
                    fastest * 1e9 * config.comm_efficiency)
        worst = max(worst, total)
    return worst


def evaluate_pipelines(cost: CostModel, plan: HeteroPlan) -> PipelinesEstimate:
    """Predict the step of a plan of several pipelines (see the module docstring)."""
    model = cost.model
    plan.validate(model.num_layers, model.num_attention_heads, model.num_query_groups,
                  num_experts=model.num_experts)
    estimates = tuple(cost.evaluate(pipe) for pipe in plan.pipelines)
    exchange = tuple(
        tuple(stage_exchange_s(cost, plan, k, s) for s in range(len(pipe.stages)))
        for k, pipe in enumerate(plan.pipelines))
    slowest = max(e.step_time_s for e in estimates)
    worst = max(max(row) for row in exchange)
    step = slowest + worst
    if cost.cluster.host_cores is not None:  # CPU emulation: every pipeline shares the cores
        step = max(step, sum(e.host_cpu_s for e in estimates) / cost.cluster.host_cores)
    return _combine(cost, plan, estimates, exchange, step)


def _combine(cost: CostModel, plan: HeteroPlan, estimates: tuple[PlanEstimate, ...],
             exchange: tuple[tuple[float, ...], ...], step: float) -> PipelinesEstimate:
    used = plan.chips_in_use()
    tokens = plan.global_batch_size * cost.model.seq_length
    peak = sum(count * cost.cluster.chip(name).tflops_bf16 * 1e12
               / cost.cluster.chip(name).emulate_slowdown for name, count in used.items())
    mfu = tokens * cost.model.flops_per_token(causal=True) / step / peak
    return PipelinesEstimate(step, estimates, max(max(row) for row in exchange), exchange,
                             tokens / step, mfu, used)


def evaluate_plan(cost: CostModel, plan: HeteroPlan) -> PlanEstimate | PipelinesEstimate:
    """The cost model's estimate of any plan: :meth:`CostModel.evaluate` for one pipeline,
    :func:`evaluate_pipelines` for several."""
    return evaluate_pipelines(cost, plan) if plan.pipelines else cost.evaluate(plan)


def simulate_pipelines(cost: CostModel, plan: HeteroPlan) -> PipelinesSimulation:
    """Simulate every pipeline's step (:func:`simulate`), then the exchange after the slowest
    (each stage starts its exchange when every pipeline is done)."""
    estimate = evaluate_pipelines(cost, plan)
    runs = tuple(simulate(pipe, cost) for pipe in plan.pipelines)
    step = max(run.step_time_s for run in runs) + estimate.exchange_s
    if cost.cluster.host_cores is not None:
        step = max(step, sum(run.estimate.host_cpu_s for run in runs) / cost.cluster.host_cores)
    return PipelinesSimulation(plan, estimate, runs, step)


def simulate_plan(cost: CostModel, plan: HeteroPlan) -> SimulationResult | PipelinesSimulation:
    """The simulated step of any plan: :func:`simulate` for one pipeline,
    :func:`simulate_pipelines` for several."""
    return simulate_pipelines(cost, plan) if plan.pipelines else simulate(plan, cost)
