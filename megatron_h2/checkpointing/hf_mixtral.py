"""Hugging Face ``MixtralForCausalLM`` <-> our Mixtral-style MoE models (a LLaMA whose every
MLP is a MoE block: softmax top-k routing renormalised over the chosen experts, SwiGLU experts,
no shared experts, no biases).

Attention, norms and embeddings map as in :mod:`~megatron_h2.checkpointing.hf_llama`; the MoE
blocks, as ``save_pretrained`` writes them (E experts, f = intermediate size, h hidden size;
per-layer names under ``model.layers.{i}.`` and ``decoder.layers.{i}.``)::

    block_sparse_moe.gate.weight [E, h]       <-> mlp.router.weight
    block_sparse_moe.experts.{e}.w1.weight    <-> mlp.experts.local_experts.{e}.linear_fc1.weight
    block_sparse_moe.experts.{e}.w3.weight        (fused [w1 (gate); w3 (up)], [2f, h])
    block_sparse_moe.experts.{e}.w2.weight    <-> mlp.experts.local_experts.{e}.linear_fc2.weight

Mixtral's router takes the top-k of the softmax over all experts and divides by their sum,
which is the softmax over the top-k logits that Megatron's default routing computes.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_h2.checkpointing import hf_llama
from megatron_h2.checkpointing.hf_tensors import check_state, get_float, get_int
from megatron_h2.config import ModelConfig
from megatron_h2.errors import ConfigError

MODEL_TYPE = "mixtral"
ARCHITECTURE = "MixtralForCausalLM"
EMBED, HEAD = hf_llama.EMBED, hf_llama.HEAD
_MOE = "block_sparse_moe."


def model_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Our model fields (all but the vocabulary) for a Mixtral ``config.json``."""
    window = hf_config.get("sliding_window")
    max_pos = get_int(hf_config, "max_position_embeddings")
    if window is not None and get_int(hf_config, "sliding_window") < max_pos:
        raise ConfigError(f"config.json sets sliding_window {window} below "
                          f"max_position_embeddings {max_pos}; megatron_h2 attends over the "
                          "whole sequence")
    if get_float(hf_config, "router_jitter_noise", 0.0) != 0.0:
        raise ConfigError("config.json sets router_jitter_noise; megatron_h2 routes without "
                          "input jitter")
    dense = {k: v for k, v in hf_config.items() if k not in ("attention_bias", "mlp_bias")}
    fields = hf_llama.model_fields(dense)
    fields.update(num_experts=get_int(hf_config, "num_local_experts"),
                  moe_router_topk=get_int(hf_config, "num_experts_per_tok"),
                  moe_ffn_hidden_size=fields["ffn_hidden_size"])
    return fields


def unsupported(config: ModelConfig) -> str | None:
    """Why ``config`` cannot be written as a MixtralForCausalLM (None when it can)."""
    reasons = {
        "no mixture-of-experts layers": not config.is_moe,
        "dense layers between the MoE layers (--moe-layer-freq)":
            config.is_moe and len(config.moe_layers) != config.num_layers,
        "shared experts": bool(config.moe_shared_expert_intermediate_size),
        f"router score function {config.moe_router_score_function}":
            config.moe_router_score_function != "softmax",
        "--moe-router-pre-softmax": config.moe_router_pre_softmax,
        "--moe-router-topk-scaling-factor": bool(config.moe_router_topk_scaling_factor),
        "an expert bias": config.moe_router_enable_expert_bias,
        "group-limited routing": bool(config.moe_router_group_topk),
        "token dropping (--moe-expert-capacity-factor)":
            config.moe_expert_capacity_factor is not None,
        "biases": config.add_bias_linear or config.add_qkv_bias,
    }
    bad = [what for what, is_bad in reasons.items() if is_bad]
    dense = hf_llama.unsupported(config, moe=True)
    if dense:
        bad.append(dense)
    return ", ".join(bad) if bad else None


def hf_config(config: ModelConfig, true_vocab_size: int | None = None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Mixtral ``config.json`` dict for ``config`` (``extra``: the HF config recorded at
    import, for the fields we do not model)."""
    out = hf_llama.hf_config(config, true_vocab_size, extra)
    for key in ("attention_bias", "mlp_bias"):
        out.pop(key, None)
    out.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE,
               intermediate_size=config.moe_ffn_hidden_size,
               num_local_experts=config.num_experts,
               num_experts_per_tok=config.moe_router_topk)
    out.setdefault("sliding_window", None)
    if extra is not None and extra.get("head_dim", 0) is None \
            and config.kv_channels * config.num_attention_heads == config.hidden_size:
        out["head_dim"] = None  # Mixtral's way of saying hidden / heads
    return out


def _moe_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, f, e = config.hidden_size, config.moe_ffn_hidden_size, config.num_experts
    shapes = {}
    for i in range(config.num_layers):
        p = f"model.layers.{i}.{_MOE}"
        shapes[p + "gate.weight"] = (e, h)
        for x in range(e):
            shapes.update({f"{p}experts.{x}.w1.weight": (f, h), f"{p}experts.{x}.w3.weight": (f, h),
                           f"{p}experts.{x}.w2.weight": (h, f)})
    return shapes


def hf_shapes(config: ModelConfig, vocab: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the HF checkpoint (``vocab`` rows of embeddings)."""
    return {**hf_llama.hf_shapes(config, vocab), **_moe_shapes(config)}


def to_megatron(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF Mixtral tensors -> ours for ``config``; the vocabulary is padded with zero rows."""
    moe = {k: v for k, v in hf_state.items() if f".{_MOE}" in k}
    check_state(moe, _moe_shapes(config), "HF checkpoint")
    dense = {k: v for k, v in hf_state.items() if k not in moe}
    out = hf_llama.to_megatron(dense, config)
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.{_MOE}", f"decoder.layers.{i}.mlp."
        out[dst + "router.weight"] = moe[src + "gate.weight"]
        for x in range(config.num_experts):
            expert = f"{dst}experts.local_experts.{x}."
            out[expert + "linear_fc1.weight"] = torch.cat(
                [moe[f"{src}experts.{x}.w1.weight"], moe[f"{src}experts.{x}.w3.weight"]])
            out[expert + "linear_fc2.weight"] = moe[f"{src}experts.{x}.w2.weight"]
    return out


def to_hf(state: dict[str, torch.Tensor], config: ModelConfig,
          vocab: int) -> dict[str, torch.Tensor]:
    """Our tensors (checked by the caller) -> HF Mixtral tensors with ``vocab`` rows."""
    out = hf_llama.to_hf(state, config, vocab)
    for i in range(config.num_layers):
        src, dst = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.{_MOE}"
        out[dst + "gate.weight"] = state[src + "router.weight"]
        for x in range(config.num_experts):
            expert = f"{src}experts.local_experts.{x}."
            w1, w3 = state[expert + "linear_fc1.weight"].chunk(2)
            out.update({f"{dst}experts.{x}.w1.weight": w1.clone(),
                        f"{dst}experts.{x}.w3.weight": w3.clone(),
                        f"{dst}experts.{x}.w2.weight": state[expert + "linear_fc2.weight"]})
    return out
