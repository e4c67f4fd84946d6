"""Parallelism across processes: data-parallel gradient sync and the distributed optimizer."""

from megatron_h2.distributed.distributed_optimizer import (
    DataParallelOptimizer,
    DistributedOptimizer,
    ReplicatedOptimizer,
    build_data_parallel_optimizer,
    clip_grad_norm,
)
from megatron_h2.distributed.grad_sync import Bucket, GradBuckets, broadcast_params

__all__ = ["Bucket", "DataParallelOptimizer", "DistributedOptimizer", "GradBuckets",
           "ReplicatedOptimizer", "broadcast_params", "build_data_parallel_optimizer",
           "clip_grad_norm"]
