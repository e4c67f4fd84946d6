"""Optimizers: AdamW with Megatron's parameter groups, the data-parallel optimizers (replicated
and ZeRO-1 distributed, with fp32 main weights for bf16 / fp16 models), fp16 loss scaling and
the learning-rate / weight-decay schedule."""

from megatron_h2.optimizer.adamw import (
    ADAM_STATES,
    EMBEDDING_OR_OUTPUT,
    AdamW,
    build_optimizer,
    load_named_optimizer_state,
    optimizer_state_to_named,
    param_groups,
)
from megatron_h2.optimizer.distributed_optimizer import (
    DataParallelOptimizer,
    DistributedOptimizer,
    ReplicatedOptimizer,
    build_data_parallel_optimizer,
    clip_grad_norm,
)
from megatron_h2.optimizer.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    GradScaler,
    build_grad_scaler,
)
from megatron_h2.optimizer.lr_schedule import OptimizerParamScheduler

__all__ = ["ADAM_STATES", "EMBEDDING_OR_OUTPUT", "AdamW", "ConstantGradScaler",
           "DataParallelOptimizer", "DistributedOptimizer", "DynamicGradScaler", "GradScaler",
           "OptimizerParamScheduler", "ReplicatedOptimizer", "build_data_parallel_optimizer",
           "build_grad_scaler", "build_optimizer", "clip_grad_norm",
           "load_named_optimizer_state", "optimizer_state_to_named", "param_groups"]
