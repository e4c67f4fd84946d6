"""Communication between processes (DiComm): the rank topology and its process groups,
pipeline point-to-point traffic (direct or through the cross-vendor bridge) and data-parallel
gradient buckets."""

from megatron_h2.distributed.grad_sync import Bucket, GradBuckets, broadcast_params

__all__ = ["Bucket", "GradBuckets", "broadcast_params"]
