"""Optimizers: AdamW with Megatron's parameter groups, the data-parallel optimizers (replicated
and ZeRO-1 distributed) and the learning-rate schedule."""

from megatron_h2.optimizer.adamw import (
    ADAM_STATES,
    build_optimizer,
    load_named_optimizer_state,
    optimizer_state_to_named,
)
from megatron_h2.optimizer.distributed_optimizer import (
    DataParallelOptimizer,
    DistributedOptimizer,
    ReplicatedOptimizer,
    build_data_parallel_optimizer,
    clip_grad_norm,
)
from megatron_h2.optimizer.lr_schedule import LRSchedule

__all__ = ["ADAM_STATES", "DataParallelOptimizer", "DistributedOptimizer", "LRSchedule",
           "ReplicatedOptimizer", "build_data_parallel_optimizer", "build_optimizer",
           "clip_grad_norm", "load_named_optimizer_state", "optimizer_state_to_named"]
