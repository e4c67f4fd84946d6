"""One training / evaluation step on this rank: micro-batches through the pipeline schedule,
data-parallel gradient sync, global gradient norm and clipping, optimizer update.

The global batch is cut into micro-batches ``0 .. M - 1`` (micro-batch ``j`` = samples
``j x mbs .. (j + 1) x mbs - 1`` of the batch); replica ``r`` of a stage with DP degree ``DP_s``
runs those with ``j mod DP_s == r`` (:func:`~megatron_h2.plan.orders.replica_order`), so
stages may have different DP degrees. Each micro-batch's loss is divided by the token count of
the whole global batch, so gradients are summed, never averaged, over each stage's replicas.

Everything that spans ranks (loss, gradient norm, stop requests) is reduced over the whole job,
so every rank sees the same numbers; with one process all of it reduces to the plain loop.

Data-parallel pipelines (a plan of several): each pipeline runs its share of the global batch
(its micro-batches numbered from 0, its samples from its first position in the batch, see
:meth:`~megatron_h2.plan.schema.HeteroPlan.pipeline_samples`) with its own schedule; after its
DP sync, :class:`~megatron_h2.distributed.pipeline_sum.PipelineGradSum` sums the gradients
across the pipelines (its sends start during the last backward), so every pipeline applies the
same update. The gradient norm counts pipeline 0's gradients.

With ``--bf16`` / ``--fp16`` the model's weights, activations and pipeline traffic are in that
dtype (no autocast, as Megatron); the optimizer keeps fp32 main weights. With a loss scaler
(``--fp16``, ``--loss-scale``) the backward starts from the scaled loss, a step whose gradients
overflow is skipped (the scaler backs off) and the others are unscaled before clipping.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_h2.config import RunConfig
from megatron_h2.devices import Accelerator
from megatron_h2.devices.op_replay import DTYPES
from megatron_h2.distributed.bridge import BridgeConfig
from megatron_h2.distributed.p2p import PipeComm
from megatron_h2.distributed.pipeline_sum import PipelineGradSum
from megatron_h2.distributed.shard_boxes import ParamLayout
from megatron_h2.distributed.tied_embedding import tied_embedding_sync
from megatron_h2.distributed.topology import Topology
from megatron_h2.errors import TrainingError
from megatron_h2.models.gpt import GPTModel
from megatron_h2.models.gpt.gpt_model import TIED_COPY_ATTR, full_shape, param_tp
from megatron_h2.monitoring.stage_clock import StageClock, stage_report
from megatron_h2.monitoring.timeline import Timeline
from megatron_h2.monitoring.timers import Timers, report_timers
from megatron_h2.optimizer.distributed_optimizer import DataParallelOptimizer
from megatron_h2.optimizer.expert_optimizer import is_expert_param
from megatron_h2.optimizer.grad_scaler import build_grad_scaler
from megatron_h2.parallel import TPContext, allreduce_coalesced_, get_tp_shard
from megatron_h2.pipeline.schedule_runner import StageChunks, forward_only, run_schedule
from megatron_h2.plan.orders import replica_micro_batches, replica_order
from megatron_h2.training.moe_step import (
    MoEMetrics,
    set_aux_loss_scale,
    step_metrics,
    update_expert_bias,
)


def stack_samples(dataset, start: int, count: int) -> torch.Tensor:
    """Samples ``start .. start+count-1`` as one int64 tensor [count, s + 1]."""
    return torch.from_numpy(np.stack([np.asarray(dataset[start + i], dtype=np.int64)
                                      for i in range(count)]))


def world_sum(values: list[float], topo: Topology) -> list[float]:
    """Sum of ``values`` over every rank of the job (identity with one process)."""
    if not topo.distributed:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=topo.cpu_group)
    return t.tolist()


def param_layouts(model: GPTModel, tp: TPContext) -> dict[torch.nn.Parameter, ParamLayout]:
    """How each parameter of this stage lies in the model's full tensor, for the gradient sum
    across data-parallel pipelines (a TP-replicated parameter is primary on TP rank 0 only, the
    last stage's tied copy never: the first stage holds the same gradient)."""
    aliases: dict[str, str] = getattr(model, "checkpoint_names", {})
    out = {}
    for name, param in model.named_parameters():
        spec = get_tp_shard(param)
        copy = getattr(param, TIED_COPY_ATTR, False) or (spec is None and tp.rank != 0)
        out[param] = ParamLayout(aliases.get(name, name), full_shape(param, tp),
                                 None if spec is None else spec.dim,
                                 1 if spec is None else spec.blocks, primary=not copy)
    return out


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    global_batch_size: int = 0
    skipped: bool = False  # no update was applied (the judge rejected it, or an overflow)
    overflow: bool = False  # skipped by loss scaling: the scaled gradients overflowed
    loss_scale: float | None = None  # the loss scale this step ran with (None: no scaling)
    num_zeros: int | None = None  # zeros in the applied gradient (--log-num-zeros-in-grad)
    moe: MoEMetrics | None = None  # aux losses and tokens per expert of a MoE model


@dataclass
class WindowReport:
    """A log window's figures beyond the loss: each stage's compute, bubble and bridge traffic
    (None with one stage), Megatron's timer lines and each timer's maximum over ranks (ms per
    iteration)."""

    stages: str | None
    timer_lines: list[str]
    timer_max: dict[str, float]


Judge = Callable[[int, float, float], bool]
"""``judge(iteration, loss, grad_norm)``: True to update, False to skip; raises to stop."""


class StepRunner:
    """Runs steps of one rank's stage model; built once per run."""

    def __init__(self, cfg: RunConfig, acc: Accelerator, topo: Topology, tp: TPContext,
                 model: GPTModel, optimizer: DataParallelOptimizer,
                 timeline: Timeline | None = None, eod_mask: int | None = None) -> None:
        """``eod_mask``: the token whose positions carry no loss (``--eod-mask-loss``)."""
        self.cfg, self.acc, self.topo, self.tp = cfg, acc, topo, tp
        self.eod_mask = eod_mask
        self.model, self.optimizer = model, optimizer
        t, m, par = cfg.training, cfg.model, cfg.parallel
        self.stage_dps = tuple(topo.plan.stage_dp(s) for s in range(topo.pp_size))
        self.timeline = timeline if timeline is not None and timeline.recording else None
        self.timers = Timers(cfg.logging.timing_log_level, acc)
        self.clock = StageClock(acc, topo.chip.emulate_slowdown, self.timeline,
                                synchronize=self.timers.active(2))
        self.dtype = DTYPES[t.precision.params]  # weights, activations, pipeline traffic
        self.scaler = build_grad_scaler(t, par.use_distributed_optimizer)
        bridge = BridgeConfig(force=par.force_bridge, chunk_mb=par.bridge_chunk_mb,
                              dtype=torch.bfloat16 if par.bridge_dtype == "bf16" else None,
                              timeout_s=par.distributed_timeout_minutes * 60)
        self.comm = PipeComm(topo, t.micro_batch_size, m.seq_length, m.hidden_size,
                             par.sequence_parallel, self.dtype, acc.device, bridge,
                             topo.cpu_group, observer=self.timeline)
        # the stage's model chunks (virtual pipeline stages): parameters of each, and whether
        # zero-bubble may split its backward (not for layers recomputed in full)
        chunks = model.num_chunks
        self.chunks = StageChunks(topo.stage, topo.pp_size,
                                  [model.chunk_parameters(c) for c in range(chunks)],
                                  [topo.stage_spec.recompute != "full"] * chunks)
        self.sp_params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
        # Norm weights: a parameter replicated over TP (a routed expert's over its expert-TP
        # group) counts once in the global norm, the last stage's copy of a tied embedding not
        # at all (the first stage counts it); each TP / ETP shard is a parameter of its own.
        self.norm_weight = {p: (0.0 if getattr(p, TIED_COPY_ATTR, False)
                                else 1.0 if get_tp_shard(p) is not None
                                else 1.0 / param_tp(model, p).size)
                            for p in model.parameters()}
        if not optimizer.sharded and topo.edp_size != topo.dp_size:
            # a replicated expert gradient is on edp_size ranks, not dp_size: the sums below
            # divide by dp_size
            for p in model.parameters():
                if is_expert_param(p):
                    self.norm_weight[p] *= topo.dp_size / topo.edp_size
        self.tied = tied_embedding_sync(topo, model.tied_embedding_weight(), m.vocab_size)
        self.needs_data = topo.is_first_stage or topo.is_last_stage
        job = topo.job_plan or topo.plan  # per-stage figures where some pipeline has stages
        self.report_stages = any(p.pipeline_parallel_size > 1 for p in job.pipeline_plans)
        # data-parallel pipelines: gradients summed across them, the norm counted on pipeline 0
        self.pipeline_sum = None
        self.counts = 1.0 if topo.pipeline == 0 else 0.0
        if topo.num_pipelines > 1:  # (two optimizers under expert parallelism, dense first)
            parts = getattr(optimizer, "parts", (optimizer,))
            self.pipeline_sum = PipelineGradSum(
                topo, optimizer.grad_buckets, param_layouts(model, tp), self.sp_params,
                lambda: [g for part in parts for g in part.grads.refresh()], bridge, acc.device)
            self.pipeline_sum.attach()

    @property
    def loss_scale(self) -> float | None:
        """The loss scale the next step runs with (None: the loss is not scaled)."""
        return None if self.scaler is None else self.scaler.scale

    def grad_scaler_state(self) -> dict | None:
        """The loss scaler's state for a checkpoint (None without a scaler)."""
        return None if self.scaler is None else self.scaler.state_dict()

    def load_grad_scaler_state(self, state: dict | None) -> None:
        """Continue a checkpoint's loss scaling (nothing without a scaler or a saved state)."""
        if state is not None and self.scaler is not None:
            self.scaler.load_state_dict(state)

    def window_report(self, elapsed: float, iterations: int, timing_log_option: str
                      ) -> WindowReport:
        """The figures of the ``iterations`` steps since the last report, which took
        ``elapsed`` seconds; resets the counters. Collective: every rank reports at the same
        iterations."""
        compute, comm = self.clock.take(), self.comm.stats()
        self.comm.reset_stats()
        if self.pipeline_sum is not None:  # gradients sent to the other pipelines
            comm["pipelines_bytes"] = float(self.pipeline_sum.stats.bytes)
            self.pipeline_sum.stats.reset()
        stages = (stage_report(self.topo, compute, elapsed, comm, iterations)
                  if self.report_stages else None)
        kinds = self.clock.take_kinds()
        self.timers.add("forward-compute", 2, kinds.get("forward", 0.0))
        self.timers.add("backward-compute", 2, sum(v for k, v in kinds.items()
                                                   if k.startswith("backward")))
        if self.topo.pp_size > 1:
            self.timers.add("pipeline-send-wait", 2, comm.get("send_wait_s", 0.0))
            self.timers.add("pipeline-recv-wait", 2, comm.get("recv_wait_s", 0.0))
        lines, maxima = report_timers(self.timers.take(), self.topo, timing_log_option,
                                      iterations)
        return WindowReport(stages, lines, maxima)

    def _pipeline_micro_batches(self, global_batch_size: int) -> int:
        """Micro-batches of a global batch that this rank's pipeline runs (all of them with one
        pipeline; with several, its share, which the launch checks keep fixed)."""
        job = self.topo.job_plan
        if job is not None and job.num_pipelines > 1:
            if global_batch_size != job.global_batch_size:
                raise TrainingError(f"global batch {global_batch_size} differs from the plan's "
                                    f"{job.global_batch_size}, which its pipelines share")
            global_batch_size = self.topo.plan.global_batch_size
        return global_batch_size // self.cfg.training.micro_batch_size

    def _micro_batches(self, global_batch_size: int) -> list[int]:
        """This replica's micro-batches of a global batch (numbered within its pipeline), in
        the order its schedule takes them."""
        total = self._pipeline_micro_batches(global_batch_size)
        return replica_micro_batches(total, self.stage_dps, self.topo.stage, self.topo.dp_rank,
                                     self.chunks.chunks)

    def _replica_samples(self, dataset, start: int, micro_batches: list[int]
                         ) -> dict[int, torch.Tensor] | None:
        """``{j: samples [mbs, s + 1] of micro-batch j}`` for this replica's micro-batches of
        the global batch that starts at sample ``start`` (None on stages that read no data);
        a pipeline's micro-batches start at its first sample of the batch."""
        if not self.needs_data:
            return None
        mbs = self.cfg.training.micro_batch_size
        assert self.topo.job_plan is not None
        start += self.topo.job_plan.pipeline_samples(self.topo.pipeline).start
        return {j: stack_samples(dataset, start + j * mbs, mbs) for j in micro_batches}

    def _loss_divisor(self, samples: dict[int, torch.Tensor] | None, global_batch_size: int
                      ) -> float | None:
        """What each micro-batch's summed token loss is divided by: the tokens counted in the
        loss over the whole global batch, or None where each micro-batch averages over its own
        counted tokens first (Megatron without --calculate-per-token-loss). The two agree
        unless --eod-mask-loss leaves micro-batches with different counts."""
        if self.eod_mask is None:
            return float(global_batch_size * self.cfg.model.seq_length)
        if not self.cfg.training.calculate_per_token_loss:
            return None
        mine = 0.0
        if samples is not None and self.topo.is_last_stage and self.tp.rank == 0:
            mine = float(sum(int((mb[:, :-1] != self.eod_mask).sum())
                             for mb in samples.values()))
        return world_sum([mine], self.topo)[0]  # collective: every rank asks

    def _forward_step(self, samples: dict[int, torch.Tensor] | None, sums: list[tuple],
                      global_batch: int, divisor: float | None, loss_scale: float | None = None):
        """The schedule's forward of one (chunk, micro-batch): the activation for the next
        stage, or on the last chunk the micro-batch's share of the loss that backward starts
        from (times ``loss_scale`` where the loss is scaled)."""
        micro_batches = global_batch // self.cfg.training.micro_batch_size  # all replicas'

        def step(chunk: int, j: int, inp: torch.Tensor | None) -> torch.Tensor:
            first, last = self.chunks.first(chunk), self.chunks.last(chunk)
            tokens = labels = None
            if samples is not None and (first or last):
                mb = samples[j].to(self.acc.device, non_blocking=True)
                tokens, labels = mb[:, :-1], mb[:, 1:]  # [b, s] each
            out = self.model(tokens=tokens if first else None, hidden_states=inp,
                             labels=labels if last else None, chunk=chunk)
            if not last:
                return out  # [b, s, h] activation for the next virtual stage
            if self.eod_mask is None:  # out: [b, s] per-token losses
                total, count = out.sum(), out.numel()
            else:
                mask = (tokens != self.eod_mask).to(out.dtype)  # no loss where the input is eod
                total, count = (out * mask).sum(), mask.sum()
            sums.append((total.detach(), count))
            if divisor is not None:  # share of the global batch's per-token mean loss
                share = total / divisor
            else:
                share = total / torch.clamp(count, min=1.0) / micro_batches
            return share if loss_scale is None else share * loss_scale

        return step

    def _reported_loss(self, sums: list[tuple]) -> float:
        """Mean loss per counted token of the global batch, as Megatron reports it (summed over
        the last stage's DP replicas, counted once per TP group)."""
        mine = [0.0, 0.0]
        if sums and self.tp.rank == 0:
            mine = [float(sum(float(total) for total, _ in sums)),
                    float(sum(float(count) for _, count in sums))]
        total, count = world_sum(mine, self.topo)
        return total / max(count, 1.0)

    def _reduce_sequence_parallel_grads(self) -> None:
        """Sum over TP the grads of parameters that saw only s/t positions (the norms).

        Runs after the DP sync: sums commute, and under ZeRO-1 every TP rank of a stage has the
        same bucket layout, so the DP-reduced shard pieces can be summed over TP directly.
        Every TP rank joins the collective, even one that owns no such piece.
        """
        if not self.sp_params:
            return
        allreduce_coalesced_([g for p, g in self.optimizer.owned_grads()
                              if getattr(p, "sequence_parallel", False)], self.tp)

    def _grad_norm(self) -> float:
        """L2 norm of the global gradient over every stage, TP shard and (ZeRO) DP shard."""
        local = sum(self.norm_weight[p] * float(g.double().square().sum())
                    for p, g in self.optimizer.owned_grads())
        # replicated optimizers hold the same full gradient on every DP rank of a stage (whose
        # DP degree is its own): count it once; every pipeline holds it: count pipeline 0's
        replicas = 1 if self.optimizer.sharded else self.topo.dp_size
        return math.sqrt(world_sum([self.counts * local / replicas], self.topo)[0])

    def train_step(self, dataset, start: int, iteration: int, lr: float,
                   global_batch_size: int | None = None,
                   judge: Judge | None = None) -> StepResult:
        """Forward and backward of one global batch starting at sample ``start``, then update
        unless ``judge`` rejects the step (without a judge, a non-finite loss or gradient norm
        raises TrainingError).

        The caller has set each parameter group's learning rate (``lr`` is the one reported);
        ``global_batch_size`` (default ``--global-batch-size``) may change between steps under
        a batch-size schedule, and with it the number of micro-batches.
        """
        batch = global_batch_size or self.cfg.training.global_batch_size
        self.model.train()
        self.optimizer.zero_grad()
        losses: list[tuple] = []
        samples = self._replica_samples(dataset, start, self._micro_batches(batch))
        if self.timeline is not None:
            self.timeline.set_iteration(iteration)
        divisor = self._loss_divisor(samples, batch)
        order = replica_order(self.topo.plan.schedule, self.stage_dps, self.topo.stage,
                              self.topo.dp_rank, self.chunks.chunks,
                              self._pipeline_micro_batches(batch))
        buckets = self.optimizer.grad_buckets
        scale = None if self.scaler is None else self.scaler.scale
        set_aux_loss_scale(self.model, batch // self.cfg.training.micro_batch_size, scale)
        self.timers.start("forward-backward", 1)
        run_schedule(order, self._forward_step(samples, losses, batch, divisor, scale), self.comm,
                     self.chunks,
                     before_last_grads=lambda c: buckets.start_sync(self.chunks.params[c]),
                     observer=self.clock)
        self.comm.wait_sends()
        self.timers.stop("forward-backward")
        self.timers.start("all-grads-sync", 1)
        # the tied weight's bucket is summed over DP last, then across first and last stage
        buckets.finish_sync(combine=None if self.tied is None else self.tied.sum_grads)
        self._reduce_sequence_parallel_grads()
        if self.pipeline_sum is not None:
            self.pipeline_sum.finish()
        self.timers.stop("all-grads-sync")
        update_expert_bias(self.model, self.cfg.model, self.topo, self.tp)
        moe = step_metrics(self.model, self.cfg.model, self.topo, self.tp,
                           batch // self.cfg.training.micro_batch_size)
        grad_norm = self._grad_norm()
        loss = self._reported_loss(losses)
        if scale is not None:
            # the same verdict on every rank; as Megatron, an Inf is the scaler's business, a
            # NaN the health check's while --check-for-nan-in-loss-and-grad is on
            overflow = not math.isfinite(grad_norm)
            self.scaler.update(overflow)
            nan_checked = math.isnan(grad_norm) and self.cfg.training.check_for_nan_in_loss_and_grad
            if overflow and not nan_checked:
                return StepResult(loss=loss, grad_norm=grad_norm, lr=lr, global_batch_size=batch,
                                  skipped=True, overflow=True, loss_scale=scale, moe=moe)
            if not overflow:  # unscale: the norm, then the gradients the optimizer applies
                grad_norm /= scale
                self.optimizer.clip_(1.0 / scale)
        if judge is not None:
            if not judge(iteration, loss, grad_norm):
                return StepResult(loss=loss, grad_norm=grad_norm, lr=lr,
                                  global_batch_size=batch, skipped=True, loss_scale=scale, moe=moe)
        elif not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise TrainingError(f"loss {loss} / grad norm {grad_norm} is not finite at "
                                f"iteration {iteration}; lower --lr or resume from the last "
                                "checkpoint")
        self.timers.start("optimizer", 1)
        clip = self.cfg.optimizer.clip_grad
        if clip > 0:
            self.optimizer.clip_(min(1.0, clip / (grad_norm + 1e-6)))
        zeros = self._num_zeros() if self.cfg.logging.log_num_zeros_in_grad else None
        self.optimizer.step()
        self.timers.stop("optimizer")
        return StepResult(loss=loss, grad_norm=grad_norm, lr=lr, global_batch_size=batch,
                          loss_scale=scale, num_zeros=zeros, moe=moe)

    def _num_zeros(self) -> int:
        """Zero elements of the gradient every rank applies, counted once over the job: a
        TP-replicated parameter on one TP rank, a tied copy not at all, each DP replica's full
        gradient once (ZeRO: the shards add up; each stage has its own DP degree)."""
        local = sum(float((g == 0).sum()) * self.norm_weight[p]
                    for p, g in self.optimizer.owned_grads())
        replicas = 1 if self.optimizer.sharded else self.topo.dp_size
        return round(world_sum([self.counts * local / replicas], self.topo)[0])

    def params_norm(self) -> float:
        """L2 norm of all parameters of the model (each counted once over stages, TP shards and
        DP replicas); collective. As Megatron, the fp32 main weights where the optimizer keeps
        them (--bf16 / --fp16), else the parameters. Waits for parameters still being
        gathered."""
        self.optimizer.finish_param_sync()
        local = sum(self.norm_weight[p] * float(w.double().square().sum())
                    for p, w in self.optimizer.owned_main_weights())
        replicas = 1 if self.optimizer.sharded else self.topo.dp_size
        return math.sqrt(world_sum([self.counts * local / replicas], self.topo)[0])

    @torch.no_grad()
    def eval_loss(self, dataset, num_batches: int) -> float:
        """Mean loss over the first ``num_batches`` global batches of ``dataset``."""
        self.model.eval()
        total = 0.0
        for b in range(num_batches):
            losses: list[tuple] = []
            batch = self.cfg.training.global_batch_size
            micro_batches = self._micro_batches(batch)
            samples = self._replica_samples(dataset, b * batch, micro_batches)
            step = self._forward_step(samples, losses, batch, self._loss_divisor(samples, batch))
            forward_only(step, micro_batches, self.comm, self.chunks)
            self.comm.wait_sends()
            total += self._reported_loss(losses)
        self.model.train()
        return total / num_batches
