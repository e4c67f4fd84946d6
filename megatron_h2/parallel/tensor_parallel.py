"""Tensor-parallel layers: column- and row-parallel linears and the vocab-parallel embedding.

Activations are batch-first [b, s, h]. With ``tp.sequence_parallel`` the activations between TP
regions are split along the sequence: [b, s/tp, h]. Column-parallel layers all-gather them
before the matmul; row-parallel layers and the embedding reduce-scatter their output back.

Weights keep the attribute name ``weight`` (so checkpoint keys such as
``decoder.layers.0.self_attention.linear_qkv.weight`` do not change) and carry their layout as
``weight.tp_shard`` (see :mod:`megatron_h2.parallel.sharding`). With ``TPContext.single()`` each
layer computes exactly what ``nn.Linear`` / ``nn.Embedding`` compute, and draws the same initial
weights from the same RNG state (biases start at zero, as in Megatron).

The default initialisation draws each rank's shard from the current RNG state; to get weights
that are independent of the TP size, initialise the full tensor and copy this rank's part in with
:func:`megatron_h2.parallel.sharding.load_shard_`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_h2.parallel.mappings import (
    TPContext,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from megatron_h2.parallel.sharding import TPShard, mark_sequence_parallel, set_tp_shard


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by {denominator}")
    return numerator // denominator


def _init_like_linear(weight: torch.Tensor, fan_in: int) -> None:
    """nn.Linear's default init (kaiming-uniform, a=sqrt(5)) for the full fan-in ``fan_in``."""
    gain = nn.init.calculate_gain("leaky_relu", math.sqrt(5))
    std = gain / math.sqrt(fan_in)
    bound = math.sqrt(3.0) * std  # same float ops as nn.init.kaiming_uniform_
    with torch.no_grad():
        weight.uniform_(-bound, bound)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T (+ b) with A split along its rows (output features) across the TP ranks.

    ``weight``: [out/tp, in], spec ``TPShard(0, blocks)``: the output features are ``blocks``
    fused blocks (2 for [gate; up]), each split evenly across ranks; ``bias`` (optional):
    [out/tp], sharded the same way. With ``skip_weight`` the layer owns no weight and
    :meth:`forward` takes one of that shape (an output layer tied to the word embedding).

    Input: [b, s, in], replicated on every rank ([b, s/tp, in] under sequence parallelism,
    all-gathered along the sequence before the matmul). Output: [b, s, out/tp], or the full
    [b, s, out] on every rank with ``gather_output`` (in the full, unsharded feature order).
    """

    def __init__(self, in_features: int, out_features: int, tp: TPContext, blocks: int = 1,
                 gather_output: bool = False, *, bias: bool = False, skip_weight: bool = False,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.tp, self.blocks, self.gather_output = tp, blocks, gather_output
        _divide(out_features, blocks * tp.size, "out_features")
        self.out_per_rank = out_features // tp.size
        self.weight = None if skip_weight else nn.Parameter(
            torch.empty(self.out_per_rank, in_features, device=device, dtype=dtype))
        if self.weight is not None:
            set_tp_shard(self.weight, TPShard(0, blocks))
        self.bias = nn.Parameter(torch.zeros(self.out_per_rank, device=device, dtype=dtype)) \
            if bias else None
        if self.bias is not None:
            set_tp_shard(self.bias, TPShard(0, blocks))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default init of this rank's weight shard; the bias starts at zero."""
        if self.weight is not None:
            _init_like_linear(self.weight, self.in_features)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``weight`` ([out/tp, in]) is given exactly when the layer was built with
        ``skip_weight``."""
        if (weight is None) == (self.weight is None):
            raise ValueError("ColumnParallelLinear takes a weight in forward() exactly when it "
                             "was built with skip_weight=True")
        if self.tp.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp)  # [b, s/tp, in] -> [b, s, in]
        else:
            x = copy_to_tp_region(x, self.tp)  # [b, s, in]
        y = F.linear(x, self.weight if weight is None else weight, self.bias)  # [b, s, out/tp]
        if not self.gather_output or self.tp.size == 1:
            return y
        y = gather_from_tp_region(y, self.tp)  # [b, s, out] in (rank, block, piece) order
        if self.blocks == 1:
            return y
        piece = self.out_features // (self.blocks * self.tp.size)
        lead = y.shape[:-1]
        y = y.view(*lead, self.tp.size, self.blocks, piece).transpose(-3, -2)
        return y.reshape(*lead, self.out_features)  # [b, s, out] in (block, rank, piece) order

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.out_per_rank}), blocks={self.blocks}, bias={self.bias is not None}, "
                f"own_weight={self.weight is not None}, "
                f"gather_output={self.gather_output}, tp={self.tp.size}, "
                f"sequence_parallel={self.tp.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = X A^T (+ b) with A split along its columns (input features) across the TP ranks.

    ``weight``: [out, in/tp], spec ``TPShard(1)``; ``bias`` (optional): [out], replicated and
    added after the reduction (under sequence parallelism to the local sequence shard, so its
    gradient is marked for the sum over TP).

    Input: [b, s, in/tp] (or the full [b, s, in] with ``input_is_parallel=False``, split here).
    Output: [b, s, out], all-reduced over the group; under sequence parallelism reduce-scattered
    along the sequence to [b, s/tp, out].
    """

    def __init__(self, in_features: int, out_features: int, tp: TPContext,
                 input_is_parallel: bool = True, *, bias: bool = False,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if tp.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear under sequence parallelism needs "
                             "input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.tp, self.input_is_parallel = tp, input_is_parallel
        self.in_per_rank = _divide(in_features, tp.size, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, device=device,
                                               dtype=dtype))
        set_tp_shard(self.weight, TPShard(1))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) \
            if bias else None
        if self.bias is not None and tp.sequence_parallel and tp.size > 1:
            mark_sequence_parallel(self.bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default init of this rank's shard (bound from the full fan-in); the bias
        starts at zero."""
        _init_like_linear(self.weight, self.in_features)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """``add_bias=False`` leaves the bias to the caller (a MoE expert scales it by the
        token's routing probability)."""
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp)  # [b, s, in] -> [b, s, in/tp]
        y = F.linear(x, self.weight)  # [b, s, out], partial sum over the input shards
        if self.tp.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp)  # [b, s/tp, out]
        else:
            y = reduce_from_tp_region(y, self.tp)  # [b, s, out]
        return y if self.bias is None or not add_bias else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.in_per_rank}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, "
                f"tp={self.tp.size}, sequence_parallel={self.tp.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary across the TP ranks.

    ``weight``: [V/tp, h], spec ``TPShard(0)``; rank r owns token ids [r V/tp, (r+1) V/tp).
    Input: token ids [b, s]. Each rank looks up the ids it owns (others give zeros) and the
    partial results are all-reduced to [b, s, h], or under sequence parallelism reduce-scattered
    along the sequence to [b, s/tp, h].
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPContext, *,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp = num_embeddings, embedding_dim, tp
        self.vocab_per_rank = _divide(num_embeddings, tp.size, "num_embeddings")
        self.vocab_start = tp.rank * self.vocab_per_rank
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, embedding_dim,
                                               device=device, dtype=dtype))
        set_tp_shard(self.weight, TPShard(0))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Embedding's default init (standard normal) of this rank's shard."""
        nn.init.normal_(self.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)  # [b, s, h]
        local = tokens - self.vocab_start  # [b, s]
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [b, s, h]
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.tp.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp)  # [b, s/tp, h]
        return reduce_from_tp_region(out, self.tp)  # [b, s, h]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (local {self.vocab_per_rank} from {self.vocab_start}), "
                f"{self.embedding_dim}, tp={self.tp.size}, "
                f"sequence_parallel={self.tp.sequence_parallel}")
