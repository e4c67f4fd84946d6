"""Pipeline schedules (HeteroPP): which micro-batch each stage runs forward or backward when.
The traffic between stages is :mod:`megatron_h2.distributed.p2p`'s."""

from megatron_h2.pipeline.schedules import ComputeObserver, forward_backward_1f1b, forward_only

__all__ = ["ComputeObserver", "forward_backward_1f1b", "forward_only"]
