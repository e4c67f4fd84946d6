"""Helpers shared by the Hugging Face model families (``hf_llama``, ``hf_gpt2``): reading
``config.json`` fields, checking tensor sets, vocabulary padding, fused QKV layout."""

from __future__ import annotations

from typing import Any

import torch

from megatron_h2.config import ModelConfig
from megatron_h2.errors import ConfigError
from megatron_h2.models.gpt import GPTModel


def get_int(hf_config: dict[str, Any], key: str, default: int | None = None) -> int:
    """An integer field of ``config.json`` (``default`` when absent; absent without one is an
    error)."""
    value = hf_config.get(key, default)
    if value is None:
        raise ConfigError(f"config.json has no {key!r}; it is not a complete model config")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.json field {key!r} must be an integer, got {value!r}")
    return value


def get_float(hf_config: dict[str, Any], key: str, default: float) -> float:
    """A number field of ``config.json`` (``default`` when absent or null)."""
    value = hf_config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"config.json field {key!r} must be a number, got {value!r}")
    return float(value)


def check_state(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
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


def megatron_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of our checkpoint of ``config`` (the model's own
    parameters, built without memory; a tied output layer has none of its own)."""
    with torch.device("meta"):
        model = GPTModel(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def hf_vocab(hf_state: dict[str, torch.Tensor], name: str, config: ModelConfig) -> int:
    """Rows of the HF embedding ``name``, which must fit the (padded) model vocabulary."""
    embed = hf_state.get(name)
    if embed is None:
        raise ConfigError(f"HF checkpoint has no tensor {name}")
    vocab = embed.shape[0]
    if vocab > config.vocab_size:
        raise ConfigError(f"HF vocabulary {vocab} exceeds the model vocab_size "
                          f"{config.vocab_size}")
    return vocab


def check_vocab(vocab: int, config: ModelConfig) -> int:
    """The true vocabulary to write (between 1 and the padded size)."""
    if not 0 < vocab <= config.vocab_size:
        raise ConfigError(f"true vocab size {vocab} must be between 1 and the padded vocab_size "
                          f"{config.vocab_size}")
    return vocab


def drop_tied_head(hf_state: dict[str, torch.Tensor], head: str,
                   embed: str) -> dict[str, torch.Tensor]:
    """``hf_state`` without a saved copy of a tied output layer (it must equal the embedding)."""
    if head not in hf_state:
        return hf_state
    if not torch.equal(hf_state[head], hf_state[embed]):
        raise ConfigError(f"config.json ties the embeddings but {head} differs from {embed}; "
                          "set tie_word_embeddings to false")
    return {k: v for k, v in hf_state.items() if k != head}


def unfold_norm(t: torch.Tensor, name: str, config: ModelConfig) -> torch.Tensor:
    """Our tensor ``name`` as a plain norm scale: a zero-centred one (``--apply-layernorm-1p``)
    stores scale - 1, which Hugging Face models do not."""
    if config.apply_layernorm_1p and name.endswith("layernorm.weight"):
        return t + 1.0
    return t


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` (the padded vocabulary)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def truncate_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``t``, as a copy (safetensors refuses shared storage)."""
    return t if t.shape[0] == rows else t[:rows].clone()


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             config: ModelConfig) -> torch.Tensor:
    """Separate q [nh d, ...], k and v [ng d, ...] (weights [.., h] or biases) -> our per-group
    layout [(nh + 2 ng) d, ...]: each group's query heads, then its key, then its value."""
    ng, d = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // ng
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(ng, per_group * d, *rest), k.reshape(ng, d, *rest),
                         v.reshape(ng, d, *rest)], dim=1)  # [ng, (nh/ng + 2) d, ...]
    return grouped.reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor,
              config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv` (contiguous copies)."""
    ng, d = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // ng
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, (per_group + 2) * d, *rest)
    q, k, v = (t.reshape(-1, *rest).clone(memory_format=torch.contiguous_format)
               for t in grouped.split([per_group * d, d, d], dim=1))
    return q, k, v
