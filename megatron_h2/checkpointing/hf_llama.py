"""Hugging Face ``LlamaForCausalLM`` <-> our LLaMA-style models (RMSNorm, SwiGLU, rotary).

Tensor mapping (nh heads, ng query groups, d head size, h hidden size, f FFN size; per-layer
names are under ``model.layers.{i}.`` on the HF side and ``decoder.layers.{i}.`` on ours)::

    model.embed_tokens.weight                <-> embedding.word_embeddings.weight
    lm_head.weight (untied only)             <-> output_layer.weight
    model.norm.weight                        <-> decoder.final_layernorm.weight
    input_layernorm.weight                   <-> input_layernorm.weight
    post_attention_layernorm.weight          <-> pre_mlp_layernorm.weight
    self_attn.o_proj.{weight,bias}           <-> self_attention.linear_proj.{weight,bias}
    mlp.down_proj.{weight,bias}              <-> mlp.linear_fc2.{weight,bias}
    self_attn.{q,k,v}_proj.{weight,bias}     <-> self_attention.linear_qkv.{weight,bias} (fused)
    mlp.{gate,up}_proj.{weight,bias}         <-> mlp.linear_fc1.{weight,bias} (fused [gate; up])

Biases exist with ``attention_bias`` and ``mlp_bias`` (both: our biases in every linear layer).
Zero-centred norm scales (``--apply-layernorm-1p``) are written as the plain scales they mean.
A MoE model's attention, norms, embeddings and dense MLPs map the same way (``hf_mixtral`` and
``hf_qwen2_moe`` add its MoE blocks). Both sides use the rotate-half RoPE convention, so no head
permutation is needed. RoPE scaling maps to Megatron's flags: ``llama3`` (with Megatron's fixed
constants) to ``--use-rope-scaling --rope-scaling-factor``, ``linear`` (an integral factor) to
``--rotary-seq-len-interpolation-factor``.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_h2.checkpointing.hf_tensors import (
    check_state,
    check_vocab,
    drop_tied_head,
    fuse_qkv,
    get_float,
    get_int,
    hf_vocab,
    pad_rows,
    split_qkv,
    truncate_rows,
    unfold_norm,
)
from megatron_h2.config import LLAMA_ARCHITECTURE, ModelConfig
from megatron_h2.errors import ConfigError

MODEL_TYPE = "llama"
ARCHITECTURE = "LlamaForCausalLM"
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
_SILU_NAMES = ("silu", "swish")
LLAMA3_CONSTANTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
"""The Llama 3 rope-scaling constants Megatron's ``--use-rope-scaling`` fixes."""

# Per-layer tensors that map one-to-one (ours, HF), without the layer prefixes; biases of the
# linear ones follow their weights.
_LAYER_DIRECT = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ("self_attention.linear_proj", "self_attn.o_proj"),
    ("mlp.linear_fc2", "mlp.down_proj"),
)


def _rope_section(hf_config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The RoPE parameters (``rope_parameters`` of transformers 5, else the older top-level
    ``rope_theta`` and ``rope_scaling``) and where they came from."""
    for key in ("rope_parameters", "rope_scaling"):
        section = hf_config.get(key)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ConfigError(f"config.json field {key!r} must be an object, got {section!r}")
        return key, section
    return "rope_theta", {}


def _rope_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Our rotary fields for the HF RoPE settings; one-line refusal of what Megatron lacks."""
    key, section = _rope_section(hf_config)
    theta = section.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise ConfigError(f"config.json rope_theta must be a positive number, got {theta!r}")
    if section.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError("config.json sets partial_rotary_factor; LlamaForCausalLM rotates the "
                          "whole head dimension, so megatron_h2 cannot match it")
    fields: dict[str, Any] = {"rotary_base": float(theta)}
    rope_type = section.get("rope_type", section.get("type", "default"))
    factor = section.get("factor")
    if rope_type == "llama3":
        odd = {k: section.get(k) for k, v in LLAMA3_CONSTANTS.items() if section.get(k) != v}
        if odd:
            raise ConfigError(f"config.json uses llama3 RoPE scaling with {odd}; Megatron's "
                              f"--use-rope-scaling fixes {LLAMA3_CONSTANTS}")
        fields.update(use_rope_scaling=True, rope_scaling_factor=get_float(section, "factor", 8.0))
    elif rope_type == "linear":
        if isinstance(factor, bool) or not isinstance(factor, int | float) \
                or factor != int(factor) or factor < 1:
            raise ConfigError(f"config.json uses linear RoPE scaling with factor {factor!r}; "
                              "--rotary-seq-len-interpolation-factor takes an integer >= 1")
        fields["rotary_seq_len_interpolation_factor"] = int(factor)
    elif rope_type != "default":
        raise ConfigError(f"config.json uses {rope_type!r} RoPE scaling ({key}); megatron_h2 "
                          "supports default, linear and llama3 RoPE")
    return fields


def _bias(hf_config: dict[str, Any]) -> bool:
    attention, mlp = bool(hf_config.get("attention_bias")), bool(hf_config.get("mlp_bias"))
    if attention != mlp:
        raise ConfigError(f"config.json has attention_bias={attention} but mlp_bias={mlp}; "
                          "megatron_h2 has biases in every linear layer or in none")
    return attention


def model_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Our model fields (all but the vocabulary) for a Llama ``config.json``."""
    act = hf_config.get("hidden_act", "silu")
    if act not in _SILU_NAMES:
        raise ConfigError(f"config.json has hidden_act {act!r}; a Llama converts only with silu "
                          "(SwiGLU)")
    heads = get_int(hf_config, "num_attention_heads")
    max_pos = get_int(hf_config, "max_position_embeddings")
    return dict(
        LLAMA_ARCHITECTURE, num_layers=get_int(hf_config, "num_hidden_layers"),
        hidden_size=get_int(hf_config, "hidden_size"), num_attention_heads=heads,
        group_query_attention=True,  # as Megatron's Llama loader, also when groups == heads
        num_query_groups=get_int(hf_config, "num_key_value_heads", heads),
        kv_channels=None if hf_config.get("head_dim") is None else get_int(hf_config, "head_dim"),
        ffn_hidden_size=get_int(hf_config, "intermediate_size"),
        seq_length=max_pos, max_position_embeddings=max_pos,
        norm_epsilon=get_float(hf_config, "rms_norm_eps", 1e-6),
        init_method_std=get_float(hf_config, "initializer_range", 0.02),
        attention_dropout=get_float(hf_config, "attention_dropout", 0.0), hidden_dropout=0.0,
        add_bias_linear=_bias(hf_config),
        untie_embeddings_and_output_weights=not hf_config.get("tie_word_embeddings", False),
        **_rope_fields(hf_config))


def unsupported(config: ModelConfig, moe: bool = False) -> str | None:
    """Why ``config`` cannot be written as a LlamaForCausalLM (None when it can); ``moe``:
    judge everything but the MLPs (a Mixtral's MoE blocks are judged by its module)."""
    reasons = {"mixture-of-experts layers": config.is_moe and not moe,
               "normalization": config.normalization != "RMSNorm",
               f"activation {config.activation}": config.activation != "swiglu",
               f"position embedding {config.position_embedding_type}":
                   config.position_embedding_type != "rope",
               "--rotary-percent < 1": config.rotary_percent < 1.0,
               "--add-qkv-bias without the other biases":
                   config.add_qkv_bias and not config.add_bias_linear,
               "both --use-rope-scaling and --rotary-seq-len-interpolation-factor":
                   config.use_rope_scaling
                   and config.rotary_seq_len_interpolation_factor is not None}
    bad = [what for what, is_bad in reasons.items() if is_bad]
    return ", ".join(bad) if bad else None


def _rope_parameters(config: ModelConfig) -> dict[str, Any]:
    if config.use_rope_scaling:
        return {"rope_type": "llama3", "factor": config.rope_scaling_factor, **LLAMA3_CONSTANTS}
    if config.rotary_seq_len_interpolation_factor is not None:
        return {"rope_type": "linear", "factor": float(config.rotary_seq_len_interpolation_factor)}
    return {"rope_type": "default"}


def hf_config(config: ModelConfig, true_vocab_size: int | None = None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Llama ``config.json`` dict for ``config``; ``extra`` (the HF config recorded at
    import) supplies the fields we do not model, ours overwrite the rest."""
    out = dict(extra or {})
    out.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE,
               vocab_size=true_vocab_size or config.vocab_size,
               hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
               num_hidden_layers=config.num_layers,
               num_attention_heads=config.num_attention_heads,
               num_key_value_heads=config.num_query_groups, head_dim=config.kv_channels,
               max_position_embeddings=config.max_position_embeddings,
               rms_norm_eps=config.norm_epsilon, initializer_range=config.init_method_std,
               attention_dropout=config.attention_dropout,
               tie_word_embeddings=config.tied_embeddings,
               attention_bias=config.add_bias_linear, mlp_bias=config.add_bias_linear)
    if out.get("hidden_act") not in _SILU_NAMES:
        out["hidden_act"] = "silu"
    rope = _rope_parameters(config)
    if "rope_theta" in out and "rope_parameters" not in out:  # keep an older file's layout
        out["rope_theta"] = config.rotary_base
        out["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    else:
        old = dict(out.get("rope_parameters") or {})
        kept = {k: v for k, v in old.items() if k not in ("rope_type", "type", "factor",
                                                         *LLAMA3_CONSTANTS)}
        out["rope_parameters"] = {**kept, **rope, "rope_theta": config.rotary_base}
    return out


def hf_shapes(config: ModelConfig, vocab: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the HF checkpoint (``vocab`` rows of embeddings)."""
    h, f, d = config.hidden_size, config.ffn_hidden_size, config.kv_channels
    nh, ng = config.num_attention_heads, config.num_query_groups
    shapes: dict[str, tuple[int, ...]] = {EMBED: (vocab, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layer = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (nh * d, h),
                 "self_attn.k_proj.weight": (ng * d, h), "self_attn.v_proj.weight": (ng * d, h),
                 "self_attn.o_proj.weight": (h, nh * d), "post_attention_layernorm.weight": (h,),
                 "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
                 "mlp.down_proj.weight": (h, f)}
        if config.is_moe_layer(i):  # a MoE block is its family's module's
            layer = {n: s for n, s in layer.items() if not n.startswith("mlp.")}
        if config.add_bias_linear:
            layer.update({n.replace(".weight", ".bias"): s[:1] for n, s in layer.items()
                          if "proj" in n})
        shapes.update({p + n: s for n, s in layer.items()})
    shapes["model.norm.weight"] = (h,)
    if not config.tied_embeddings:
        shapes[HEAD] = (vocab, h)
    return shapes


def _kinds(config: ModelConfig) -> tuple[str, ...]:
    return ("weight", "bias") if config.add_bias_linear else ("weight",)


def _direct_names(config: ModelConfig) -> list[tuple[str, str]]:
    """(our name, HF name) of every tensor that maps one-to-one."""
    names = [("decoder.final_layernorm.weight", "model.norm.weight")]
    for i in range(config.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for ours, theirs in _LAYER_DIRECT:
            if config.is_moe_layer(i) and ours.startswith("mlp."):
                continue
            kinds = ("",) if ours.endswith(".weight") else tuple(f".{k}" for k in _kinds(config))
            names += [(src + ours + kind, dst + theirs + kind) for kind in kinds]
    return names


def to_megatron(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF Llama tensors -> ours for ``config``; the vocabulary is padded with zero rows."""
    vocab = hf_vocab(hf_state, EMBED, config)
    if config.tied_embeddings:
        hf_state = drop_tied_head(hf_state, HEAD, EMBED)
    check_state(hf_state, hf_shapes(config, vocab), "HF checkpoint")
    out = {"embedding.word_embeddings.weight": pad_rows(hf_state[EMBED], config.vocab_size)}
    out.update({ours: hf_state[theirs] for ours, theirs in _direct_names(config)})
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in _kinds(config):
            attn = src + "self_attn."
            out[dst + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(
                hf_state[attn + f"q_proj.{kind}"], hf_state[attn + f"k_proj.{kind}"],
                hf_state[attn + f"v_proj.{kind}"], config)
            if config.is_moe_layer(i):
                continue
            out[dst + f"mlp.linear_fc1.{kind}"] = torch.cat(
                [hf_state[src + f"mlp.gate_proj.{kind}"], hf_state[src + f"mlp.up_proj.{kind}"]])
    if not config.tied_embeddings:
        out["output_layer.weight"] = pad_rows(hf_state[HEAD], config.vocab_size)
    return out


def to_hf(state: dict[str, torch.Tensor], config: ModelConfig,
          vocab: int) -> dict[str, torch.Tensor]:
    """Our tensors (checked by the caller) -> HF Llama tensors with ``vocab`` rows."""
    vocab = check_vocab(vocab, config)
    out = {EMBED: truncate_rows(state["embedding.word_embeddings.weight"], vocab)}
    out.update({theirs: unfold_norm(state[ours], ours, config)
                for ours, theirs in _direct_names(config)})
    for i in range(config.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for kind in _kinds(config):
            q, k, v = split_qkv(state[src + f"self_attention.linear_qkv.{kind}"], config)
            out.update({dst + f"self_attn.q_proj.{kind}": q, dst + f"self_attn.k_proj.{kind}": k,
                        dst + f"self_attn.v_proj.{kind}": v})
            if config.is_moe_layer(i):
                continue
            gate, up = state[src + f"mlp.linear_fc1.{kind}"].chunk(2)
            out[dst + f"mlp.gate_proj.{kind}"] = gate.clone()
            out[dst + f"mlp.up_proj.{kind}"] = up.clone()
    if not config.tied_embeddings:
        out[HEAD] = truncate_rows(state["output_layer.weight"], vocab)
    return out
