"""Building blocks of the LLaMA-style decoder: RMSNorm, rotary embeddings, attention, MLP.

Shapes use b = micro-batch size, s = sequence length, h = hidden size, nh = attention heads,
ng = query groups (key/value heads), d = head dimension, f = FFN hidden size.
Parameter names follow Megatron-Core (``linear_qkv``, ``linear_proj``, ``linear_fc1``,
``linear_fc2``) so checkpoints read naturally to Megatron users.

Under tensor parallelism (``tp.size`` = t > 1) each rank holds nh/t heads and ng/t query groups
and f/t of the FFN; with sequence parallelism the residual stream between layers is
[b, s/t, h] and the norms run on the local sequence shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_h2.config import ModelConfig
from megatron_h2.devices.kernels import Kernels
from megatron_h2.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    mark_sequence_parallel,
)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale. [..., h] -> [..., h]."""

    def __init__(self, hidden_size: int, eps: float, kernels: Kernels,
                 tp: TPContext | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        if tp is not None and tp.sequence_parallel and tp.size > 1:
            mark_sequence_parallel(self.weight)  # sees only s/t positions: grads summed over TP
        self.eps = eps
        self._kernel = kernels.rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half convention, as LLaMA and Megatron use)."""

    def __init__(self, head_dim: int, max_positions: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, d]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [b, heads, s, d] -> same shape, rotated by position."""
        s = x.shape[-2]
        cos = self.cos[:s].to(x.dtype)  # [s, d]
        sin = self.sin[:s].to(x.dtype)
        return x * cos + self._rotate_half(x) * sin


class SelfAttention(nn.Module):
    """Causal grouped-query attention through scaled_dot_product_attention.

    ``linear_qkv`` is fused and laid out per query group, as in Megatron-Core:
    for each group g, its nh/ng query heads, then its key head, then its value head.
    """

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, tp: TPContext) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads // tp.size  # local heads
        self.num_groups = config.num_query_groups // tp.size  # local query groups
        self.head_dim = config.kv_channels
        self.heads_per_group = self.num_heads // self.num_groups
        h, d = config.hidden_size, config.kv_channels
        qkv_out = (config.num_attention_heads + 2 * config.num_query_groups) * d
        self.linear_qkv = ColumnParallelLinear(h, qkv_out, tp)  # whole groups per rank
        self.linear_proj = RowParallelLinear(config.num_attention_heads * d, h, tp)
        self.rotary = rotary
        self.dropout = config.attention_dropout
        self.recompute_core = config.recompute == "selective"

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [b, nh, s, d]; k, v: [b, ng, s, d] -> [b, nh, s, d]
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.num_groups != self.num_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.linear_qkv(x)  # [b, s, (nh + 2 ng) d / t] (all of s, also under SP)
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.num_groups, -1)  # [b, s, ng/t, (nh/ng + 2) d]
        q, k, v = qkv.split([self.heads_per_group * self.head_dim, self.head_dim,
                             self.head_dim], dim=-1)
        q = q.reshape(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # [b, nh, s, d]
        k = k.transpose(1, 2)  # [b, ng, s, d]
        v = v.transpose(1, 2)  # [b, ng, s, d]
        q, k = self.rotary(q), self.rotary(k)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            out = checkpoint(self._core_attention, q, k, v, use_reentrant=False)
        else:
            out = self._core_attention(q, k, v)
        out = out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)  # [b, s, h/t]
        return self.linear_proj(out)  # [b, s, h] (or [b, s/t, h] under SP)


class SwiGLUMLP(nn.Module):
    """SwiGLU feed-forward; ``linear_fc1`` holds [gate | up] fused. [b, s, h] -> [b, s, h]."""

    def __init__(self, config: ModelConfig, kernels: Kernels, tp: TPContext) -> None:
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.linear_fc1 = ColumnParallelLinear(h, 2 * f, tp, blocks=2)  # [gate_r; up_r] per rank
        self.linear_fc2 = RowParallelLinear(f, h, tp)
        self._swiglu = kernels.swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [b, s, h] -> [b, s, 2f/t] -> [b, s, f/t] -> [b, s, h] (sequence-sharded under SP)
        return self.linear_fc2(self._swiglu(self.linear_fc1(x)))


class TransformerLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(.)). [b, s, h] -> [b, s, h]."""

    def __init__(self, config: ModelConfig, kernels: Kernels, rotary: RotaryEmbedding,
                 tp: TPContext) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.norm_epsilon
        self.input_layernorm = RMSNorm(h, eps, kernels, tp)
        self.self_attention = SelfAttention(config, rotary, tp)
        self.pre_mlp_layernorm = RMSNorm(h, eps, kernels, tp)
        self.mlp = SwiGLUMLP(config, kernels, tp)
        self.hidden_dropout = config.hidden_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(x))
        x = x + F.dropout(attn, self.hidden_dropout, self.training)
        mlp = self.mlp(self.pre_mlp_layernorm(x))
        return x + F.dropout(mlp, self.hidden_dropout, self.training)
