"""Conversion between Hugging Face checkpoints and megatron_h2 checkpoints.

Hugging Face families cover the architectures Megatron's flags describe:
``LlamaForCausalLM`` (:mod:`~megatron_h2.checkpointing.hf_llama`: RMSNorm, SwiGLU, rotary, tied or
not, with or without biases, RoPE scaling) and ``GPT2LMHeadModel``
(:mod:`~megatron_h2.checkpointing.hf_gpt2`: Megatron's default GPT, LayerNorm, GeLU, learned
positions); mixture-of-experts models convert as ``MixtralForCausalLM``
(:mod:`~megatron_h2.checkpointing.hf_mixtral`), and ``Qwen2MoeForCausalLM`` converts to ours
(:mod:`~megatron_h2.checkpointing.hf_qwen2_moe`, one way). A checkpoint is written as the family
its model fits (MoE: Mixtral, RMSNorm: Llama, LayerNorm: GPT-2); a model none can hold is
refused in one line naming what does not fit.

The Hugging Face side is the directory ``save_pretrained`` writes: ``config.json`` plus either
``model.safetensors`` or shards listed in ``model.safetensors.index.json``. Our side is the format
of :mod:`megatron_h2.checkpointing.format`. Only safetensors and JSON are read and written;
nothing is unpickled and transformers is not imported. Our vocabulary is padded with zero rows to
a multiple of ``make_vocab_size_divisible_by``; the true size and the original HF config are kept
in ``metadata["hf"]`` so that converting back is exact.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_h2.checkpointing import hf_gpt2, hf_llama, hf_mixtral, hf_qwen2_moe
from megatron_h2.checkpointing.format import (
    LATEST_FILE,
    load_checkpoint,
    save_checkpoint,
)
from megatron_h2.checkpointing.hf_tensors import check_state, megatron_shapes
from megatron_h2.config import DataConfig, ModelConfig, RunConfig
from megatron_h2.errors import ConfigError

HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
HF_GENERATION_FILE = "generation_config.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 2**30  # bytes per safetensors shard when writing HF checkpoints

FAMILIES: dict[str, ModuleType] = {hf_llama.MODEL_TYPE: hf_llama, hf_gpt2.MODEL_TYPE: hf_gpt2,
                                   hf_mixtral.MODEL_TYPE: hf_mixtral,
                                   hf_qwen2_moe.MODEL_TYPE: hf_qwen2_moe}
"""HF ``model_type`` -> the module that maps it."""


# ---------------------------------------------------------------------------------------------
# Configuration and tensors, by family
# ---------------------------------------------------------------------------------------------

def _family_of_hf(hf_config: dict[str, Any]) -> ModuleType:
    model_type = hf_config.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise ConfigError(f"config.json has model_type {model_type!r}; only Llama ('llama'), "
                          "GPT-2 ('gpt2'), Mixtral ('mixtral') and Qwen2-MoE ('qwen2_moe', to "
                          "megatron_h2 only) checkpoints can be converted")
    return FAMILIES[model_type]


def family_of(config: ModelConfig) -> ModuleType:
    """The HF family that holds ``config``'s model: Llama for RMSNorm, GPT-2 for LayerNorm;
    a model the family cannot hold is a one-line refusal."""
    family = hf_llama if config.normalization == "RMSNorm" else hf_gpt2
    if config.is_moe:
        family = hf_mixtral
    reason = family.unsupported(config)
    if reason:
        raise ConfigError(f"transformers' {family.ARCHITECTURE} cannot hold this model "
                          f"({reason}); it stays a megatron_h2 checkpoint")
    return family


def model_config_from_hf(hf_config: dict[str, Any],
                         make_vocab_size_divisible_by: int = 128) -> ModelConfig:
    """Our model for a Hugging Face ``config.json`` dict (Llama or GPT-2).

    ``vocab_size`` is padded to a multiple of ``make_vocab_size_divisible_by`` and
    ``seq_length`` is set to the maximum positions. Raises :class:`ConfigError` for anything the
    model cannot represent.
    """
    fields = _family_of_hf(hf_config).model_fields(hf_config)
    vocab = hf_config.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int):
        raise ConfigError(f"config.json field 'vocab_size' must be an integer, got {vocab!r}")
    fields["vocab_size"] = DataConfig(make_vocab_size_divisible_by=make_vocab_size_divisible_by) \
        .padded_vocab_size(vocab)
    try:
        return ModelConfig(**fields)
    except ConfigError as exc:
        raise ConfigError(f"config.json describes a model megatron_h2 cannot build: {exc}") \
            from None


def hf_config_from_model(config: ModelConfig, true_vocab_size: int | None = None,
                         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` dict for ``config`` in its family (see :func:`family_of`).

    ``extra`` (typically the HF config recorded at import) supplies every field we do not
    model - token ids, dtype, transformers version - and the fields we do model are overwritten
    from ``config``. ``true_vocab_size`` (default: ``config.vocab_size``) is the unpadded size.
    """
    family = family_of(config)
    if extra and extra.get("model_type", family.MODEL_TYPE) != family.MODEL_TYPE:
        extra = None  # recorded for another family: nothing in it applies
    return family.hf_config(config, true_vocab_size, extra)


def hf_to_megatron_state(hf_state: dict[str, torch.Tensor], config: ModelConfig,
                         hf_config: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """HF tensors -> our tensors for ``config`` (whose vocab may be padded), in the family of
    ``hf_config`` (default: the one :func:`family_of` writes ``config`` as).

    The HF vocabulary is read from the embedding and padded with zero rows to
    ``config.vocab_size``. Dtypes are kept as they are.
    """
    family = family_of(config) if hf_config is None else _family_of_hf(hf_config)
    return family.to_megatron(hf_state, config)


def megatron_to_hf_state(state: dict[str, torch.Tensor], config: ModelConfig,
                         true_vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Our tensors -> HF tensors of ``config``'s family, truncating the vocabulary to
    ``true_vocab_size`` (default: ``config.vocab_size``, no truncation)."""
    family = family_of(config)
    check_state(state, megatron_shapes(config), "megatron_h2 checkpoint")
    return family.to_hf(state, config, true_vocab_size or config.vocab_size)


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
    """Convert an HF Llama or GPT-2 directory into a megatron_h2 checkpoint at iteration 0.

    The metadata records the run config (``config``), the true vocabulary size and the full HF
    config (``hf``) so that :func:`convert_megatron_to_hf` restores them. No optimizer state is
    written. Returns the iteration directory.
    """
    src = _existing_dir(input_dir)
    out = _check_output(output_dir, megatron=True)
    hf_config = read_hf_config(src)
    config = model_config_from_hf(hf_config, make_vocab_size_divisible_by)
    hf_state = read_hf_weights(src)
    family = _family_of_hf(hf_config)
    if family is hf_gpt2:
        hf_state = hf_gpt2.normalize_names(hf_state)
    embed = hf_state.get(family.EMBED)
    true_vocab = hf_config["vocab_size"]
    if embed is not None and embed.shape[0] != true_vocab:
        raise ConfigError(f"{src} embeds {embed.shape[0]} tokens but config.json says vocab_size "
                          f"{true_vocab}; fix config.json")
    state = hf_to_megatron_state(hf_state, config, hf_config)
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
    """Convert a megatron_h2 checkpoint (default: the latest iteration) into an HF directory
    that ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` (:func:`family_of`) ``.from_pretrained``
    loads. Returns the output directory.

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
    family = family_of(config)
    hf_meta = ckpt.metadata.get("hf") or {}
    true_vocab = _recorded_vocab(hf_meta, ckpt.path)
    tensors = megatron_to_hf_state(ckpt.model, config, true_vocab)
    hf_config = hf_config_from_model(config, true_vocab, hf_meta.get("config"))
    dtype_key = "torch_dtype" if "torch_dtype" in hf_config and "dtype" not in hf_config \
        else "dtype"
    hf_config[dtype_key] = str(tensors[family.EMBED].dtype).removeprefix("torch.")
    out.mkdir(parents=True, exist_ok=True)
    write_hf_weights(out, tensors, max_shard_size)
    (out / HF_CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if isinstance(hf_meta.get("generation_config"), dict):
        (out / HF_GENERATION_FILE).write_text(
            json.dumps(hf_meta["generation_config"], indent=2, sort_keys=True) + "\n")
    return out
