"""Hugging Face ``GPT2LMHeadModel`` <-> our GPT-style models (Megatron's default architecture:
LayerNorm with bias, GeLU MLP with biases, learned positions, tied embedding).

Tensor mapping (per-layer names under ``transformer.h.{i}.`` on the HF side and
``decoder.layers.{i}.`` on ours; GPT-2's ``Conv1D`` stores weights as [in, out], so every
matrix is transposed)::

    transformer.wte.weight            <-> embedding.word_embeddings.weight
    transformer.wpe.weight            <-> embedding.position_embeddings.weight
    lm_head.weight (untied only)      <-> output_layer.weight
    transformer.ln_f.{weight,bias}    <-> decoder.final_layernorm.{weight,bias}
    ln_1.{weight,bias}                <-> input_layernorm.{weight,bias}
    ln_2.{weight,bias}                <-> pre_mlp_layernorm.{weight,bias}
    attn.c_attn.{weight,bias}         <-> self_attention.linear_qkv (q | k | v -> per head q, k, v)
    attn.c_proj.{weight,bias}         <-> self_attention.linear_proj
    mlp.c_fc.{weight,bias}            <-> mlp.linear_fc1
    mlp.c_proj.{weight,bias}          <-> mlp.linear_fc2

The activation must match: GPT-2's ``gelu_new`` (and ``gelu_pytorch_tanh``, ``gelu_fast``) is
the tanh approximation Megatron's fused bias-GeLU computes, ``gelu`` the exact one
(``--no-bias-gelu-fusion``), ``relu2`` is ``--squared-relu``. GPT-2 has one key/value head per
query head, head size hidden / heads and biases everywhere. Zero-centred norm scales
(``--apply-layernorm-1p``) are written as the plain scales they mean.
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
from megatron_h2.config import ModelConfig
from megatron_h2.errors import ConfigError

MODEL_TYPE = "gpt2"
ARCHITECTURE = "GPT2LMHeadModel"
EMBED, POSITIONS, HEAD = "transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "squared_relu": "relu2"}
"""Our activation -> the GPT-2 ``activation_function`` that computes it."""

# Per-layer modules that map one-to-one (ours, HF, transposed), without the layer prefixes.
_LAYER = (
    ("input_layernorm", "ln_1", False),
    ("self_attention.linear_proj", "attn.c_proj", True),
    ("pre_mlp_layernorm", "ln_2", False),
    ("mlp.linear_fc1", "mlp.c_fc", True),
    ("mlp.linear_fc2", "mlp.c_proj", True),
)


def model_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Our model fields (all but the vocabulary) for a GPT-2 ``config.json``."""
    act = hf_config.get("activation_function", "gelu_new")
    if act not in (*_TANH_GELUS, "gelu", "relu2"):
        raise ConfigError(f"config.json has activation_function {act!r}; megatron_h2 computes "
                          f"gelu (exact), {'/'.join(_TANH_GELUS)} (tanh GeLU) or relu2")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if hf_config.get(key, want) != want:
            raise ConfigError(f"config.json has {key}={hf_config.get(key)}; megatron_h2's "
                              f"attention needs {key}={want}")
    hidden = get_int(hf_config, "n_embd")
    positions = get_int(hf_config, "n_positions")
    inner = hf_config.get("n_inner")
    return dict(
        num_layers=get_int(hf_config, "n_layer"), hidden_size=hidden,
        num_attention_heads=get_int(hf_config, "n_head"),
        ffn_hidden_size=4 * hidden if inner is None else get_int(hf_config, "n_inner"),
        seq_length=positions, max_position_embeddings=positions,
        norm_epsilon=get_float(hf_config, "layer_norm_epsilon", 1e-5),
        init_method_std=get_float(hf_config, "initializer_range", 0.02),
        hidden_dropout=get_float(hf_config, "resid_pdrop", 0.1),
        attention_dropout=get_float(hf_config, "attn_pdrop", 0.1),
        squared_relu=act == "relu2", bias_gelu_fusion=act != "gelu",
        untie_embeddings_and_output_weights=not hf_config.get("tie_word_embeddings", True))


def unsupported(config: ModelConfig) -> str | None:
    """Why ``config`` cannot be written as a GPT2LMHeadModel (None when it can)."""
    reasons = {"normalization": config.normalization != "LayerNorm",
               f"activation {config.activation}": config.activation not in _ACTIVATIONS,
               f"position embedding {config.position_embedding_type}":
                   config.position_embedding_type != "learned_absolute",
               "grouped-query attention": config.num_query_groups != config.num_attention_heads,
               "--kv-channels other than hidden / heads":
                   config.query_size != config.hidden_size,
               "--disable-bias-linear": not config.add_bias_linear}
    bad = [what for what, is_bad in reasons.items() if is_bad]
    return ", ".join(bad) if bad else None


def hf_config(config: ModelConfig, true_vocab_size: int | None = None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A GPT-2 ``config.json`` dict for ``config`` (``extra`` as in the Llama family)."""
    out = dict(extra or {})
    act = out.get("activation_function")
    if not (config.activation == "gelu_tanh" and act in _TANH_GELUS):
        act = _ACTIVATIONS[config.activation]
    ffn, inner = config.ffn_hidden_size, out.get("n_inner")
    if ffn != 4 * config.hidden_size or inner not in (None, ffn):
        inner = None if ffn == 4 * config.hidden_size else ffn
    out.setdefault("embd_pdrop", config.hidden_dropout)  # Megatron: hidden dropout there too
    out.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE,
               vocab_size=true_vocab_size or config.vocab_size, n_embd=config.hidden_size,
               n_layer=config.num_layers, n_head=config.num_attention_heads, n_inner=inner,
               n_positions=config.max_position_embeddings, activation_function=act,
               layer_norm_epsilon=config.norm_epsilon, initializer_range=config.init_method_std,
               resid_pdrop=config.hidden_dropout, attn_pdrop=config.attention_dropout,
               scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
               tie_word_embeddings=config.tied_embeddings)
    return out


def hf_shapes(config: ModelConfig, vocab: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the HF checkpoint (``vocab`` rows of embeddings)."""
    h, f = config.hidden_size, config.ffn_hidden_size
    shapes: dict[str, tuple[int, ...]] = {EMBED: (vocab, h),
                                          POSITIONS: (config.max_position_embeddings, h)}
    for i in range(config.num_layers):
        p = f"transformer.h.{i}."
        for name, (n_in, n_out) in (("ln_1", (0, h)), ("attn.c_attn", (h, 3 * h)),
                                    ("attn.c_proj", (h, h)), ("ln_2", (0, h)),
                                    ("mlp.c_fc", (h, f)), ("mlp.c_proj", (f, h))):
            shapes[f"{p}{name}.weight"] = (n_in, n_out) if n_in else (n_out,)
            shapes[f"{p}{name}.bias"] = (n_out,)
    shapes.update({"transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)})
    if not config.tied_embeddings:
        shapes[HEAD] = (vocab, h)
    return shapes


def normalize_names(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names as ``GPT2LMHeadModel`` saves them: older files omit the ``transformer.`` prefix and
    keep the causal-mask buffers ``attn.bias`` / ``attn.masked_bias`` (dropped here)."""
    out = {}
    for name, t in hf_state.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        out[name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name] = t
    return out


def _direct_names(config: ModelConfig) -> list[tuple[str, str, bool]]:
    """(our name, HF name, transposed) of every tensor that maps one-to-one."""
    names = [("embedding.position_embeddings.weight", POSITIONS, False)]
    for i in range(config.num_layers):
        names += [(f"decoder.layers.{i}.{ours}.{kind}", f"transformer.h.{i}.{theirs}.{kind}",
                   transposed and kind == "weight")
                  for ours, theirs, transposed in _LAYER for kind in ("weight", "bias")]
    names += [(f"decoder.final_layernorm.{kind}", f"transformer.ln_f.{kind}", False)
              for kind in ("weight", "bias")]
    return names


def _copy(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    return t.T.contiguous() if transposed else t


def to_megatron(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF GPT-2 tensors -> ours for ``config``; the vocabulary is padded with zero rows."""
    hf_state = normalize_names(hf_state)
    vocab = hf_vocab(hf_state, EMBED, config)
    if config.tied_embeddings:
        hf_state = drop_tied_head(hf_state, HEAD, EMBED)
    check_state(hf_state, hf_shapes(config, vocab), "HF checkpoint")
    out = {"embedding.word_embeddings.weight": pad_rows(hf_state[EMBED], config.vocab_size)}
    out.update({ours: _copy(hf_state[theirs], transposed)
                for ours, theirs, transposed in _direct_names(config)})
    for i in range(config.num_layers):
        for kind in ("weight", "bias"):  # c_attn [h, 3h] / [3h]: q | k | v
            t = hf_state[f"transformer.h.{i}.attn.c_attn.{kind}"]
            q, k, v = (t.T if kind == "weight" else t).chunk(3)
            out[f"decoder.layers.{i}.self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v,
                                                                                   config)
    if not config.tied_embeddings:
        out["output_layer.weight"] = pad_rows(hf_state[HEAD], config.vocab_size)
    return out


def to_hf(state: dict[str, torch.Tensor], config: ModelConfig,
          vocab: int) -> dict[str, torch.Tensor]:
    """Our tensors (checked by the caller) -> HF GPT-2 tensors with ``vocab`` rows."""
    vocab = check_vocab(vocab, config)
    out = {EMBED: truncate_rows(state["embedding.word_embeddings.weight"], vocab)}
    out.update({theirs: _copy(unfold_norm(state[ours], ours, config), transposed)
                for ours, theirs, transposed in _direct_names(config)})
    for i in range(config.num_layers):
        for kind in ("weight", "bias"):
            qkv = torch.cat(split_qkv(state[f"decoder.layers.{i}.self_attention.linear_qkv."
                                            f"{kind}"], config))  # [3h, h] or [3h]
            out[f"transformer.h.{i}.attn.c_attn.{kind}"] = _copy(qkv, kind == "weight")
    if not config.tied_embeddings:
        out[HEAD] = truncate_rows(state["output_layer.weight"], vocab)
    return out
