"""Megatron-LM's checkpoint conventions that do not depend on the file format: the args that
define the model, tensor-parallel partitioning of each parameter, the torch_dist key names of
the layer norms, and a pickle loader that never runs code from the file.

Megatron-LM pickles an ``argparse.Namespace`` of its arguments into every checkpoint. Its
model-defining fields have the names of :class:`~megatron_h2.config.ModelConfig`'s fields
(``num_layers``, ``swiglu``, ``untie_embeddings_and_output_weights``, ...), and Megatron fills
the unset sizes by the same rules, so a ``ModelConfig`` built from those args is the model the
checkpoint holds (``padded_vocab_size`` is the vocabulary).
"""

from __future__ import annotations

import argparse
import io
import pickle
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from megatron_h2.config import ARCHITECTURE_FIELDS, ModelConfig
from megatron_h2.errors import ConfigError
from megatron_h2.parallel.sharding import TPShard, unshard_tensors

MODEL_ARG_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                    "max_position_embeddings", *ARCHITECTURE_FIELDS)
"""ModelConfig fields that Megatron-LM's args carry under the same names."""

CHECKPOINT_VERSION = 3.0
"""The only ``checkpoint_version`` Megatron-LM has written since its fused QKV layout settled."""

# torch_dist stores the layer norms under Transformer Engine's fused names (Megatron-Core's
# local layer spec maps them so both specs share checkpoints); legacy files use the module names.
DIST_NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
OUR_NORM_NAMES = {ours: dist for dist, ours in DIST_NORM_NAMES.items()}
LAYER_PREFIX = "decoder.layers."
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def split_layer_name(name: str) -> tuple[int, str] | None:
    """``decoder.layers.3.mlp.linear_fc1.weight`` -> ``(3, "mlp.linear_fc1.weight")``."""
    match = _LAYER.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


def tp_rule(name: str, swiglu: bool) -> TPShard | None:
    """How Megatron partitions parameter ``name`` across tensor-parallel ranks (None:
    replicated). Column-parallel layers split rows; a SwiGLU fc1 holds ``[gate_r; up_r]`` on
    rank r (two blocks); row-parallel layers split columns; the vocabulary is split by rows."""
    if "layer_norm" in name or "layernorm" in name:
        return None
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return TPShard(0)
    if ".linear_qkv." in name:
        return TPShard(0)
    if ".linear_fc1." in name:
        return TPShard(0, 2 if swiglu else 1)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return TPShard(1)
    return None


def is_no_weight_decay(name: str, tensor: torch.Tensor) -> bool:
    """Megatron's default rule: biases and 1-D parameters (norms) get no weight decay; its
    optimizer puts them in a second parameter group after the decayed ones."""
    return name.endswith(".bias") or tensor.dim() == 1


def model_config_from_args(args: dict[str, Any], where: Path) -> ModelConfig:
    """The model a Megatron-LM checkpoint holds, from its pickled args."""
    values = {name: args[name] for name in MODEL_ARG_FIELDS if name in args}
    for name in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size"):
        if not isinstance(args.get(name), int) or isinstance(args.get(name), bool):
            raise ConfigError(f"checkpoint {where}: args.{name} is {str(args.get(name))[:30]!r}, "
                              "expected an integer; the file is corrupt or not Megatron-LM's")
    if not args.get("group_query_attention"):
        values.pop("num_query_groups", None)
    known = {f.name for f in fields(ModelConfig)}
    try:
        return ModelConfig(**{k: v for k, v in values.items() if k in known},
                           vocab_size=args["padded_vocab_size"])
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"checkpoint {where}: its args describe no valid model "
                          f"({' '.join(str(exc).split())[:160]})") from None


class _Opaque:
    """Stands in for a class a checkpoint names that is not needed here (an enum of Megatron's
    args, say): accepts any construction, runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{type(self).__module__}.{type(self).__qualname__}>"


def _stand_in(qualified: str) -> tuple[type, str]:
    module, _, name = qualified.rpartition(".")
    return type(name or "Unknown", (_Opaque,), {"__module__": module or "unknown"}), qualified


def safe_torch_load(path: Path, data: bytes | None = None) -> Any:
    """``torch.load`` of a Megatron-LM file (or of ``data``, an object stored inside ``path``)
    without executing anything it names: tensors and containers as usual,
    ``argparse.Namespace`` as itself, any other class as an inert stand-in. A file that is not
    a readable torch file is one line naming it."""
    try:
        wanted = torch.serialization.get_unsafe_globals_in_checkpoint(
            str(path) if data is None else io.BytesIO(data))
        allowed: list[Any] = [argparse.Namespace] + [
            _stand_in(q) for q in wanted if q != "argparse.Namespace"]
        with torch.serialization.safe_globals(allowed):
            return torch.load(str(path) if data is None else io.BytesIO(data),
                              map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint file {path} is missing") from None
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError, KeyError,
            TypeError, AttributeError, IndexError, ImportError, UnicodeDecodeError) as exc:
        first = " ".join(str(exc).split())[:120]
        raise ConfigError(f"checkpoint file {path} is truncated or corrupt ({first})") from None


def args_dict(args: Any, where: Path) -> dict[str, Any]:
    """The pickled args as a dict; one line when the file holds none."""
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    if isinstance(args, dict):
        return dict(args)
    raise ConfigError(f"checkpoint {where} holds no Megatron-LM args (found "
                      f"{type(args).__name__}); it was not written by Megatron-LM's trainer")


def megatron_padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's vocabulary padding: a multiple of ``divisible_by`` x TP."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def merge_tp(name: str, shards: list[torch.Tensor], swiglu: bool, where: Path) -> torch.Tensor:
    """The whole tensor ``name`` (a parameter, or its ``.exp_avg|exp_avg_sq|main|step``) from
    its TP shards in rank order, by :func:`tp_rule`; a replicated one must agree on every rank."""
    base = name.rsplit(".", 1)[0] if name.endswith((".exp_avg", ".exp_avg_sq", ".main",
                                                    ".step")) else name
    spec = tp_rule(base, swiglu)
    if spec is None or shards[0].dim() == 0:
        if any(not torch.equal(shards[0], s) for s in shards[1:]):
            raise ConfigError(f"checkpoint {where}: {name} should be the same on every "
                              "tensor-parallel rank but differs; the shards are inconsistent")
        return shards[0]
    try:
        return unshard_tensors(shards, spec)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"checkpoint {where}: cannot merge the TP shards of {name} "
                          f"({' '.join(str(exc).split())[:100]})") from None
