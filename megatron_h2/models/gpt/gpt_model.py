"""The GPT model, built for a contiguous range of global layers.

A pipeline stage builds only its own layers: ``layer_range=(start, end)`` selects global layer
indices, ``pre_process`` adds the embeddings and ``post_process`` the final norm and output
layer. Layers live in ``decoder.layers`` keyed by their *global* index, so a parameter is named
``decoder.layers.7.mlp.linear_fc1.weight`` whatever the split, and checkpoints do not depend on
the pipeline layout.

With tied embeddings (Megatron's default) the output layer multiplies by the word embedding's
weight. A stage that has the output layer but not the embedding (pipeline parallelism) holds a
copy, ``output_layer.weight``, initialised like the embedding; the training step sums the two
copies' gradients every step (:mod:`megatron_h2.distributed.tied_embedding`), and checkpoints
store the weight once, under :data:`WORD_EMBEDDING` (see :attr:`GPTModel.checkpoint_names`).

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
from megatron_h2.models.gpt.layers import Norm, RotaryEmbedding, TransformerLayer
from megatron_h2.models.gpt.moe_layer import MoELayer
from megatron_h2.models.gpt.router import MoEState, TopKRouter
from megatron_h2.parallel import (
    ColumnParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    gather_from_tp_region,
    get_tp_shard,
    load_shard_,
    mark_sequence_parallel,
    vocab_parallel_cross_entropy,
)
from megatron_h2.parallel.expert_parallel import EXPERT_PARALLEL_ATTR, EPContext

WORD_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_WEIGHT = "output_layer.weight"
TIED_COPY_ATTR = "tied_embedding_copy"
"""Set on the last stage's copy of a tied word embedding (it is not a parameter of its own: the
gradient norm counts it once, checkpoints store it once)."""


class Decoder(nn.Module):
    """The stage's transformer layers (keyed by global index) and, on the last stage, the final
    norm. ``chunks`` are the global layer ranges of the stage's model chunks."""

    def __init__(self, config: ModelConfig, kernels: Kernels,
                 chunks: Sequence[tuple[int, int]], post_process: bool, tp: TPContext,
                 moe_state: MoEState | None = None, ep: EPContext | None = None,
                 etp: TPContext | None = None) -> None:
        super().__init__()
        self.chunks = [range(*r) for r in chunks]
        has_layers = any(len(r) for r in self.chunks)
        rotary = (RotaryEmbedding(config) if config.position_embedding_type == "rope"
                  and has_layers else None)
        moe_state = moe_state or MoEState()

        def layer(i: int) -> TransformerLayer:
            mlp = (MoELayer(config, kernels, tp, i, moe_state, ep, etp) if config.is_moe_layer(i)
                   else None)
            return TransformerLayer(config, kernels, rotary, tp, mlp)

        self.layers = nn.ModuleDict({str(i): layer(i) for r in self.chunks for i in r})
        self.final_layernorm = Norm(config, kernels, tp) if post_process else None
        # per chunk: (global layer indices, checkpointed as one group) in order (full recompute:
        # --recompute-method uniform / block and --recompute-num-layers)
        self.groups = [config.recompute_groups(r) for r in self.chunks]

    def _run(self, layers: list[int], x: torch.Tensor) -> torch.Tensor:
        for i in layers:
            x = self.layers[str(i)](x)
        return x

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        recompute = self.training and torch.is_grad_enabled()
        for layers, checkpointed in self.groups[chunk]:
            if checkpointed and recompute:  # keep only the group's input [b, s, h]
                x = checkpoint(self._run, layers, x, use_reentrant=False)
            else:
                x = self._run(layers, x)
        if self.final_layernorm is not None and chunk == len(self.chunks) - 1:
            x = self.final_layernorm(x)
        return x


class GPTModel(nn.Module):
    """Decoder-only language model of ``config``'s architecture (see :class:`ModelConfig`).

    ``tp`` shards it over a tensor-parallel group (default: no TP); the embedding and output
    layer are vocabulary-parallel and the loss never gathers the full vocabulary.
    """

    def __init__(self, config: ModelConfig, kernels: Kernels | None = None,
                 layer_range: tuple[int, int] | None = None, pre_process: bool = True,
                 post_process: bool = True, tp: TPContext | None = None,
                 chunks: Sequence[tuple[int, int]] | None = None,
                 ep: EPContext | None = None, etp: TPContext | None = None) -> None:
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
        self.moe_state = MoEState()
        """The aux-loss gradient scale and the losses the MoE layers recorded."""
        self.ep = ep or EPContext.single()
        """Expert parallelism: this rank holds ``ep.local_experts(num_experts)`` of each MoE
        layer."""
        self.etp = etp if etp is not None and etp.size != tp.size else None
        """The routed experts' tensor-parallel context where it differs from ``tp`` (ETP !=
        TP); None: the experts are split over ``tp`` like the dense MLP."""
        self.decoder = Decoder(config, kernels, self.chunk_ranges, post_process, tp,
                               self.moe_state, self.ep, self.etp)
        shares = config.tied_embeddings and pre_process  # uses the embedding's own weight
        self.output_layer = (ColumnParallelLinear(config.hidden_size, config.vocab_size, tp,
                                                  skip_weight=shares)
                             if post_process else None)
        self.checkpoint_names: dict[str, str] = {}
        """Parameter name -> name in checkpoints, where they differ (the tied copy)."""
        if post_process and config.tied_embeddings and not pre_process:
            setattr(self.output_layer.weight, TIED_COPY_ATTR, True)
            self.checkpoint_names[OUTPUT_WEIGHT] = WORD_EMBEDDING

    def tied_embedding_weight(self) -> nn.Parameter | None:
        """This stage's word-embedding weight or tied copy whose gradient must be summed with the
        other end's (None when the weights are untied or both ends are on this stage)."""
        if not self.config.tied_embeddings or self.pre_process == self.post_process:
            return None
        return (self.embedding.word_embeddings.weight if self.pre_process
                else self.output_layer.weight)

    def moe_layers(self) -> dict[int, MoELayer]:
        """This stage's MoE blocks by global layer index."""
        return {int(i): layer.mlp for i, layer in self.decoder.layers.items()
                if isinstance(layer.mlp, MoELayer)}

    def routers_with_expert_bias(self) -> list[TopKRouter]:
        """The routers that balance with an expert bias (``--moe-router-enable-expert-bias``),
        in global layer order."""
        return [moe.router for _, moe in sorted(self.moe_layers().items())
                if moe.router.expert_bias is not None]

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
        if last and self.output_layer is not None and self.output_layer.weight is None:
            parts.append(self.embedding.word_embeddings)  # the tied head's weight
        unique = {id(p): p for part in parts if part is not None for p in part.parameters()}
        return list(unique.values())

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
        shared = (self.embedding.word_embeddings.weight if self.output_layer.weight is None
                  else None)
        logits = self.output_layer(x, shared)  # [b, s, V/t]
        if labels is None:
            return gather_from_tp_region(logits, self.tp)  # [b, s, V]
        return vocab_parallel_cross_entropy(logits, labels, self.tp)  # [b, s] fp32


class _Embedding(nn.Module):
    """Word embedding plus, with ``learned_absolute`` positions, a position table (replicated
    over TP) of the first stage. [b, s] -> [b, s, h] ([b, s/t, h] under SP)."""

    def __init__(self, config: ModelConfig, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.position_embedding_type == "learned_absolute" else None)
        if self.position_embeddings is not None and tp.sequence_parallel and tp.size > 1:
            mark_sequence_parallel(self.position_embeddings.weight)  # sees s/t positions
        self.dropout = config.hidden_dropout

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)  # [b, s, h] ([b, s/t, h] under SP)
        if self.position_embeddings is not None:
            local = x.shape[1]  # this rank's positions: all, or its sequence shard under SP
            start = self.tp.rank * local if self.tp.sequence_parallel else 0
            positions = torch.arange(start, start + local, device=tokens.device)
            x = x + self.position_embeddings(positions)  # [b, s, h] + [s, h]
        return F.dropout(x, self.dropout, self.training)


def param_tp(model: nn.Module, param: torch.Tensor) -> TPContext:
    """The tensor-parallel context ``param`` of ``model`` is sharded over: the experts' own
    (``model.etp``) for a routed expert's parameter under ETP != TP, else ``model.tp``."""
    etp = getattr(model, "etp", None)
    if etp is not None and getattr(param, EXPERT_PARALLEL_ATTR, False):
        return etp
    return model.tp


def full_shape(param: torch.Tensor, tp: TPContext) -> tuple[int, ...]:
    """Shape of the whole (unsharded) tensor that ``param`` is this rank's shard of."""
    spec = get_tp_shard(param)
    shape = list(param.shape)
    if spec is not None:
        shape[spec.dim] *= tp.size
    return tuple(shape)


def init_parameters(model: GPTModel, config: ModelConfig, seed: int) -> None:
    """Initialise every parameter as Megatron does, from a generator seeded by (seed, name).

    Norm scales start at one (zero when zero-centred), biases at zero; matrices and embedding
    tables are N(0, std), with the output projections of each layer (``linear_proj``,
    ``linear_fc2``) scaled by 1/sqrt(2 x num_layers). The full tensor is drawn and this rank keeps
    its shard, and the seed depends only on the parameter's checkpoint name, so the initial
    weights are the same under every pipeline split and every tensor-parallel degree, and the
    last stage's copy of a tied embedding equals the first stage's.
    """
    scaled_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") and not name.endswith("router.bias"):
                param.zero_()  # (Megatron draws the router's bias like its weight)
                continue
            if name.endswith("layernorm.weight"):
                param.fill_(0.0 if config.apply_layernorm_1p else 1.0)
                continue
            std = scaled_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) \
                else config.init_method_std
            name = model.checkpoint_names.get(name, name)
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()))
                                                % (2**63))
            tp = param_tp(model, param)
            full = torch.randn(full_shape(param, tp), generator=gen, dtype=torch.float32)
            load_shard_(param, full * std, tp)


@torch.no_grad()
def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every parameter of ``model`` in ``dtype`` (``--bf16`` / ``--fp16``), keeping each
    Parameter object (and its attributes: tensor-parallel shard, sequence parallelism, tied
    copy). Buffers stay as they are: the rotary tables are cast per use, as Megatron computes
    them in fp32."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
