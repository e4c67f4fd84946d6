"""The model the planner plans for: a LLaMA-style decoder described by ``pretrain_gpt.py`` flags.

The architecture is fixed: RMSNorm, rotary positions (no position-embedding table), grouped-query
attention (q: h x h, k and v: h x (groups x head_dim), o: h x h, no biases), a SwiGLU MLP of three
h x ffn matrices, an untied input embedding and output head, the vocabulary padded to a multiple
of 128 x TP. All counts below are exact for that architecture; the cost model turns them into
bytes and seconds.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from megatron_h2.errors import ConfigError
from megatron_h2.hetero_plan import check_keys, load_yaml_mapping, positive_int

VOCAB_PAD_MULTIPLE = 128
"""Megatron's ``--make-vocab-size-divisible-by`` default: the vocab is padded to 128 x TP."""


@dataclass(frozen=True)
class ModelSpec:
    """Architecture flags, named as ``pretrain_gpt.py`` names them (with ``_`` for ``-``)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    num_query_groups: int | None = None
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "seq_length",
            "vocab_size",
        ):
            positive_int(getattr(self, name), name)
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        groups = positive_int(self.num_query_groups, "num_query_groups")
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        positive_int(self.max_position_embeddings, "max_position_embeddings")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads"
                f" {self.num_attention_heads}; the head dimension must be a whole number"
            )
        if self.num_attention_heads % groups:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by"
                f" num_query_groups {groups}; use a divisor of the heads"
            )
        if self.seq_length > self.max_position_embeddings:
            raise ConfigError(
                f"seq_length {self.seq_length} exceeds max_position_embeddings"
                f" {self.max_position_embeddings}; raise max_position_embeddings"
            )

    # ------------------------------------------------------------------------------ shapes
    @property
    def groups(self) -> int:
        """Query groups (K/V heads), never None after construction."""
        assert self.num_query_groups is not None
        return self.num_query_groups

    @property
    def head_dim(self) -> int:
        """Hidden size per attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """Width of the K (and of the V) projection: groups x head_dim."""
        return self.groups * self.head_dim

    def padded_vocab(self, tensor_parallel_size: int) -> int:
        """Vocabulary padded to a multiple of 128 x TP, as the embedding and head store it."""
        multiple = VOCAB_PAD_MULTIPLE * tensor_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    # ---------------------------------------------------------------------------- parameters
    @property
    def layer_matrix_params(self) -> int:
        """Weights of one layer's matrices (q, k, v, o and the three MLP matrices)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        return 2 * h * h + 2 * h * self.kv_size + 3 * h * f

    def layer_params_per_chip(self, tp: int) -> float:
        """Parameters of one layer held by one TP rank (matrices split, the two norms
        replicated)."""
        return self.layer_matrix_params / tp + 2 * self.hidden_size

    def embedding_params_per_chip(self, tp: int) -> float:
        """Vocab-parallel input embedding held by one TP rank."""
        return self.padded_vocab(tp) * self.hidden_size / tp

    def head_params_per_chip(self, tp: int) -> float:
        """Final RMSNorm plus vocab-parallel output layer held by one TP rank."""
        return self.padded_vocab(tp) * self.hidden_size / tp + self.hidden_size

    def total_params(self) -> int:
        """All parameters of the unpadded model (layers, embedding, final norm, head)."""
        per_layer = self.layer_matrix_params + 2 * self.hidden_size
        return (
            self.num_layers * per_layer + 2 * self.vocab_size * self.hidden_size + self.hidden_size
        )

    # --------------------------------------------------------------------------------- FLOPs
    def layer_forward_flops(self, tokens: int) -> float:
        """Forward FLOPs of one layer over ``tokens`` tokens (matmuls + causal attention core)."""
        return tokens * (2.0 * self.layer_matrix_params + self.attention_core_flops_per_token)

    @property
    def attention_core_flops_per_token(self) -> float:
        """QK^T and AV with a causal mask (half of the square): 2 x seq x hidden per token."""
        return 2.0 * self.seq_length * self.hidden_size

    def head_forward_flops(self, tokens: int) -> float:
        """Forward FLOPs of the output layer (logits over the unpadded vocabulary)."""
        return tokens * 2.0 * self.hidden_size * self.vocab_size

    def model_flops_per_token(self) -> float:
        """Training FLOPs per token without recompute (3 x forward), the MFU numerator."""
        layer = 2.0 * self.layer_matrix_params + self.attention_core_flops_per_token
        return 3.0 * (self.num_layers * layer + 2.0 * self.hidden_size * self.vocab_size)

    # ------------------------------------------------------------------------------ building
    @classmethod
    def from_dict(cls, data: Any, source: str = "model") -> ModelSpec:
        """Build from a mapping with the field names as keys (unknown keys are errors)."""
        names = [f.name for f in fields(cls)]
        required = [n for n in names if n not in ("num_query_groups", "max_position_embeddings")]
        entry = check_keys(data, required, ("num_query_groups", "max_position_embeddings"), source)
        return cls(**dict(entry))

    @classmethod
    def from_yaml(cls, path: str | Path) -> ModelSpec:
        """Read a model file whose keys are the field names (``global_batch_size`` is ignored)."""
        data = dict(load_yaml_mapping(path, "model"))
        data.pop("global_batch_size", None)
        return cls.from_dict(data, source=f"model file '{path}'")

    def to_flags(self) -> list[str]:
        """The ``pretrain_gpt.py`` flags that describe this model."""
        flags = []
        for field in fields(self):
            flags += [f"--{field.name.replace('_', '-')}", str(getattr(self, field.name))]
        return flags


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


REQUIRED_MODEL_FLAGS: tuple[str, ...] = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "seq_length",
    "vocab_size",
)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``pretrain_gpt.py`` model flags plus ``--model FILE`` (flags override the file)."""
    group = parser.add_argument_group("model (same flags as pretrain_gpt.py)")
    group.add_argument("--model", metavar="FILE", help="YAML file with the model flags as keys")
    for name in MODEL_FLAGS:
        group.add_argument(f"--{name.replace('_', '-')}", type=int, metavar="N")
    group.add_argument("--global-batch-size", type=int, metavar="N")


def model_from_arguments(args: argparse.Namespace) -> tuple[ModelSpec, int]:
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
    return ModelSpec.from_dict(data, source="model flags"), positive_int(
        global_batch, "global_batch_size"
    )


def describe(model: ModelSpec) -> str:
    """One line such as ``96 layers, hidden 9216, ... (85.7B parameters)``."""
    params = model.total_params()
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    return (
        f"{model.num_layers} layers, hidden {model.hidden_size}, ffn {model.ffn_hidden_size},"
        f" {model.num_attention_heads} heads / {model.groups} query groups, seq {model.seq_length},"
        f" vocab {model.vocab_size} ({size} parameters)"
    )
