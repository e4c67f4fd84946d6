"""Hugging Face ``Qwen2MoeForCausalLM`` -> our MoE models (one way: a checkpoint of ours is
written back as a Mixtral only when it is one).

A Qwen2-MoE is a LLaMA with a bias on the QKV projection only (``--add-qkv-bias``), some
layers dense (``mlp_only_layers``, ``decoder_sparse_step``: our ``--moe-layer-freq`` list) and
the others MoE blocks with softmax routing over all experts, top-k without renormalisation
(``norm_topk_prob`` false: Megatron's ``--moe-router-pre-softmax``) and a shared expert scaled
by a sigmoid gate (``--moe-shared-expert-gate``). Attention, norms, embeddings and dense MLPs
map as in :mod:`~megatron_h2.checkpointing.hf_llama`; the MoE blocks (per layer under
``model.layers.{i}.`` and ``decoder.layers.{i}.``)::

    mlp.gate.weight [E, h]                 -> mlp.router.weight
    mlp.experts.{e}.{gate,up}_proj.weight  -> mlp.experts.local_experts.{e}.linear_fc1.weight
    mlp.experts.{e}.down_proj.weight       -> mlp.experts.local_experts.{e}.linear_fc2.weight
    mlp.shared_expert.{gate,up}_proj.weight -> mlp.shared_experts.linear_fc1.weight
    mlp.shared_expert.down_proj.weight     -> mlp.shared_experts.linear_fc2.weight
    mlp.shared_expert_gate.weight [1, h]   -> mlp.shared_experts.gate_weight
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_h2.checkpointing import hf_llama
from megatron_h2.checkpointing.hf_tensors import check_state, fuse_qkv, get_int
from megatron_h2.config import ModelConfig
from megatron_h2.errors import ConfigError

MODEL_TYPE = "qwen2_moe"
ARCHITECTURE = "Qwen2MoeForCausalLM"
EMBED, HEAD = hf_llama.EMBED, hf_llama.HEAD


def model_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Our model fields (all but the vocabulary) for a Qwen2-MoE ``config.json``."""
    if hf_config.get("use_sliding_window"):
        raise ConfigError("config.json sets use_sliding_window; megatron_h2 attends over the "
                          "whole sequence")
    dense = {k: v for k, v in hf_config.items() if k not in ("attention_bias", "mlp_bias")}
    fields = hf_llama.model_fields(dense)
    layers, step = fields["num_layers"], get_int(hf_config, "decoder_sparse_step", 1)
    dense_only = set(hf_config.get("mlp_only_layers") or [])
    shared = get_int(hf_config, "shared_expert_intermediate_size", 0)
    fields.update(
        add_qkv_bias=bool(hf_config.get("qkv_bias", True)),
        num_experts=get_int(hf_config, "num_experts"),
        moe_router_topk=get_int(hf_config, "num_experts_per_tok"),
        moe_ffn_hidden_size=get_int(hf_config, "moe_intermediate_size"),
        moe_router_pre_softmax=not hf_config.get("norm_topk_prob", False),
        moe_layer_freq=[int(i not in dense_only and (i + 1) % step == 0)
                        for i in range(layers)],
        moe_shared_expert_intermediate_size=shared or None, moe_shared_expert_gate=shared > 0)
    return fields


def unsupported(config: ModelConfig) -> str | None:
    """Our checkpoints are not written as Qwen2-MoE (see :mod:`hf_mixtral`)."""
    return "conversion to Qwen2MoeForCausalLM is not implemented"


def _moe_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, f, e = config.hidden_size, config.moe_ffn_hidden_size, config.num_experts
    shapes: dict[str, tuple[int, ...]] = {}
    for i in config.moe_layers:
        p = f"model.layers.{i}.mlp."
        shapes[p + "gate.weight"] = (e, h)
        for x in range(e):
            shapes.update({f"{p}experts.{x}.gate_proj.weight": (f, h),
                           f"{p}experts.{x}.up_proj.weight": (f, h),
                           f"{p}experts.{x}.down_proj.weight": (h, f)})
        s = config.moe_shared_expert_intermediate_size
        if s:
            shapes.update({p + "shared_expert.gate_proj.weight": (s, h),
                           p + "shared_expert.up_proj.weight": (s, h),
                           p + "shared_expert.down_proj.weight": (h, s),
                           p + "shared_expert_gate.weight": (1, h)})
    return shapes


def _fc1(state: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    return torch.cat([state[prefix + "gate_proj.weight"], state[prefix + "up_proj.weight"]])


def to_megatron(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF Qwen2-MoE tensors -> ours for ``config``; the vocabulary is padded with zero rows."""
    expected = _moe_shapes(config)
    moe = {k: v for k, v in hf_state.items() if k in expected}
    check_state(moe, expected, "HF checkpoint")
    qkv_bias = {k: v for k, v in hf_state.items()
                if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))}
    dense = {k: v for k, v in hf_state.items() if k not in moe and k not in qkv_bias}
    out = hf_llama.to_megatron(dense, config)
    for i in range(config.num_layers):
        attn = f"model.layers.{i}.self_attn."
        if config.add_qkv_bias:
            out[f"decoder.layers.{i}.self_attention.linear_qkv.bias"] = fuse_qkv(
                *(qkv_bias[f"{attn}{x}_proj.bias"] for x in "qkv"), config)
    for i in config.moe_layers:
        src, dst = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
        out[dst + "router.weight"] = moe[src + "gate.weight"]
        for x in range(config.num_experts):
            expert = f"{dst}experts.local_experts.{x}."
            out[expert + "linear_fc1.weight"] = _fc1(moe, f"{src}experts.{x}.")
            out[expert + "linear_fc2.weight"] = moe[f"{src}experts.{x}.down_proj.weight"]
        if config.moe_shared_expert_intermediate_size:
            out[dst + "shared_experts.linear_fc1.weight"] = _fc1(moe, src + "shared_expert.")
            out[dst + "shared_experts.linear_fc2.weight"] = moe[src + "shared_expert.down_proj"
                                                                ".weight"]
            out[dst + "shared_experts.gate_weight"] = moe[src + "shared_expert_gate.weight"]
    return out
