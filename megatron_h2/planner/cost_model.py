"""Analytic cost model: compute, memory and communication of a heterogeneous pipeline plan.

Everything the search and the simulator know about time and memory comes from here; the formulas
and their defaults are written out in ``docs/planner.md``. In short, for a stage of ``l`` layers
on chip type ``c`` with TP degree ``t``, micro-batch ``b`` (``T = b x seq`` tokens) and DP ``d``:

* compute: FLOPs / (t x tflops_bf16 x efficiency) x emulate_slowdown, or measured times / t from
  a profile table; backward = 2 x forward; recompute adds a full forward (``full``) or the
  attention core's forward (``selective``; or the profile's measured ``selective_recompute_ms``);
* TP: two ring all-reduces of ``T x h`` bf16 values per layer in forward and two in backward
  (two more in backward under full recompute), over ``intra_node_gb_per_s``;
* memory: parameters x bytes per parameter (18 = 2 bf16 weight + 4 fp32 grad + 4 fp32 master +
  8 Adam; 6 + 12/d with the distributed optimizer, + 4/d for the reduced gradient shard when
  d > 1: :func:`~megatron_h2.config.state_bytes_per_param`) + the activations the schedule
  keeps (per layer, by recompute mode, for each chunk-micro-batch between its forward and
  backward, and the weight gradients' inputs for each one whose weight-gradient work a
  zero-bubble schedule has deferred; :mod:`.orders` gives the counts) + one layer's full
  activations as backward working space, plus the embedding on the first stage and the head
  (with its logits) on the last;
* pipeline: per micro-batch, ``T x h`` bf16 values each way per stage boundary (``V`` times,
  plus the wrap-around link from the last stage to the first, with ``V`` model chunks), at the
  chip type's ``inter_node_gb_per_s`` or at ``cross_chip_gb_per_s`` where the chip type changes;
* DP: a ring all-reduce (or reduce-scatter + all-gather) of the stage's gradients once per step;
* optimizer: where the profile table measures it, ``optimizer_ns_per_param`` x the parameters a
  chip holds (divided by DP under the distributed optimizer), once per step after the stage's
  last backward. It is added to the stage's end-of-step term (``StageEstimate.dp_sync_s``) in
  :meth:`CostModel.evaluate` and so in the simulator; the search's split solver and bounds leave
  it out (they stay consistent with each other) and candidates are ranked by ``evaluate``.

The step time of each schedule is :func:`step_time_terms` plus the slowest end-of-step sync
(not overlapped with compute, counted as if every stage started it when the pipeline drains: an
upper bound, which the event simulator refines). Under 1F1B, with per-stage work ``w_i``
(forward + backward of one micro-batch), it is ``(m - 1) x max_i w_i + sum_i w_i + 2 x sum of
link times + max_i DP sync_i``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from megatron_h2.config import ModelConfig, Recompute
from megatron_h2.errors import ConfigError
from megatron_h2.plan.orders import check_replica_micro_batches
from megatron_h2.plan.schema import HeteroPlan, StageSpec
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.estimates import (  # noqa: F401 (re-exported)
    MODES,
    CostConfig,
    PlanEstimate,
    StageEstimate,
    replica_warmups,
    step_time_terms,
    zero_bubble_share,
)
from megatron_h2.planner.held_activations import check_schedule, held_states
from megatron_h2.planner.moe_costs import MoECosts
from megatron_h2.planner.stage_costs import StageCosts

if TYPE_CHECKING:
    from megatron_h2.planner.profile import ProfileTable

BF16_BYTES = 2


class CostModel(MoECosts):
    """Cost model of one model on one cluster (optionally refined by a profile table); its
    mixture-of-experts terms are :class:`~megatron_h2.planner.moe_costs.MoECosts`'."""

    def __init__(
        self,
        cluster: Cluster,
        model: ModelConfig,
        config: CostConfig | None = None,
        profile: ProfileTable | None = None,
    ) -> None:
        if model.is_moe and profile is not None:
            raise ConfigError("a profile table measures one layer kind; plan the "
                              f"mixture-of-experts model (--num-experts {model.num_experts}) "
                              "with the analytic cost model (drop --profile)")
        self.cluster = cluster
        self.model = model
        self.config = config or CostConfig()
        self.profile = profile
        if profile is not None:
            profile.check(model, cluster.names)
        self._kinds: dict[tuple[str, int, int, int, int, bool], StageCosts] = {}
        self.layer_is_moe = tuple(model.is_moe_layer(i) for i in range(model.num_layers))
        """Per global layer: whether it is a MoE layer (``--moe-layer-freq``)."""

    # ----------------------------------------------------------------------------- primitives
    def _bandwidth(self, gb_per_s: float) -> float:
        return gb_per_s * 1e9 * self.config.comm_efficiency

    def allreduce_s(self, nbytes: float, group: int, gb_per_s: float) -> float:
        """Ring all-reduce of ``nbytes`` per chip over ``group`` chips."""
        if group <= 1:
            return 0.0
        steps = 2 * (group - 1)
        return steps * self.config.collective_latency_s + steps / group * nbytes / self._bandwidth(
            gb_per_s
        )

    def link_s(self, sender: str, receiver: str, micro_batch_size: int) -> float:
        """One pipeline point-to-point transfer (one direction, one micro-batch)."""
        nbytes = micro_batch_size * self.model.seq_length * self.model.hidden_size * BF16_BYTES
        gb_per_s = self.cluster.link_gb_per_s(sender, receiver)
        return self.config.p2p_latency_s + nbytes / self._bandwidth(gb_per_s)

    def usable_bytes(self, chip: ChipType) -> float:
        """Memory a stage may use: a fraction of the chip's memory minus a fixed reserve."""
        cfg = self.config
        return chip.memory_bytes * cfg.memory_usable_fraction - cfg.memory_reserved_gib * 2**30

    def _selective_extra(self, chip: ChipType, tp: int, mbs: int, layer_forward: float) -> float:
        """Extra backward seconds of one layer under selective recompute (no comm)."""
        profile = self.profile.for_chip(chip.name) if self.profile else None
        measured = profile.times(mbs) if profile else None
        if measured is not None and measured.selective_recompute_ms is not None:
            cpu = profile.times(mbs, cpu=True).selective_recompute_ms
            wall = measured.selective_recompute_ms
            return self._emulated(chip, wall, wall if cpu is None else cpu) / tp
        tokens = mbs * self.model.seq_length
        core_share = (
            self.model.attention_core_flops_per_token()
            * tokens
            / self.model.layer_forward_flops(tokens)
        )
        return layer_forward * core_share

    def _emulated(self, chip: ChipType, wall_ms: float, cpu_ms: float) -> float:
        """Seconds of a pass measured at ``wall_ms`` (``cpu_ms`` of CPU time) on ``chip``. The
        runtime pads a pass of a chip with ``emulate_slowdown`` ``s`` by ``s - 1`` times its CPU
        time: ``wall + (s - 1) cpu``; with ``host_cores`` the pass runs as on a core of its
        own, ``s cpu`` (the cores' sharing is the step's CPU-work bound instead)."""
        slow = chip.emulate_slowdown
        if self.cluster.host_cores is not None:
            return slow * cpu_ms / 1000.0
        return (wall_ms + (slow - 1.0) * cpu_ms) / 1000.0

    def host_cpu_s(self, plan: HeteroPlan, stages: Sequence[StageEstimate]) -> float:
        """CPU emulation (``host_cores``): the CPU seconds of one step over every rank of a
        one-pipeline ``plan``: each replica's forwards and backwards without the slowdown's
        padding, and its optimizer step."""
        total = 0.0
        for index, (spec, est) in enumerate(zip(plan.stages, stages)):
            ranks = spec.tensor_parallel_size * plan.stage_dp(index)
            passes = plan.stage_micro_batches(index) * (est.forward_s + est.backward_s)
            slow = self.cluster.chip(spec.chip).emulate_slowdown
            total += ranks * (passes / slow + est.optimizer_s)
        return total

    def _compute_times(
        self, chip: ChipType, tp: int, mbs: int
    ) -> tuple[float, float, float, float, float, float]:
        """(layer fwd, layer bwd, emb fwd, emb bwd, head fwd, head bwd) compute seconds, no comm."""
        model, tokens = self.model, mbs * self.model.seq_length
        profile = self.profile.for_chip(chip.name) if self.profile else None
        measured = profile.times(mbs) if profile else None
        slow = chip.emulate_slowdown
        if measured is not None:
            cpu = profile.times(mbs, cpu=True)
            parts = ("layer_forward_ms", "layer_backward_ms", "embedding_forward_ms",
                     "embedding_backward_ms", "head_forward_ms", "head_backward_ms")
            lf, lb, ef, eb, hf, hb = (
                self._emulated(chip, getattr(measured, part), getattr(cpu, part)) / tp
                for part in parts
            )
            return lf, lb, ef, eb, hf, hb
        efficiency = self.config.compute_efficiency
        if profile is not None and profile.efficiency is not None:
            efficiency = profile.efficiency
        rate = tp * chip.tflops_bf16 * 1e12 * efficiency / slow
        layer = model.layer_forward_flops(tokens) / rate
        head = model.head_forward_flops(tokens) / rate
        return layer, 2.0 * layer, 0.0, 0.0, head, 2.0 * head

    def stage_costs(
        self, chip_name: str, tp: int, mbs: int, dp: int, ep: int = 1, moe: bool | None = None,
        etp: int | None = None,
    ) -> StageCosts:
        """Costs of a stage kind (cached per model instance) for its dense layers (``moe``
        False) or its MoE layers (True) with expert parallelism ``ep`` and expert TP ``etp``
        (default ``tp``); ``moe`` None: the model's only layer kind, or for a model mixing both
        the cheaper of the two per term (:meth:`bound_costs`, for the search's bounds)."""
        if moe is None:
            kinds = set(self.layer_is_moe)
            if len(kinds) > 1:  # the search's bounds: experts split like the stage (ETP = TP)
                return self.bound_costs(chip_name, tp, mbs, dp, ep)
            moe = kinds.pop()
        etp = tp if etp is None or not moe else etp
        key = (chip_name, tp, mbs, dp, ep, moe) + (() if etp == tp else (etp,))
        if key not in self._kinds:
            self._kinds[key] = self._build(self.cluster.chip(chip_name), tp, mbs, dp, ep, moe,
                                           etp)
        return self._kinds[key]

    def _build(self, chip: ChipType, tp: int, mbs: int, dp: int, ep: int, moe: bool,
               etp: int | None = None) -> StageCosts:
        model, cfg = self.model, self.config
        h = model.hidden_size
        tokens = mbs * model.seq_length
        _, _, ef, eb, hf, hb = self._compute_times(chip, tp, mbs)
        etp = etp or tp
        lf, alltoall, weight_share, core_share = self._layer_terms(chip, tp, mbs, ep, moe, etp)
        lb = 2.0 * lf if moe else self._compute_times(chip, tp, mbs)[1]
        hidden_bytes = tokens * h * BF16_BYTES
        tp_ar = self.allreduce_s(hidden_bytes, tp, chip.intra_node_gb_per_s)
        fwd = lf + 2 * tp_ar + 2 * alltoall  # MoE: dispatch and combine each way
        bwd_plain = lb + 2 * tp_ar + 2 * alltoall
        selective = lf * core_share if moe else self._selective_extra(chip, tp, mbs, lf)
        backward = (bwd_plain, bwd_plain + selective, bwd_plain + fwd)
        bpp = cfg.bytes_per_param(dp)
        if moe:
            activation = tuple(model.moe_layer_activation_bytes(tokens, tp, m) for m in MODES)
            shared, experts = model.moe_layer_params_per_chip(tp, ep, etp)
            weight_inputs = model.moe_layer_weight_grad_bytes(tokens, tp)
        else:
            activation = tuple(model.layer_activation_bytes(tokens, tp, mode) for mode in MODES)
            shared, experts = model.layer_params_per_chip(tp), 0.0
            weight_inputs = model.layer_weight_grad_bytes(tokens, tp)
        expert_dp = tp * dp // (etp * ep)  # the experts' data-parallel group
        sync_group_local = chip.chips_per_node % (tp * dp) == 0
        sync_bw = self._bandwidth(
            chip.intra_node_gb_per_s if sync_group_local else chip.inter_node_gb_per_s)
        profile = self.profile.for_chip(chip.name) if self.profile else None
        optimizer = profile.optimizer_ns_per_param * 1e-9 if profile else 0.0
        if (profile and profile.optimizer_cpu_ns_per_param is not None
                and self.cluster.host_cores is not None):  # as on a core of its own
            optimizer = profile.optimizer_cpu_ns_per_param * 1e-9
        if cfg.use_distributed_optimizer:  # reduce-scatter fp32 grads + all-gather bf16 params
            optimizer /= dp  # each DP rank updates its shard only
        sync_per_param, fixed_steps = self._sync_rate(dp), 2 * (dp - 1)
        if experts:
            fixed_steps += 2 * (expert_dp - 1)
        layer_sync = (  # None for dense layers: layer_params x sync_per_param
            (shared * sync_per_param + experts * self._sync_rate(expert_dp)) / sync_bw
            if moe else None)
        return StageCosts(
            chip=chip.name,
            tensor_parallel_size=tp,
            micro_batch_size=mbs,
            data_parallel_size=dp,
            layer_forward=fwd,
            layer_backward=backward,
            embedding_forward=ef + tp_ar,
            embedding_backward=eb,
            head_forward=hf,
            head_backward=hb + tp_ar,
            layer_static=shared * bpp + experts * cfg.bytes_per_param(expert_dp),
            embedding_static=model.embedding_params_per_chip(tp) * bpp,
            head_static=model.head_params_per_chip(tp) * bpp,
            layer_activation=activation,
            head_activation=model.head_activation_bytes(tokens, tp),
            working=activation[0],
            capacity=self.usable_bytes(chip),
            layer_params=shared + experts,
            embedding_params=model.embedding_params_per_chip(tp),
            head_params=model.head_params_per_chip(tp),
            sync_per_param=sync_per_param / sync_bw,
            sync_fixed=fixed_steps * cfg.collective_latency_s,
            optimizer_per_param=optimizer,
            # the weight-gradient share of the backward: dW of the matrices (FLOP share, also
            # for measured times); TP all-reduces, all-to-alls and recompute belong to the
            # input-gradient part
            layer_weight_grad=lb * weight_share,
            embedding_weight_grad=eb,
            head_weight_grad=hb
            * model.head_weight_grad_flops(tokens)
            / (2.0 * model.head_forward_flops(tokens)),
            layer_weight_inputs=weight_inputs,
            embedding_weight_inputs=model.embedding_weight_grad_bytes(tokens),
            head_weight_inputs=model.head_weight_grad_bytes(tokens, tp),
            layer_sync=layer_sync,
        )

    def _sync_rate(self, dp: int) -> float:
        """Bytes per parameter and chip the end-of-step gradient sync moves over a DP group of
        ``dp``: reduce-scatter of fp32 gradients + all-gather of bf16 weights with the
        distributed optimizer, else an all-reduce of fp32 gradients."""
        steps = dp - 1
        if self.config.use_distributed_optimizer:
            return 6.0 * steps / dp
        return 2.0 * 4.0 * steps / dp

    # ------------------------------------------------------------------------------ whole plan
    def evaluate(self, plan: HeteroPlan) -> PlanEstimate:
        """Predict step time, memory per stage, throughput and MFU of ``plan`` (no search).

        The plan's chip names must be chip types of the cluster. The model's layer count, heads
        and query groups are checked with :meth:`HeteroPlan.validate`, the micro-batch count
        against the schedule with :func:`~megatron_h2.planner.held_activations.check_schedule`.
        """
        model = self.model
        plan.validate(model.num_layers, model.num_attention_heads, model.num_query_groups,
                      num_experts=model.num_experts)
        p, mbs = plan.pipeline_parallel_size, plan.micro_batch_size
        schedule, chunks = str(plan.schedule), plan.virtual_pipeline_size
        dps = [plan.stage_dp(s) for s in range(p)]
        counts = [plan.stage_micro_batches(s) for s in range(p)]
        for m in sorted(set(counts)):
            check_schedule(schedule, p, m, chunks)
        if not plan.uniform_dp:
            check_replica_micro_batches(schedule, dps, chunks, plan.total_micro_batches)
        warmups = replica_warmups(schedule, dps, chunks, plan.total_micro_batches)
        ranges = plan.chunk_layer_ranges()
        stages = tuple(
            self.stage_estimate(spec, index, p, m, mbs, dp, schedule, warmup, ranges[index])
            for index, (spec, m, dp, warmup) in enumerate(zip(plan.stages, counts, dps, warmups))
        )
        links = tuple(
            self.link_s(a.chip, b.chip, mbs) for a, b in zip(plan.stages, plan.stages[1:])
        )
        wrap = self.link_s(plan.stages[-1].chip, plan.stages[0].chip, mbs) if chunks > 1 else 0.0
        pipeline, link_total = step_time_terms(schedule, counts, chunks, stages, links, wrap)
        sync = max(s.dp_sync_s for s in stages)
        step = pipeline + sync + link_total
        cpu = self.host_cpu_s(plan, stages) if self.cluster.host_cores is not None else 0.0
        if cpu:
            step = max(step, cpu / self.cluster.host_cores)
        estimate = self._finish(plan, stages, links, pipeline, link_total, sync, step)
        return replace(estimate, schedule=schedule, virtual_pipeline_size=chunks, wrap_link_s=wrap,
                       host_cpu_s=cpu)

    def stage_estimate(
        self,
        spec: StageSpec,
        index: int,
        p: int,
        m: int,
        mbs: int,
        dp: int,
        schedule: str,
        warmup: int | None = None,
        chunk_ranges: Sequence[range] = (),
    ) -> StageEstimate:
        """Times per chunk, peak memory and end-of-step work of stage ``index`` of ``p``, whose
        DP replicas run ``m`` micro-batches each (with ``warmup`` warm-up forwards when not the
        schedule's own rule, :func:`replica_warmups`); ``chunk_ranges``: the global layers of
        each of its chunks (:meth:`HeteroPlan.chunk_layer_ranges`), which set the dense and
        MoE layers' shares (needed when the model has both)."""
        tp, ep = spec.tensor_parallel_size, self.stage_expert_parallel(spec, dp)
        etp = self.stage_expert_tp(spec)
        if chunk_ranges:
            per_chunk = tuple(self.stage_layer_costs(spec.chip, tp, mbs, dp, ep, r, etp)
                              for r in chunk_ranges)
            whole = self.stage_layer_costs(
                spec.chip, tp, mbs, dp, ep, [i for r in chunk_ranges for i in r], etp)
        elif len(set(self.layer_is_moe)) > 1:
            raise ConfigError("a stage of a model with dense and MoE layers needs its layer "
                              "range (chunk_ranges)")
        else:
            whole = self.stage_costs(spec.chip, tp, mbs, dp, ep, etp=etp)
            per_chunk = (whole,) * len(spec.chunks)
        costs = whole
        first, last, mode = index == 0, index == p - 1, MODES.index(spec.recompute)
        chunks = spec.chunks
        v = len(chunks)
        times = [
            part.chunk_times(n, mode, first and c == 0, last and c == v - 1)
            for c, (n, part) in enumerate(zip(chunks, per_chunk))
        ]
        states = held_states(schedule, p, m, v, index, warmup)
        optimizer = costs.optimizer_step(spec.num_layers, first, last)
        return StageEstimate(
            chip=spec.chip,
            tensor_parallel_size=spec.tensor_parallel_size,
            num_layers=spec.num_layers,
            recompute=spec.recompute,
            forward_s=sum(t[0] for t in times),
            backward_s=sum(t[1] for t in times),
            in_flight=max(sum(active) for active, _ in states),
            memory_bytes=costs.held_memory(chunks, mode, states, first, last, per_chunk),
            capacity_bytes=costs.capacity,
            dp_sync_s=costs.dp_sync(spec.num_layers, first, last) + optimizer,
            optimizer_s=optimizer,
            chunk_layers=chunks,
            chunk_forward_s=tuple(t[0] for t in times),
            chunk_backward_s=tuple(t[1] for t in times),
            chunk_weight_s=tuple(t[2] for t in times),
            deferred=max(sum(deferred) for _, deferred in states),
        )

    def _finish(
        self,
        plan: HeteroPlan,
        stages: tuple[StageEstimate, ...],
        links: tuple[float, ...],
        pipeline: float,
        link_total: float,
        sync: float,
        step: float,
    ) -> PlanEstimate:
        used: dict[str, int] = {}
        for index, spec in enumerate(plan.stages):
            chips = spec.tensor_parallel_size * plan.stage_dp(index)
            used[spec.chip] = used.get(spec.chip, 0) + chips
        tokens = plan.global_batch_size * self.model.seq_length
        peak = sum(
            count
            * self.cluster.chip(name).tflops_bf16
            * 1e12
            / self.cluster.chip(name).emulate_slowdown
            for name, count in used.items()
        )
        mfu = tokens * self.model.flops_per_token(causal=True) / step / peak
        return PlanEstimate(
            step_time_s=step,
            pipeline_s=pipeline,
            link_s=link_total,
            dp_sync_s=sync,
            num_micro_batches=plan.stage_micro_batches(0),
            stage_micro_batches=tuple(plan.stage_micro_batches(s) for s in range(len(stages))),
            stages=stages,
            link_times_s=links,
            tokens_per_s=tokens / step,
            mfu=mfu,
            chips_used=used,
        )

    def fastest_fitting_mode(
        self, costs: StageCosts, layers: int, in_flight: int, first: bool, last: bool
    ) -> Recompute | None:
        """The fastest recompute mode under which the stage fits in memory, or None."""
        for index, mode in enumerate(MODES):
            if costs.memory(layers, index, in_flight, first, last) <= costs.capacity:
                return mode
        return None
