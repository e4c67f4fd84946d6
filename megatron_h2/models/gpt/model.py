"""The GPT (LLaMA-style) model, built for a contiguous range of global layers.

A pipeline stage builds only its own layers: ``layer_range=(start, end)`` selects global layer
indices, ``pre_process`` adds the word embedding and ``post_process`` the final norm and output
head. Layers live in ``decoder.layers`` keyed by their *global* index, so a parameter is named
``decoder.layers.7.mlp.linear_fc1.weight`` whatever the split, and checkpoints do not depend on
the pipeline layout.

With virtual pipeline stages a stage holds several model chunks, each a range of global layers
(``chunks=[(0, 2), (4, 6)]``): one module holds them all, so names, initialisation, the
optimizer, gradient buckets and checkpoints cover every chunk as one stage model, and
``forward(..., chunk=c)`` runs chunk ``c`` alone: the embedding before chunk 0 (with
``pre_process``), the final norm and head after the last chunk (with ``post_process``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_h2.config import ModelConfig
from megatron_h2.devices.kernels import Kernels
from megatron_h2.models.gpt.layers import RMSNorm, RotaryEmbedding, TransformerLayer
from megatron_h2.parallel import (
    ColumnParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    gather_from_tp_region,
    get_tp_shard,
    load_shard_,
    vocab_parallel_cross_entropy,
)


class Decoder(nn.Module):
    """The stage's transformer layers (keyed by global index) and, on the last stage, the final
    norm. ``chunks`` are the global layer ranges of the stage's model chunks."""

    def __init__(self, config: ModelConfig, kernels: Kernels,
                 chunks: Sequence[tuple[int, int]], post_process: bool, tp: TPContext) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.kv_channels, config.max_position_embeddings,
                                 config.rotary_base)
        self.chunks = [range(*r) for r in chunks]
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, kernels, rotary, tp)
                                     for r in self.chunks for i in r})
        self.final_layernorm = (RMSNorm(config.hidden_size, config.norm_epsilon, kernels, tp)
                                if post_process else None)
        self.recompute_full = config.recompute == "full"

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        for i in self.chunks[chunk]:
            layer = self.layers[str(i)]
            if self.recompute_full and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        if self.final_layernorm is not None and chunk == len(self.chunks) - 1:
            x = self.final_layernorm(x)
        return x


class GPTModel(nn.Module):
    """LLaMA-style decoder-only language model (untied input and output embeddings).

    ``tp`` shards it over a tensor-parallel group (default: no TP); the embedding and output
    layer are vocabulary-parallel and the loss never gathers the full vocabulary.
    """

    def __init__(self, config: ModelConfig, kernels: Kernels | None = None,
                 layer_range: tuple[int, int] | None = None, pre_process: bool = True,
                 post_process: bool = True, tp: TPContext | None = None,
                 chunks: Sequence[tuple[int, int]] | None = None) -> None:
        super().__init__()
        if config.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (padded tokenizer vocabulary)")
        if chunks is not None and layer_range is not None:
            raise ValueError("give either layer_range or chunks, not both")
        kernels = kernels or Kernels()
        self.tp = tp = tp or TPContext.single()
        self.config = config
        self.chunk_ranges = [tuple(r) for r in chunks] if chunks is not None else [
            layer_range or (0, config.num_layers)]
        self.layer_range = (self.chunk_ranges[0][0], self.chunk_ranges[-1][1])
        self.pre_process, self.post_process = pre_process, post_process
        self.embedding = _Embedding(config, tp) if pre_process else None
        self.decoder = Decoder(config, kernels, self.chunk_ranges, post_process, tp)
        self.output_layer = (ColumnParallelLinear(config.hidden_size, config.vocab_size, tp)
                             if post_process else None)

    @property
    def num_chunks(self) -> int:
        """Model chunks (virtual pipeline stages) this stage model holds."""
        return len(self.chunk_ranges)

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """The parameters ``forward(..., chunk=chunk)`` uses."""
        last = chunk == self.num_chunks - 1
        parts: list[nn.Module | None] = [self.embedding if chunk == 0 else None]
        parts += [self.decoder.layers[str(i)] for i in self.decoder.chunks[chunk]]
        parts += [self.decoder.final_layernorm, self.output_layer] if last else []
        return [p for part in parts if part is not None for p in part.parameters()]

    def forward(self, tokens: torch.Tensor | None = None,
                hidden_states: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
        """First stage: ``tokens`` [b, s]; later stages (and later chunks): ``hidden_states``
        [b, s, h]. ``chunk``: which model chunk to run (virtual pipeline stages).

        Returns per-token cross-entropy [b, s] (fp32) when this stage has the head, ``chunk`` is
        the last one and ``labels`` [b, s] are given, logits [b, s, V] when it has the head
        without labels, and hidden states [b, s, h] otherwise.
        """
        if self.embedding is not None and chunk == 0:
            x = self.embedding(tokens)
        else:
            x = hidden_states
        x = self.decoder(x, chunk)  # [b, s, h] ([b, s/t, h] under sequence parallelism)
        if self.output_layer is None or chunk != self.num_chunks - 1:
            return x
        logits = self.output_layer(x)  # [b, s, V/t]
        if labels is None:
            return gather_from_tp_region(logits, self.tp)  # [b, s, V]
        return vocab_parallel_cross_entropy(logits, labels, self.tp)  # [b, s] fp32


class _Embedding(nn.Module):
    """Word embedding of the first stage. [b, s] -> [b, s, h] ([b, s/t, h] under SP)."""

    def __init__(self, config: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.dropout = config.hidden_dropout

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.word_embeddings(tokens), self.dropout, self.training)


def full_shape(param: torch.Tensor, tp: TPContext) -> tuple[int, ...]:
    """Shape of the whole (unsharded) tensor that ``param`` is this rank's shard of."""
    spec = get_tp_shard(param)
    shape = list(param.shape)
    if spec is not None:
        shape[spec.dim] *= tp.size
    return tuple(shape)


def init_parameters(model: GPTModel, config: ModelConfig, seed: int) -> None:
    """Initialise every parameter from a generator seeded by (seed, parameter name).

    Norm scales start at one; matrices are N(0, std), with the output projections of each layer
    (``linear_proj``, ``linear_fc2``) scaled by 1/sqrt(2 x num_layers) as in Megatron. The full
    tensor is drawn and this rank keeps its shard, and the seed depends only on the global
    parameter name, so the initial weights are the same under every pipeline split and every
    tensor-parallel degree.
    """
    scaled_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight"):
                param.fill_(1.0)
                continue
            std = scaled_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) \
                else config.init_method_std
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()))
                                                % (2**63))
            full = torch.randn(full_shape(param, model.tp), generator=gen, dtype=torch.float32)
            load_shard_(param, full * std, model.tp)
