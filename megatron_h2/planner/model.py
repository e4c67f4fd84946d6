"""The model the planner plans for, read from ``pretrain_gpt.py`` flags or a model YAML file.

The description itself is :class:`megatron_h2.config.ModelConfig`, the one the runtime builds:
parameter counts, FLOPs, activation bytes and the vocabulary padding come from there. This module
only reads it from the planner's inputs. ``vocab_size`` in a flag or file is the tokenizer's
size; the model holds it padded to a multiple of :data:`VOCAB_PAD_MULTIPLE` (Megatron's
``--make-vocab-size-divisible-by`` default), as the runtime pads it.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_h2.config import ModelConfig, pad_vocab_size
from megatron_h2.errors import ConfigError
from megatron_h2.hetero_plan import check_keys, load_yaml_mapping, positive_int

VOCAB_PAD_MULTIPLE = 128
"""Megatron's ``--make-vocab-size-divisible-by`` default, which the runtime pads to as well."""

MODEL_FLAGS: tuple[str, ...] = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "seq_length",
    "max_position_embeddings",
    "vocab_size",
)
"""The shape flags of ``pretrain_gpt.py`` that describe the model (keys of a model file)."""

REQUIRED_MODEL_FLAGS: tuple[str, ...] = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "seq_length",
    "vocab_size",
)


def model_from_dict(data: Any, source: str = "model") -> ModelConfig:
    """The model of a mapping whose keys are :data:`MODEL_FLAGS` (unknown keys are errors)."""
    optional = tuple(n for n in MODEL_FLAGS if n not in REQUIRED_MODEL_FLAGS)
    entry = dict(check_keys(data, REQUIRED_MODEL_FLAGS, optional, source))
    for name, value in entry.items():
        if value is not None:
            positive_int(value, name)
    entry["vocab_size"] = pad_vocab_size(entry["vocab_size"], VOCAB_PAD_MULTIPLE)
    try:
        return ModelConfig(**entry)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def model_from_yaml(path: str | Path) -> ModelConfig:
    """Read a model file whose keys are the flag names (``global_batch_size`` is ignored)."""
    data = dict(load_yaml_mapping(path, "model"))
    data.pop("global_batch_size", None)
    return model_from_dict(data, source=f"model file '{path}'")


def model_flags(model: ModelConfig) -> list[str]:
    """The ``pretrain_gpt.py`` flags that describe ``model``."""
    flags = []
    for name, value in model_flags_mapping(model).items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def model_flags_mapping(model: ModelConfig) -> Mapping[str, int]:
    """The model as a flag-name -> value mapping (for YAML model files)."""
    return {name: getattr(model, name) for name in MODEL_FLAGS}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``pretrain_gpt.py`` model flags plus ``--model FILE`` (flags override the file)."""
    group = parser.add_argument_group("model (same flags as pretrain_gpt.py)")
    group.add_argument("--model", metavar="FILE", help="YAML file with the model flags as keys")
    for name in MODEL_FLAGS:
        group.add_argument(f"--{name.replace('_', '-')}", type=int, metavar="N")
    group.add_argument("--global-batch-size", type=int, metavar="N")


def model_from_arguments(args: argparse.Namespace) -> tuple[ModelConfig, int]:
    """Return the model and the global batch size from parsed flags (and ``--model`` file)."""
    data: dict[str, Any] = {}
    if args.model:
        data = dict(load_yaml_mapping(args.model, "model"))
        check_keys(data, (), MODEL_FLAGS + ("global_batch_size",), f"model file '{args.model}'")
    for name in MODEL_FLAGS + ("global_batch_size",):
        value = getattr(args, name)
        if value is not None:
            data[name] = value
    global_batch = data.pop("global_batch_size", None)
    missing = [n for n in REQUIRED_MODEL_FLAGS if n not in data]
    if missing:
        flag = "--" + missing[0].replace("_", "-")
        raise ConfigError(
            f"model flag {flag} is missing; give it on the command line or in --model FILE"
        )
    if global_batch is None:
        raise ConfigError(
            "--global-batch-size is missing; give it on the command line or in --model FILE"
        )
    return model_from_dict(data, source="model flags"), positive_int(
        global_batch, "global_batch_size"
    )


def describe(model: ModelConfig) -> str:
    """One line such as ``96 layers, hidden 9216, ... (85.7B parameters)``."""
    params = model.num_parameters()
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    return (
        f"{model.num_layers} layers, hidden {model.hidden_size}, ffn {model.ffn_hidden_size},"
        f" {model.num_attention_heads} heads / {model.num_query_groups} query groups,"
        f" seq {model.seq_length}, vocab {model.vocab_size} ({size} parameters)"
    )
