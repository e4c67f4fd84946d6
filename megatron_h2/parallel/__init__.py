"""Tensor parallelism (Megatron-style), with optional sequence parallelism.

The TP group is always passed in explicitly as a :class:`TPContext`; ``TPContext.single()``
turns every layer and function here into its plain, communication-free torch counterpart.
"""

from megatron_h2.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_h2.parallel.mappings import (
    TPContext,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from megatron_h2.parallel.sharding import (
    TPShard,
    allreduce_coalesced_,
    allreduce_sequence_parallel_grads,
    gather_tp_tensor,
    get_tp_shard,
    is_sequence_parallel,
    load_shard_,
    mark_sequence_parallel,
    set_tp_shard,
    shard_slices,
    shard_tensor,
    unshard_tensors,
)
from megatron_h2.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPContext",
    "TPShard",
    "VocabParallelEmbedding",
    "allreduce_coalesced_",
    "allreduce_sequence_parallel_grads",
    "copy_to_tp_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tp_region",
    "gather_tp_tensor",
    "get_tp_shard",
    "is_sequence_parallel",
    "load_shard_",
    "mark_sequence_parallel",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tp_region",
    "set_tp_shard",
    "shard_slices",
    "shard_tensor",
    "unshard_tensors",
    "vocab_parallel_cross_entropy",
]
