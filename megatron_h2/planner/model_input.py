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

from megatron_h2.config import (
    ARCHITECTURE_FIELDS,
    ModelConfig,
    cli_fields,
    flag_name,
    pad_vocab_size,
)
from megatron_h2.errors import ConfigError
from megatron_h2.plan.yaml_io import check_keys, load_yaml_mapping, positive_int

VOCAB_PAD_MULTIPLE = 128
"""Megatron's ``--make-vocab-size-divisible-by`` default, which the runtime pads to as well."""

SHAPE_FLAGS: tuple[str, ...] = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "seq_length",
    "max_position_embeddings",
    "vocab_size",
)
"""The integer size flags of ``pretrain_gpt.py`` (``vocab_size``: the tokenizer's, unpadded)."""

DROPOUT_FIELDS: tuple[str, ...] = ("hidden_dropout", "attention_dropout")
"""Fields that leave the weights alone but change what a training step computes, so what a
profile measures (dropout draws a random mask per element, on CPU about as long as a layer's
matrix multiplies at small hidden sizes): the profile must be taken with the run's values."""

_FIELDS = {f.name: f for f in cli_fields(ModelConfig)}
ARCHITECTURE_FLAGS: dict[str, str] = {
    flag_name(_FIELDS[name])[2:].replace("-", "_"): name
    for name in ARCHITECTURE_FIELDS + DROPOUT_FIELDS if name not in SHAPE_FLAGS
}
"""Architecture keys (``pretrain_gpt.py`` flag names with underscores, e.g. ``swiglu``,
``normalization``, ``disable_bias_linear``, and the dropout probabilities) -> the ModelConfig
field each sets. A bool key is the flag given (true) or not; unset keys take Megatron's defaults,
as on the command line."""

MODEL_FLAGS: tuple[str, ...] = SHAPE_FLAGS + tuple(ARCHITECTURE_FLAGS)
"""Every key of a model file: the flags of ``pretrain_gpt.py`` that describe the model."""

REQUIRED_MODEL_FLAGS: tuple[str, ...] = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "vocab_size",
)


def _architecture_value(key: str, value: Any) -> Any:
    """The ModelConfig value of architecture key ``key`` given as ``value`` (checked)."""
    f = _FIELDS[ARCHITECTURE_FLAGS[key]]
    meta = f.metadata["cli"]
    if isinstance(f.default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false (the flag {flag_name(f)} given or "
                              f"not), got {value!r}")
        return not value if meta["negative"] else value
    if meta["parse"] is not None and isinstance(value, str):
        return meta["parse"](value)  # e.g. --moe-layer-freq "([0]*1+[1]*3)"
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ConfigError(f"{key} must be one of {', '.join(meta['choices'])}, got {value!r}")
    if isinstance(f.default, float) and (isinstance(value, bool)
                                          or not isinstance(value, int | float)):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if f.name == "rotary_seq_len_interpolation_factor":
        return positive_int(value, key)
    return float(value) if isinstance(f.default, float) else value


def model_from_dict(data: Any, source: str = "model") -> ModelConfig:
    """The model of a mapping whose keys are :data:`MODEL_FLAGS` (unknown keys are errors)."""
    optional = tuple(n for n in MODEL_FLAGS if n not in REQUIRED_MODEL_FLAGS)
    entry = dict(check_keys(data, REQUIRED_MODEL_FLAGS, optional, source))
    fields: dict[str, Any] = {}
    try:
        for name, value in entry.items():
            if name in ARCHITECTURE_FLAGS:
                fields[ARCHITECTURE_FLAGS[name]] = _architecture_value(name, value)
            elif value is not None:
                fields[name] = positive_int(value, name)
        if "num_query_groups" in fields and not fields.get("group_query_attention"):
            raise ConfigError("num_query_groups needs group_query_attention: true (as "
                              "pretrain_gpt.py's --num-query-groups needs --group-query-attention)")
        fields["vocab_size"] = pad_vocab_size(fields["vocab_size"], VOCAB_PAD_MULTIPLE)
        return ModelConfig(**fields)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def model_from_yaml(path: str | Path) -> ModelConfig:
    """Read a model file whose keys are the flag names (``global_batch_size`` is ignored)."""
    data = dict(load_yaml_mapping(path, "model"))
    data.pop("global_batch_size", None)
    return model_from_dict(data, source=f"model file '{path}'")


def model_flags(model: ModelConfig, vocab: bool = True) -> list[str]:
    """The ``pretrain_gpt.py`` flags that describe ``model`` (architecture flags only where
    they differ from Megatron's defaults; ``vocab=False`` leaves out ``--vocab-size``, which
    only the NullTokenizer reads)."""
    flags = []
    for name, value in model_flags_mapping(model).items():
        if name == "vocab_size" and not vocab:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        else:
            flags += [flag, str(value)]
    return flags


def model_flags_mapping(model: ModelConfig) -> Mapping[str, Any]:
    """The model as a flag-name -> value mapping (for YAML model files): every size, and the
    architecture keys whose value differs from Megatron's default."""
    out: dict[str, Any] = {name: getattr(model, name) for name in SHAPE_FLAGS}
    if not model.group_query_attention:
        del out["num_query_groups"]  # one per head
    for key, name in ARCHITECTURE_FLAGS.items():
        f = _FIELDS[name]
        value = getattr(model, name)
        if value != f.default and not (name == "add_qkv_bias" and model.add_bias_linear):
            out[key] = (not value) if f.metadata["cli"]["negative"] else value
    return out


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``pretrain_gpt.py`` model flags plus ``--model FILE`` (flags override the file)."""
    group = parser.add_argument_group("model (same flags as pretrain_gpt.py)")
    group.add_argument("--model", metavar="FILE", help="YAML file with the model flags as keys")
    for name in SHAPE_FLAGS:
        group.add_argument(f"--{name.replace('_', '-')}", type=int, metavar="N")
    for key, name in ARCHITECTURE_FLAGS.items():
        f = _FIELDS[name]
        flag = "--" + key.replace("_", "-")
        if isinstance(f.default, bool):
            group.add_argument(flag, action="store_true", default=None)
        else:
            parse = f.metadata["cli"]["parse"]
            kind = type(f.default) if f.default is not None else int
            group.add_argument(flag, type=str if parse else kind,
                               choices=f.metadata["cli"]["choices"])
    group.add_argument("--global-batch-size", type=int, metavar="N")


def model_from_arguments(args: argparse.Namespace,
                         require_global_batch: bool = True) -> tuple[ModelConfig, int | None]:
    """Return the model and the global batch size from parsed flags (and ``--model`` file);
    the batch size may be absent (None) with ``require_global_batch=False``."""
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
    if global_batch is None and require_global_batch:
        raise ConfigError(
            "--global-batch-size is missing; give it on the command line or in --model FILE"
        )
    model = model_from_dict(data, source="model flags")
    return model, None if global_batch is None else positive_int(global_batch,
                                                                 "global_batch_size")


def describe(model: ModelConfig) -> str:
    """One line such as ``96 layers, hidden 9216, ... (85.7B parameters)``."""
    params = model.num_parameters()
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    return (
        f"{model.num_layers} layers, hidden {model.hidden_size}, ffn {model.ffn_hidden_size},"
        f" {model.num_attention_heads} heads / {model.num_query_groups} query groups,"
        f" seq {model.seq_length}, vocab {model.vocab_size} ({size} parameters;"
        f" {model.describe_architecture()})"
    )
