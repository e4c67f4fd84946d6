"""The optimizer of a stage with expert parallelism: dense parameters over the data-parallel
group, the routed experts' over the expert-data-parallel group (Megatron-Core's two gradient
buffers), ZeRO-1 over each where ``--use-distributed-optimizer`` is on.

:func:`build_stage_optimizer` builds one :class:`DataParallelOptimizer` where the two groups
hold the same ranks (no expert parallelism: every parameter over the DP group, as before), and
otherwise an :class:`ExpertSplitOptimizer` of two, one per group, that the step drives as one.
Gradients are summed over either group (the loss is already scaled per global batch), so an
expert's gradient sums every token routed to it over the whole stage, as in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatron_h2.config import OptimizerConfig
from megatron_h2.distributed.grad_sync import Bucket
from megatron_h2.distributed.topology import EXPERT_PARALLEL_ATTR
from megatron_h2.optimizer.distributed_optimizer import (
    DataParallelOptimizer,
    Names,
    build_data_parallel_optimizer,
)


def is_expert_param(param: nn.Parameter) -> bool:
    """Whether ``param`` belongs to a MoE layer's routed experts (reduced over expert DP)."""
    return bool(getattr(param, EXPERT_PARALLEL_ATTR, False))


class _BucketsPair:
    """The two optimizers' gradient buckets as the step uses them: armed, synced and zeroed
    together (the dense buckets first, on every rank in the same order)."""

    def __init__(self, dense, expert) -> None:
        self.parts = (dense, expert)

    @property
    def buckets(self) -> list[Bucket]:
        return [b for part in self.parts for b in part.buckets]

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.params]

    @property
    def needs_sync(self) -> bool:
        return any(part.needs_sync for part in self.parts)

    def start_sync(self, params: Sequence[nn.Parameter] | None = None) -> None:
        for part in self.parts:
            part.start_sync(params)

    def finish_sync(self, combine: Callable[[], None] | None = None) -> None:
        dense, expert = self.parts
        dense.finish_sync(combine)  # the tied embedding (combine's business) is dense
        expert.finish_sync()

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()


class ExpertSplitOptimizer:
    """:class:`DataParallelOptimizer` of two: ``dense`` (DP group) and ``expert`` (the routed
    experts, expert-DP group), both replicated or both ZeRO-1."""

    def __init__(self, dense: DataParallelOptimizer, expert: DataParallelOptimizer) -> None:
        if dense.sharded != expert.sharded:
            raise ValueError("ExpertSplitOptimizer: both parts replicated or both sharded")
        self.parts = (dense, expert)
        self.grad_buckets = _BucketsPair(dense.grad_buckets, expert.grad_buckets)
        self.sharded = dense.sharded

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def set_lr(self, lr: float) -> None:
        for part in self.parts:
            part.set_lr(lr)

    def owned_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [item for part in self.parts for item in part.owned_grads()]

    def owned_main_weights(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [item for part in self.parts for item in part.owned_main_weights()]

    def local_grad_sq_norm(self) -> torch.Tensor:
        return sum((part.local_grad_sq_norm() for part in self.parts), torch.zeros(()))

    def grad_sq_norm(self) -> torch.Tensor:
        raise NotImplementedError("under expert parallelism the gradient norm weighs the two "
                                  "groups' replicas differently: the step computes it from "
                                  "owned_grads()")

    def clip_(self, coef: float | torch.Tensor) -> None:
        for part in self.parts:
            part.clip_(coef)

    def named_state(self, names: Names) -> dict[str, torch.Tensor]:
        return {k: v for part in self.parts for k, v in part.named_state(names).items()}

    def load_named_state(self, names: Names, tensors: dict[str, torch.Tensor]) -> None:
        for part in self.parts:
            part.load_named_state(names, tensors)

    def main_weights(self) -> dict[nn.Parameter, torch.Tensor]:
        return {p: w for part in self.parts for p, w in part.main_weights().items()}

    def load_main_weights(self, values: dict[nn.Parameter, torch.Tensor]) -> None:
        for part in self.parts:
            mine = {id(p) for p in part.grad_buckets.params}
            part.load_main_weights({p: v for p, v in values.items() if id(p) in mine})

    def finish_param_sync(self) -> None:
        for part in self.parts:
            part.finish_param_sync()


def build_stage_optimizer(model: nn.Module, config: OptimizerConfig,
                          dp_group: dist.ProcessGroup | None, dp_ranks: list[int],
                          edp_group: dist.ProcessGroup | None, edp_ranks: list[int],
                          **kwargs) -> DataParallelOptimizer:
    """The stage's optimizer (``kwargs``: those of :func:`build_data_parallel_optimizer`): one
    over the DP group where the expert-DP group holds the same ranks, else an
    :class:`ExpertSplitOptimizer` (the dense part keeps ``deferred``, the tied embedding)."""
    if list(dp_ranks) == list(edp_ranks):
        return build_data_parallel_optimizer(model, config, dp_group, **kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    dense = build_data_parallel_optimizer(
        model, config, dp_group, params=[p for p in params if not is_expert_param(p)], **kwargs)
    kwargs["deferred"] = []
    expert = build_data_parallel_optimizer(
        model, config, edp_group, params=[p for p in params if is_expert_param(p)], **kwargs)
    return ExpertSplitOptimizer(dense, expert)
