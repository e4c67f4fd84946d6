"""Building blocks of the decoder: norms, rotary embeddings, attention, MLP, the layer.

What is built follows the :class:`~megatron_h2.config.ModelConfig` flags as in Megatron-Core:
LayerNorm (with bias) or RMSNorm, optionally zero-centred (``--apply-layernorm-1p``); GeLU,
squared-ReLU or SwiGLU MLP; biases in the linear layers unless ``--disable-bias-linear``
(``--add-qkv-bias`` for the QKV projection alone); rotary embeddings on ``--rotary-percent`` of
each head with Llama 3.x scaling or linear position interpolation.

Shapes use b = micro-batch size, s = sequence length, h = hidden size, nh = attention heads,
ng = query groups (key/value heads), d = head dimension (``kv_channels``), f = FFN hidden size.
Parameter names follow Megatron-Core's local layer spec (``input_layernorm``, ``linear_qkv``,
``linear_proj``, ``pre_mlp_layernorm``, ``linear_fc1``, ``linear_fc2``) so checkpoints read
naturally to Megatron users.

Under tensor parallelism (``tp.size`` = t > 1) each rank holds nh/t heads and ng/t query groups
and f/t of the FFN; with sequence parallelism the residual stream between layers is
[b, s/t, h] and the norms run on the local sequence shard.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_h2.config import ModelConfig
from megatron_h2.devices.attention import TECoreAttention, causal_attention
from megatron_h2.devices.kernels import Kernels
from megatron_h2.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    copy_to_tp_region,
    mark_sequence_parallel,
)


class Norm(nn.Module):
    """LayerNorm (scale and bias) or RMSNorm (scale) over the hidden size. [..., h] -> [..., h].

    With ``apply_layernorm_1p`` the scale is stored zero-centred: it starts at 0 and the norm
    multiplies by ``1 + weight`` (Megatron's ``layernorm_zero_centered_gamma``).
    """

    def __init__(self, config: ModelConfig, kernels: Kernels, tp: TPContext | None = None) -> None:
        super().__init__()
        h = config.hidden_size
        self.zero_centered = config.apply_layernorm_1p
        self.weight = nn.Parameter(torch.zeros(h) if self.zero_centered else torch.ones(h))
        self.bias = nn.Parameter(torch.zeros(h)) if config.normalization == "LayerNorm" else None
        if tp is not None and tp.sequence_parallel and tp.size > 1:
            for param in self.parameters():  # sees only s/t positions: grads summed over TP
                mark_sequence_parallel(param)
        self.eps = config.norm_epsilon
        self._rms_norm, self._layer_norm = kernels.rms_norm, kernels.layer_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1.0 if self.zero_centered else self.weight
        if self.bias is None:
            return self._rms_norm(x, weight, self.eps)
        return self._layer_norm(x, weight, self.bias, self.eps)


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float = 1.0,
                           high_freq_factor: float = 4.0,
                           original_max_positions: int = 8192) -> torch.Tensor:
    """Llama 3.x rope scaling of the rotary frequencies (``--use-rope-scaling``), with the
    constants Megatron fixes: low/high frequency factors 1 and 4, original context 8192."""
    low_wavelen = original_max_positions / low_freq_factor
    high_wavelen = original_max_positions / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor
                                                                     - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding on the first ``rotary_dim`` dimensions of each head
    (rotate-half convention, as LLaMA and Megatron use); the rest pass through."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim = self.rotary_dim = config.rotary_dim
        inv_freq = 1.0 / (config.rotary_base
                          ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        if config.use_rope_scaling:
            inv_freq = llama3_scaled_inv_freq(inv_freq, config.rope_scaling_factor)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        if config.rotary_seq_len_interpolation_factor is not None:
            positions *= 1 / config.rotary_seq_len_interpolation_factor
        freqs = torch.outer(positions, inv_freq)  # [max_positions, rotary_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rotary_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [b, heads, s, d] -> same shape, the first rotary_dim dimensions rotated."""
        s = x.shape[-2]
        cos = self.cos[:s].to(x.dtype)  # [s, rotary_dim]
        sin = self.sin[:s].to(x.dtype)
        if self.rotary_dim == x.shape[-1]:
            return x * cos + self._rotate_half(x) * sin
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat((rot * cos + self._rotate_half(rot) * sin, rest), dim=-1)


class SelfAttention(nn.Module):
    """Causal (grouped-query) attention through scaled_dot_product_attention.

    ``linear_qkv`` is fused and laid out per query group, as in Megatron-Core: for each group g,
    its nh/ng query heads, then its key head, then its value head (its bias likewise).
    The softmax scale is 1/sqrt(d).
    """

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding | None,
                 tp: TPContext) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads // tp.size  # local heads
        self.num_groups = config.num_query_groups // tp.size  # local query groups
        self.head_dim = d = config.kv_channels
        self.heads_per_group = self.num_heads // self.num_groups
        h = config.hidden_size
        qkv_out = (config.num_attention_heads + 2 * config.num_query_groups) * d
        self.linear_qkv = ColumnParallelLinear(h, qkv_out, tp,  # whole groups per rank
                                               bias=config.add_qkv_bias)
        self.linear_proj = RowParallelLinear(config.query_size, h, tp,
                                             bias=config.add_bias_linear)
        self.rotary = rotary
        self.dropout = config.attention_dropout
        self.recompute_core = config.recompute == "selective"
        self.backend = config.attention_backend  # torch SDPA kernels allowed (devices.attention)
        self.te_core = (TECoreAttention(self.num_heads, self.num_groups, d, self.dropout,
                                        self.backend)
                        if config.transformer_impl == "transformer_engine" else None)

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [b, nh, s, d]; k, v: [b, ng, s, d] -> [b, nh, s, d]
        if self.te_core is not None:
            return self.te_core(q, k, v)
        return causal_attention(q, k, v, self.dropout if self.training else 0.0, self.backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.linear_qkv(x)  # [b, s, (nh + 2 ng) d / t] (all of s, also under SP)
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.num_groups, -1)  # [b, s, ng/t, (nh/ng + 2) d]
        q, k, v = qkv.split([self.heads_per_group * self.head_dim, self.head_dim,
                             self.head_dim], dim=-1)
        q = q.reshape(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # [b, nh, s, d]
        k = k.transpose(1, 2)  # [b, ng, s, d]
        v = v.transpose(1, 2)  # [b, ng, s, d]
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            out = checkpoint(self._core_attention, q, k, v, use_reentrant=False)
        else:
            out = self._core_attention(q, k, v)
        out = out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)  # [b, s, nh d/t]
        return self.linear_proj(out)  # [b, s, h] (or [b, s/t, h] under SP)


def _squared_relu(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(F.relu(x), 2)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    """Feed-forward block. [b, s, h] -> [b, s, f] (SwiGLU: [b, s, 2f] as [gate | up]) ->
    activation -> [b, s, h]."""

    def __init__(self, config: ModelConfig, kernels: Kernels, tp: TPContext,
                 ffn_hidden_size: int | None = None) -> None:
        super().__init__()
        h, f = config.hidden_size, ffn_hidden_size or config.ffn_hidden_size
        bias = config.add_bias_linear
        fc1 = 2 * f if config.swiglu else f
        self.linear_fc1 = ColumnParallelLinear(  # SwiGLU: [gate_r; up_r] per rank
            h, fc1, tp, blocks=2 if config.swiglu else 1, bias=bias)
        self.linear_fc2 = RowParallelLinear(f, h, tp, bias=bias)
        self._activation = {"swiglu": kernels.swiglu, "squared_relu": _squared_relu,
                            "gelu_tanh": _gelu_tanh, "gelu": F.gelu}[config.activation]

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """The activation on the output of ``linear_fc1``: [b, s, fc1/t] -> [b, s, f/t]."""
        return self._activation(x)

    def forward(self, x: torch.Tensor, per_token_scale: torch.Tensor | None = None
                ) -> torch.Tensor:
        """[b, s, h] -> [b, s, fc1/t] -> [b, s, f/t] -> [b, s, h] (sequence-sharded under SP).

        ``per_token_scale`` [n] (a MoE expert's routing probabilities of its n tokens, x:
        [n, h]) scales each token's output as Megatron-Core does: the activation, then the
        second layer's bias."""
        inter = self.activation(self.linear_fc1(x))
        if per_token_scale is None:
            return self.linear_fc2(inter)
        dtype = inter.dtype
        # each TP rank's share of the scale's gradient comes from its f/t columns: summed
        scale = copy_to_tp_region(per_token_scale, self.linear_fc1.tp)
        inter = (inter * scale.unsqueeze(-1)).to(dtype)  # [n, f/t]
        out = self.linear_fc2(inter, add_bias=False)  # [n, h]
        bias = self.linear_fc2.bias
        if bias is None:
            return out
        return (out + bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)).to(out.dtype)


class TransformerLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(.)). [b, s, h] -> [b, s, h]."""

    def __init__(self, config: ModelConfig, kernels: Kernels, rotary: RotaryEmbedding | None,
                 tp: TPContext, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = Norm(config, kernels, tp)
        self.self_attention = SelfAttention(config, rotary, tp)
        self.pre_mlp_layernorm = Norm(config, kernels, tp)
        self.mlp = mlp if mlp is not None else MLP(config, kernels, tp)  # or a MoE block
        self.hidden_dropout = config.hidden_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(x))
        x = x + F.dropout(attn, self.hidden_dropout, self.training)
        mlp = self.mlp(self.pre_mlp_layernorm(x))
        return x + F.dropout(mlp, self.hidden_dropout, self.training)
