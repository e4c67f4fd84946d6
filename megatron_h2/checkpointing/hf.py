"""Conversion between Hugging Face Llama checkpoints and megatron_h2 checkpoints.

The Hugging Face side is the directory ``LlamaForCausalLM.save_pretrained`` writes:
``config.json`` plus either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Our side is the format of
:mod:`megatron_h2.checkpointing.format`. Only safetensors and JSON are read and written;
nothing is unpickled and transformers is not imported.

Tensor mapping (shapes use nh heads, ng query groups, d head size, h hidden size, f FFN size;
per-layer names are under ``model.layers.{i}.`` on the HF side and ``decoder.layers.{i}.`` on
ours)::

    model.embed_tokens.weight                <-> embedding.word_embeddings.weight
    lm_head.weight                           <-> output_layer.weight
    model.norm.weight                        <-> decoder.final_layernorm.weight
    input_layernorm.weight                   <-> input_layernorm.weight
    post_attention_layernorm.weight          <-> pre_mlp_layernorm.weight
    self_attn.o_proj.weight                  <-> self_attention.linear_proj.weight
    mlp.down_proj.weight                     <-> mlp.linear_fc2.weight
    self_attn.{q,k,v}_proj.weight            <-> self_attention.linear_qkv.weight (fused)
    mlp.{gate,up}_proj.weight                <-> mlp.linear_fc1.weight (fused)

``linear_qkv`` [(nh + 2 ng) d, h] holds, for each query group, that group's query heads, then
its key head, then its value head. ``linear_fc1`` [2f, h] is [gate; up]. Both sides use the
rotate-half RoPE convention, so no head permutation is needed. Our vocabulary is padded with
zero rows to a multiple of ``make_vocab_size_divisible_by``; the true size and the original HF
config are kept in ``metadata["hf"]`` so that converting back is exact.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_h2.checkpointing.format import (
    LATEST_FILE,
    load_checkpoint,
    save_checkpoint,
)
from megatron_h2.config import DataConfig, ModelConfig, RunConfig
from megatron_h2.errors import ConfigError

HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
HF_GENERATION_FILE = "generation_config.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 2**30  # bytes per safetensors shard when writing HF checkpoints

_SILU_NAMES = ("silu", "swish")

# Per-layer tensors that map one-to-one (ours, HF), without the layer prefixes.
_LAYER_DIRECT = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
)


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

def _get_int(hf_config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = hf_config.get(key, default)
    if value is None:
        raise ConfigError(f"config.json has no {key!r}; it is not a complete Llama config")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.json field {key!r} must be an integer, got {value!r}")
    return value


def _get_float(hf_config: dict[str, Any], key: str, default: float) -> float:
    value = hf_config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"config.json field {key!r} must be a number, got {value!r}")
    return float(value)


def _rope_theta(hf_config: dict[str, Any]) -> float:
    """RoPE base from ``rope_parameters`` (transformers 5) or ``rope_theta`` (older)."""
    params = hf_config.get("rope_parameters")
    theta = hf_config.get("rope_theta", 10000.0)
    for key in ("rope_parameters", "rope_scaling"):
        section = hf_config.get(key)
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ConfigError(f"config.json field {key!r} must be an object, got {section!r}")
        rope_type = section.get("rope_type", section.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"config.json uses {rope_type!r} RoPE scaling ({key}); megatron_h2 "
                              "supports only default RoPE")
        if section.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError("config.json sets partial_rotary_factor; megatron_h2 rotates the "
                              "whole head dimension")
    if hf_config.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("config.json sets partial_rotary_factor; megatron_h2 rotates the "
                          "whole head dimension")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = params["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise ConfigError(f"config.json rope_theta must be a positive number, got {theta!r}")
    return float(theta)


def _check_supported(hf_config: dict[str, Any]) -> None:
    """Refuse Llama features our GPTModel cannot represent."""
    model_type = hf_config.get("model_type", "llama")
    if model_type != "llama":
        raise ConfigError(f"config.json has model_type {model_type!r}; only Llama ('llama') "
                          "checkpoints can be converted")
    if hf_config.get("tie_word_embeddings", False):
        raise ConfigError("config.json has tie_word_embeddings=true; megatron_h2 keeps separate "
                          "input and output embeddings - untie them before converting")
    for key in ("attention_bias", "mlp_bias"):
        if hf_config.get(key, False):
            raise ConfigError(f"config.json has {key}=true; megatron_h2 layers have no biases")
    act = hf_config.get("hidden_act", "silu")
    if act not in _SILU_NAMES:
        raise ConfigError(f"config.json has hidden_act {act!r}; megatron_h2 supports only silu "
                          "(SwiGLU)")


def model_config_from_hf(hf_config: dict[str, Any],
                         make_vocab_size_divisible_by: int = 128) -> ModelConfig:
    """Our model shape for a Hugging Face Llama ``config.json`` dict.

    ``vocab_size`` is padded to a multiple of ``make_vocab_size_divisible_by`` and
    ``seq_length`` is set to ``max_position_embeddings``. Raises :class:`ConfigError` for
    anything the model cannot represent (tied embeddings, biases, RoPE scaling, ...).
    """
    _check_supported(hf_config)
    hidden = _get_int(hf_config, "hidden_size")
    heads = _get_int(hf_config, "num_attention_heads")
    head_dim = hf_config.get("head_dim")
    if head_dim is not None and heads > 0 and head_dim * heads != hidden:
        raise ConfigError(f"config.json has head_dim {head_dim} but hidden_size / "
                          f"num_attention_heads is {hidden / heads:g}; megatron_h2 needs "
                          "head_dim = hidden / heads")
    vocab = _get_int(hf_config, "vocab_size")
    padded = DataConfig(make_vocab_size_divisible_by=make_vocab_size_divisible_by) \
        .padded_vocab_size(vocab)
    max_pos = _get_int(hf_config, "max_position_embeddings")
    fields = dict(
        num_layers=_get_int(hf_config, "num_hidden_layers"), hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=_get_int(hf_config, "num_key_value_heads", heads),
        ffn_hidden_size=_get_int(hf_config, "intermediate_size"),
        seq_length=max_pos, max_position_embeddings=max_pos, vocab_size=padded,
        norm_epsilon=_get_float(hf_config, "rms_norm_eps", 1e-6),
        rotary_base=_rope_theta(hf_config),
        init_method_std=_get_float(hf_config, "initializer_range", 0.02),
        attention_dropout=_get_float(hf_config, "attention_dropout", 0.0), hidden_dropout=0.0)
    try:
        return ModelConfig(**fields)
    except ConfigError as exc:
        raise ConfigError(f"config.json describes a model megatron_h2 cannot build: {exc}") \
            from None


def hf_config_from_model(config: ModelConfig, true_vocab_size: int | None = None,
                         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Llama ``config.json`` dict for ``config``.

    ``extra`` (typically the HF config recorded at import) supplies every field we do not
    model - token ids, dtype, transformers version - and the fields we do model are overwritten
    from ``config``. ``true_vocab_size`` (default: ``config.vocab_size``) is the unpadded size.
    """
    out = dict(extra or {})
    out.update(architectures=["LlamaForCausalLM"], model_type="llama",
               vocab_size=true_vocab_size or config.vocab_size,
               hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
               num_hidden_layers=config.num_layers,
               num_attention_heads=config.num_attention_heads,
               num_key_value_heads=config.num_query_groups, head_dim=config.kv_channels,
               max_position_embeddings=config.max_position_embeddings,
               rms_norm_eps=config.norm_epsilon, initializer_range=config.init_method_std,
               attention_dropout=config.attention_dropout, tie_word_embeddings=False,
               attention_bias=False, mlp_bias=False)
    if out.get("hidden_act") not in _SILU_NAMES:
        out["hidden_act"] = "silu"
    if "rope_theta" in out and "rope_parameters" not in out:  # keep an older file's layout
        out["rope_theta"] = config.rotary_base
    else:
        rope = dict(out.get("rope_parameters") or {})
        rope.update(rope_type="default", rope_theta=config.rotary_base)
        out["rope_parameters"] = rope
    return out


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------

def _check_state(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                 what: str) -> None:
    """Every expected tensor present with its shape, and nothing else."""
    missing = [k for k in expected if k not in state]
    if missing:
        raise ConfigError(f"{what} has no tensor {missing[0]} ({len(missing)} missing); it does "
                          "not match its config")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ConfigError(f"{what} has unexpected tensor {unexpected[0]} "
                          f"({len(unexpected)} unexpected); it does not match its config")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ConfigError(f"{what} tensor {name} has shape {list(state[name].shape)}, its "
                              f"config implies {list(shape)}")


def _hf_shapes(config: ModelConfig, vocab: int) -> dict[str, tuple[int, ...]]:
    h, f, d = config.hidden_size, config.ffn_hidden_size, config.kv_channels
    nh, ng = config.num_attention_heads, config.num_query_groups
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (nh * d, h),
                       p + "self_attn.k_proj.weight": (ng * d, h),
                       p + "self_attn.v_proj.weight": (ng * d, h),
                       p + "self_attn.o_proj.weight": (h, nh * d),
                       p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (vocab, h)})
    return shapes


def _megatron_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, f, d = config.hidden_size, config.ffn_hidden_size, config.kv_channels
    nh, ng, v = config.num_attention_heads, config.num_query_groups, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (v, h)}
    for i in range(config.num_layers):
        p = f"decoder.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,),
                       p + "self_attention.linear_qkv.weight": ((nh + 2 * ng) * d, h),
                       p + "self_attention.linear_proj.weight": (h, nh * d),
                       p + "pre_mlp_layernorm.weight": (h,),
                       p + "mlp.linear_fc1.weight": (2 * f, h),
                       p + "mlp.linear_fc2.weight": (h, f)})
    shapes.update({"decoder.final_layernorm.weight": (h,), "output_layer.weight": (v, h)})
    return shapes


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              config: ModelConfig) -> torch.Tensor:
    """HF q [nh d, h], k/v [ng d, h] -> our per-group layout [(nh + 2 ng) d, h]."""
    ng, d, h = config.num_query_groups, config.kv_channels, config.hidden_size
    per_group = config.num_attention_heads // ng
    grouped = torch.cat([q.reshape(ng, per_group * d, h), k.reshape(ng, d, h),
                         v.reshape(ng, d, h)], dim=1)  # [ng, (nh/ng + 2) d, h]
    return grouped.reshape(-1, h)


def _split_qkv(qkv: torch.Tensor,
               config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_fuse_qkv`."""
    ng, d, h = config.num_query_groups, config.kv_channels, config.hidden_size
    per_group = config.num_attention_heads // ng
    grouped = qkv.reshape(ng, (per_group + 2) * d, h)
    q, k, v = (t.reshape(-1, h).clone(memory_format=torch.contiguous_format)
               for t in grouped.split([per_group * d, d, d], dim=1))
    return q, k, v


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _truncate_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    # A copy, so that the result does not share storage (safetensors refuses shared tensors).
    return t if t.shape[0] == rows else t[:rows].clone()


def hf_to_megatron_state(hf_state: dict[str, torch.Tensor],
                         config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF Llama tensors -> our tensors for ``config`` (whose vocab may be padded).

    The HF vocabulary is read from ``model.embed_tokens.weight`` and padded with zero rows to
    ``config.vocab_size``. Dtypes are kept as they are.
    """
    embed = hf_state.get("model.embed_tokens.weight")
    if embed is None:
        raise ConfigError("HF checkpoint has no tensor model.embed_tokens.weight")
    vocab = embed.shape[0]
    if vocab > config.vocab_size:
        raise ConfigError(f"HF vocabulary {vocab} exceeds the model vocab_size "
                          f"{config.vocab_size}")
    _check_state(hf_state, _hf_shapes(config, vocab), "HF checkpoint")
    out = {"embedding.word_embeddings.weight": _pad_rows(embed, config.vocab_size)}
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for ours, theirs in _LAYER_DIRECT:
            out[dst + ours] = hf_state[src + theirs]
        attn = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            hf_state[attn + "q_proj.weight"], hf_state[attn + "k_proj.weight"],
            hf_state[attn + "v_proj.weight"], config)
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf_state[src + "mlp.gate_proj.weight"], hf_state[src + "mlp.up_proj.weight"]])
    out["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"]
    out["output_layer.weight"] = _pad_rows(hf_state["lm_head.weight"], config.vocab_size)
    return out


def megatron_to_hf_state(state: dict[str, torch.Tensor], config: ModelConfig,
                         true_vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Our tensors -> HF Llama tensors, truncating the vocabulary to ``true_vocab_size``
    (default: ``config.vocab_size``, no truncation)."""
    vocab = true_vocab_size or config.vocab_size
    if not 0 < vocab <= config.vocab_size:
        raise ConfigError(f"true vocab size {vocab} must be between 1 and the padded vocab_size "
                          f"{config.vocab_size}")
    _check_state(state, _megatron_shapes(config), "megatron_h2 checkpoint")
    out = {"model.embed_tokens.weight": _truncate_rows(state["embedding.word_embeddings.weight"],
                                                       vocab)}
    for i in range(config.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for ours, theirs in _LAYER_DIRECT:
            out[dst + theirs] = state[src + ours]
        q, k, v = _split_qkv(state[src + "self_attention.linear_qkv.weight"], config)
        out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                    dst + "self_attn.v_proj.weight": v})
        gate, up = state[src + "mlp.linear_fc1.weight"].chunk(2)
        out[dst + "mlp.gate_proj.weight"] = gate.clone()
        out[dst + "mlp.up_proj.weight"] = up.clone()
    out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = _truncate_rows(state["output_layer.weight"], vocab)
    return out


# ---------------------------------------------------------------------------------------------
# Hugging Face directories
# ---------------------------------------------------------------------------------------------

def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _read_safetensors(path: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as fh:
            return {n: fh.get_tensor(n) for n in (fh.keys() if names is None else names)}
    except (SafetensorError, OSError, RuntimeError) as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"cannot read {path}: {reason}") from None


def read_hf_weights(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF model directory (single file or sharded with an index)."""
    path = Path(model_dir)
    if (path / HF_WEIGHTS_FILE).is_file():
        tensors = _read_safetensors(path / HF_WEIGHTS_FILE)
    elif (path / HF_INDEX_FILE).is_file():
        weight_map = _read_json(path / HF_INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{path / HF_INDEX_FILE} has no weight_map")
        by_file: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str):
                raise ConfigError(f"{path / HF_INDEX_FILE} maps {name} to {file!r}, not a file")
            by_file.setdefault(file, []).append(name)
        tensors = {}
        for file, names in sorted(by_file.items()):
            if not (path / file).is_file():
                raise ConfigError(f"{path / HF_INDEX_FILE} lists shard {file}, which is missing")
            tensors.update(_read_safetensors(path / file, names))
    else:
        raise ConfigError(f"{path} has neither {HF_WEIGHTS_FILE} nor {HF_INDEX_FILE}; re-save "
                          "the model with save_pretrained(safe_serialization=True)")
    # Old transformers versions saved the (recomputable) rotary frequencies.
    return {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def write_hf_weights(model_dir: str | os.PathLike, tensors: dict[str, torch.Tensor],
                     max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """Write ``model.safetensors``, or shards plus an index when the tensors exceed
    ``max_shard_size`` bytes (as ``save_pretrained`` does); returns the file names."""
    if max_shard_size <= 0:
        raise ConfigError(f"max shard size must be a positive number of bytes, got "
                          f"{max_shard_size}")
    path = Path(model_dir)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    shards = _shards(tensors, max_shard_size)
    if len(shards) == 1:
        save_file(shards[0], str(path / HF_WEIGHTS_FILE), metadata={"format": "pt"})
        return [HF_WEIGHTS_FILE]
    names, weight_map = [], {}
    for n, shard in enumerate(shards, start=1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        names.append(name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / HF_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names


def _existing_dir(path: str | os.PathLike) -> Path:
    src = Path(path)
    if not src.is_dir():
        raise ConfigError(f"input directory {src} does not exist")
    return src


def _check_output(path: str | os.PathLike, megatron: bool) -> Path:
    """Refuse an output that is a file or already holds a checkpoint (checked before any work)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output {out} exists and is not a directory")
    if out.is_dir():
        taken = ((out / LATEST_FILE).exists() or any(out.glob("iter_*")) if megatron
                 else (out / HF_CONFIG_FILE).exists() or any(out.glob("*.safetensors")))
        if taken:
            raise ConfigError(f"output directory {out} already holds a checkpoint; choose a new "
                              "or empty directory")
    return out


def read_hf_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of an HF model directory, as a dict."""
    path = _existing_dir(model_dir) / HF_CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{path.parent} has no {HF_CONFIG_FILE}; point the input at a Hugging "
                          "Face model directory (the output of save_pretrained)")
    return _read_json(path)


def convert_hf_to_megatron(input_dir: str | os.PathLike, output_dir: str | os.PathLike,
                           make_vocab_size_divisible_by: int = 128) -> Path:
    """Convert an HF Llama directory into a megatron_h2 checkpoint at iteration 0.

    The metadata records the run config (``config``), the true vocabulary size and the full HF
    config (``hf``) so that :func:`convert_megatron_to_hf` restores them. No optimizer state is
    written. Returns the iteration directory.
    """
    src = _existing_dir(input_dir)
    out = _check_output(output_dir, megatron=True)
    hf_config = read_hf_config(src)
    config = model_config_from_hf(hf_config, make_vocab_size_divisible_by)
    hf_state = read_hf_weights(src)
    embed = hf_state.get("model.embed_tokens.weight")
    true_vocab = hf_config["vocab_size"]
    if embed is not None and embed.shape[0] != true_vocab:
        raise ConfigError(f"{src} embeds {embed.shape[0]} tokens but config.json says vocab_size "
                          f"{true_vocab}; fix config.json")
    state = hf_to_megatron_state(hf_state, config)
    hf_meta: dict[str, Any] = {"vocab_size": true_vocab, "config": hf_config}
    if (src / HF_GENERATION_FILE).is_file():
        hf_meta["generation_config"] = _read_json(src / HF_GENERATION_FILE)
    run = RunConfig(model=config,
                    data=DataConfig(make_vocab_size_divisible_by=make_vocab_size_divisible_by))
    metadata = {"config": run.to_dict(), "hf": hf_meta, "converted_from": "hf",
                "consumed_samples": 0}
    return save_checkpoint(out, 0, state, None, metadata)


def _model_config_from_metadata(metadata: dict[str, Any], path: Path | None,
                                 state: dict[str, torch.Tensor]) -> ModelConfig:
    section = metadata.get("config")
    model = section.get("model") if isinstance(section, dict) else None
    if not isinstance(model, dict):
        raise ConfigError(f"checkpoint {path} metadata has no config.model section; it was not "
                          "written by megatron_h2")
    unknown = sorted(set(model) - {f.name for f in dataclasses.fields(ModelConfig)})
    if unknown:
        raise ConfigError(f"checkpoint {path} model config has unknown key {unknown[0]!r}")
    try:
        config = ModelConfig(**model)
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"checkpoint {path} has an invalid model config: {exc}") from None
    embed = state.get("embedding.word_embeddings.weight")
    if config.vocab_size <= 0 and embed is not None:  # vocab never filled in: trust the tensor
        config = dataclasses.replace(config, vocab_size=embed.shape[0])
    return config


def _recorded_vocab(hf_meta: dict[str, Any], path: Path | None) -> int | None:
    vocab = hf_meta.get("vocab_size")
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int)):
        raise ConfigError(f"checkpoint {path} metadata hf.vocab_size must be an integer, "
                          f"got {vocab!r}")
    return vocab


def convert_megatron_to_hf(input_dir: str | os.PathLike, output_dir: str | os.PathLike,
                           iteration: int | None = None,
                           max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Convert a megatron_h2 checkpoint (default: the latest iteration) into an HF Llama
    directory that ``LlamaForCausalLM.from_pretrained`` loads. Returns the output directory.

    The vocabulary is truncated to the size recorded at import (``metadata["hf"]``), else kept
    at the config's size; tensors keep their dtype, which ``config.json`` records.
    """
    src = _existing_dir(input_dir)
    out = _check_output(output_dir, megatron=False)
    ckpt = load_checkpoint(src, iteration, load_optimizer=False)
    if ckpt is None:
        raise ConfigError(f"{src} holds no megatron_h2 checkpoint ({LATEST_FILE} is missing); "
                          "point the input at a save directory")
    config = _model_config_from_metadata(ckpt.metadata, ckpt.path, ckpt.model)
    hf_meta = ckpt.metadata.get("hf") or {}
    true_vocab = _recorded_vocab(hf_meta, ckpt.path)
    tensors = megatron_to_hf_state(ckpt.model, config, true_vocab)
    hf_config = hf_config_from_model(config, true_vocab, hf_meta.get("config"))
    dtype_key = "torch_dtype" if "torch_dtype" in hf_config and "dtype" not in hf_config \
        else "dtype"
    hf_config[dtype_key] = str(tensors["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    out.mkdir(parents=True, exist_ok=True)
    write_hf_weights(out, tensors, max_shard_size)
    (out / HF_CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if isinstance(hf_meta.get("generation_config"), dict):
        (out / HF_GENERATION_FILE).write_text(
            json.dumps(hf_meta["generation_config"], indent=2, sort_keys=True) + "\n")
    return out
