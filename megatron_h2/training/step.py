"""One training / evaluation step on this rank: micro-batches through the pipeline schedule,
data-parallel gradient sync, global gradient norm and clipping, optimizer update.

Everything that spans ranks (loss, gradient norm, stop requests) is reduced over the whole job,
so every rank sees the same numbers; with one process all of it reduces to the plain loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megatron_h2.config import RunConfig
from megatron_h2.devices import Accelerator
from megatron_h2.distributed.bridge import BridgeConfig
from megatron_h2.distributed.p2p import PipeComm
from megatron_h2.distributed.topology import Topology
from megatron_h2.errors import TrainingError
from megatron_h2.models.gpt import GPTModel
from megatron_h2.optimizer.distributed_optimizer import DataParallelOptimizer
from megatron_h2.parallel import TPContext, allreduce_coalesced_, get_tp_shard
from megatron_h2.pipeline.orders import schedule_order
from megatron_h2.pipeline.schedules import StageChunks, forward_only, run_schedule
from megatron_h2.training.stage_clock import StageClock
from megatron_h2.training.timeline import Timeline


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


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float


class StepRunner:
    """Runs steps of one rank's stage model; built once per run."""

    def __init__(self, cfg: RunConfig, acc: Accelerator, topo: Topology, tp: TPContext,
                 model: GPTModel, optimizer: DataParallelOptimizer,
                 timeline: Timeline | None = None) -> None:
        self.cfg, self.acc, self.topo, self.tp = cfg, acc, topo, tp
        self.model, self.optimizer = model, optimizer
        t, m, par = cfg.training, cfg.model, cfg.parallel
        self.per_replica = t.global_batch_size // topo.dp_size
        self.num_micro = self.per_replica // t.micro_batch_size
        self.timeline = timeline if timeline is not None and timeline.recording else None
        self.clock = StageClock(acc, topo.chip.emulate_slowdown, self.timeline)
        bridge = BridgeConfig(force=par.force_bridge, chunk_mb=par.bridge_chunk_mb,
                              dtype=torch.bfloat16 if par.bridge_dtype == "bf16" else None)
        self.comm = PipeComm(topo, t.micro_batch_size, m.seq_length, m.hidden_size,
                             par.sequence_parallel, torch.float32, acc.device, bridge,
                             topo.cpu_group, observer=self.timeline)
        # the stage's model chunks (virtual pipeline stages): parameters of each, and whether
        # zero-bubble may split its backward (not for layers recomputed in full)
        chunks = model.num_chunks
        self.chunks = StageChunks(topo.stage, topo.pp_size,
                                  [model.chunk_parameters(c) for c in range(chunks)],
                                  [topo.stage_spec.recompute != "full"] * chunks)
        self.sp_params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
        # Norm weights: a parameter replicated over TP counts once in the global norm.
        self.norm_weight = {p: (1.0 if get_tp_shard(p) is not None else 1.0 / tp.size)
                            for p in model.parameters()}
        self.needs_data = topo.is_first_stage or topo.is_last_stage

    def _replica_samples(self, dataset, start: int) -> torch.Tensor | None:
        """This DP replica's slice of the global batch that starts at sample ``start``."""
        if not self.needs_data:
            return None
        first = start + self.topo.dp_rank * self.per_replica
        return stack_samples(dataset, first, self.per_replica)

    def _forward_step(self, samples: torch.Tensor | None, losses: list[torch.Tensor]):
        mbs = self.cfg.training.micro_batch_size
        total_tokens = self.cfg.training.global_batch_size * self.cfg.model.seq_length

        def step(chunk: int, i: int, inp: torch.Tensor | None) -> torch.Tensor:
            first, last = self.chunks.first(chunk), self.chunks.last(chunk)
            tokens = labels = None
            if samples is not None and (first or last):
                mb = samples[i * mbs:(i + 1) * mbs].to(self.acc.device, non_blocking=True)
                tokens, labels = mb[:, :-1], mb[:, 1:]  # [b, s] each
            with self.acc.autocast(self.cfg.training.bf16):
                out = self.model(tokens=tokens if first else None, hidden_states=inp,
                                 labels=labels if last else None, chunk=chunk)
            if not last:
                return out  # [b, s, h] activation for the next virtual stage
            loss = out.sum() / total_tokens  # share of the global batch's mean loss
            losses.append(loss.detach())
            return loss

        return step

    def _reported_loss(self, losses: list[torch.Tensor]) -> float:
        """Mean per-token loss of the global batch (summed over DP replicas, counted once per
        TP group on the last stage)."""
        mine = float(sum(l.item() for l in losses)) if losses and self.tp.rank == 0 else 0.0
        return world_sum([mine], self.topo)[0]

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
        # replicated optimizers hold the same full gradient on every DP rank: count it once
        replicas = 1 if self.optimizer.sharded else self.topo.dp_size
        return math.sqrt(world_sum([local], self.topo)[0] / replicas)

    def train_step(self, dataset, start: int, iteration: int, lr: float) -> StepResult:
        """Forward and backward of one global batch starting at sample ``start``, then update."""
        self.model.train()
        self.optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        samples = self._replica_samples(dataset, start)
        if self.timeline is not None:
            self.timeline.set_iteration(iteration)
        plan = self.topo.plan
        order = schedule_order(plan.schedule, self.topo.stage, self.topo.pp_size,
                               self.chunks.chunks, range(self.num_micro))
        buckets = self.optimizer.grad_buckets
        run_schedule(order, self._forward_step(samples, losses), self.comm, self.chunks,
                     before_last_grads=lambda c: buckets.start_sync(self.chunks.params[c]),
                     observer=self.clock)
        self.comm.wait_sends()
        self.optimizer.grad_buckets.finish_sync()
        self._reduce_sequence_parallel_grads()
        grad_norm = self._grad_norm()
        loss = self._reported_loss(losses)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise TrainingError(f"loss {loss} / grad norm {grad_norm} is not finite at "
                                f"iteration {iteration}; lower --lr or resume from the last "
                                "checkpoint")
        clip = self.cfg.optimizer.clip_grad
        if clip > 0:
            self.optimizer.clip_(min(1.0, clip / (grad_norm + 1e-6)))
        self.optimizer.set_lr(lr)
        self.optimizer.step()
        return StepResult(loss=loss, grad_norm=grad_norm, lr=lr)

    @torch.no_grad()
    def eval_loss(self, dataset, num_batches: int) -> float:
        """Mean loss over the first ``num_batches`` global batches of ``dataset``."""
        self.model.eval()
        total = 0.0
        for b in range(num_batches):
            losses: list[torch.Tensor] = []
            samples = self._replica_samples(dataset, b * self.cfg.training.global_batch_size)
            forward_only(self._forward_step(samples, losses), range(self.num_micro), self.comm,
                         self.chunks)
            self.comm.wait_sends()
            total += self._reported_loss(losses)
        self.model.train()
        return total / num_batches
