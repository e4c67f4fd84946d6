"""Pipeline schedules (HeteroPP): which micro-batch of which model chunk each stage runs
forward or backward when (:mod:`~megatron_h2.plan.orders`), the executor that runs an order
(:mod:`~megatron_h2.pipeline.schedule_runner`) and the backward split of zero-bubble schedules
(:mod:`~megatron_h2.pipeline.split_backward`). The traffic between stages is
:mod:`megatron_h2.distributed.p2p`'s."""

from megatron_h2.pipeline.schedule_runner import (
    ComputeObserver,
    StageChunks,
    forward_backward_1f1b,
    forward_only,
    run_schedule,
)
from megatron_h2.plan.orders import Action, check_micro_batches, check_orders, schedule_order

__all__ = ["Action", "ComputeObserver", "StageChunks", "check_micro_batches", "check_orders",
           "forward_backward_1f1b", "forward_only", "run_schedule", "schedule_order"]
