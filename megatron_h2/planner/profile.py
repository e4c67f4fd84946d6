"""Profile tables: measured per-layer times (or efficiencies) that replace the FLOP-based guess.

A profile table is YAML. ``tools/profile_chip.py`` (:mod:`megatron_h2.measurement.chip_timing`)
writes it by timing one transformer layer, the embedding, the head and the optimizer step on one
chip; it can also be written by hand::

    model:                       # optional: the shape it was measured for; must match the model
      hidden_size: 64
      ffn_hidden_size: 256
      num_attention_heads: 4
      num_query_groups: 4
      seq_length: 128
      vocab_size: 1024
      hidden_dropout: 0.0        # dropout costs time too (tools/profile_chip.py records both)
      attention_dropout: 0.0
    chips:                       # chip type names of the cluster file
      fast:
        efficiency: 0.45         # optional: achieved fraction of tflops_bf16 for matmul FLOPs
        micro_batch_sizes:       # optional: measured milliseconds per micro-batch of that size
          1: {layer_forward_ms: 1.2, layer_backward_ms: 2.4,
              embedding_forward_ms: 0.05, embedding_backward_ms: 0.08,
              head_forward_ms: 0.4, head_backward_ms: 0.8}
          2: {layer_forward_ms: 2.3, layer_backward_ms: 4.6,
              selective_recompute_ms: 0.9}   # optional: see below
        optimizer_ns_per_param: 6.5  # optional: once-per-step optimizer work per parameter
        cpu_micro_batch_sizes:       # optional (CPU emulation): the same passes' CPU time
          1: {layer_forward_ms: 0.6, layer_backward_ms: 1.2}
        optimizer_cpu_ns_per_param: 3.2  # optional (CPU emulation): the optimizer's CPU time

Times are measured on ONE chip at tensor-parallel size 1 without recompute and without
``emulate_slowdown``; the cost model divides them by the TP degree, adds the TP communication it
models itself, adds recompute (a full forward, or the attention core's share of it for
selective), and multiplies by the chip's ``emulate_slowdown``. For a micro-batch size that is not
in the table the nearest measured one is scaled linearly. The embedding and head times default
to 0 when left out. A chip with an ``efficiency`` but no timings uses the FLOP model with that
efficiency; a chip missing from the table uses the default efficiency.

``selective_recompute_ms`` (optional) is the measured extra backward time of one layer under
selective recompute (backward with ``recompute: selective`` minus backward without). Without it
the cost model charges the attention core's FLOP share of the layer forward, which fits GPUs,
where the recomputed norms and activations are cheap; on a CPU they are memory-bound and cost
several times that share.

``optimizer_ns_per_param`` (optional, default 0: not modelled) is the measured once-per-step
work that follows the last backward on every rank, per parameter the chip holds: the gradient
norm, clipping, the AdamW update and zeroing the gradient buffers. It is memory-bound, so it
scales with the parameters a chip holds (divided by DP under the distributed optimizer) rather
than with tokens. ``emulate_slowdown`` does not scale it: the runtime pads only forwards and
backwards. ``tools/profile_chip.py`` measures both with the runtime's own model and optimizer.

``cpu_micro_batch_sizes`` and ``optimizer_cpu_ns_per_param`` (optional; default: the wall
times) are, for CPU emulation, the same passes' CPU time: less than their wall time when the
measuring process shared the cores with others (``tools/profile_chip.py`` records them for a
single-threaded measurement on the CPU). The runtime pads a chip with ``emulate_slowdown``
``s`` by ``s - 1`` times a pass's CPU time ``c``, not its wall time ``t``, so the cost model
times such a pass as ``t + (s - 1) c``; where the cluster names the cores its emulated chips
share (``host_cores``, :mod:`.cluster`), as ``s c`` (on a core of its own), and a step takes
at least the CPU time of all its passes over those cores.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from megatron_h2.config import ModelConfig
from megatron_h2.errors import ConfigError
from megatron_h2.plan.yaml_io import (
    check_keys,
    closest,
    load_yaml_mapping,
    positive_float,
    positive_int,
)

_MODEL_KEYS = (
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "seq_length",
    "vocab_size",
    "num_layers",
    "max_position_embeddings",
    "hidden_dropout",
    "attention_dropout",
)


@dataclass(frozen=True)
class MeasuredTimes:
    """Milliseconds for one micro-batch on one chip at TP 1 without recompute."""

    layer_forward_ms: float
    layer_backward_ms: float
    embedding_forward_ms: float = 0.0
    embedding_backward_ms: float = 0.0
    head_forward_ms: float = 0.0
    head_backward_ms: float = 0.0
    selective_recompute_ms: float | None = None
    """Extra backward time of one layer under selective recompute; None: not measured."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None and field.name == "selective_recompute_ms":
                continue
            required = field.name.startswith("layer_")
            checked = positive_float(value, field.name, 0.0, inclusive=not required)
            object.__setattr__(self, field.name, checked)

    def scaled(self, factor: float) -> MeasuredTimes:
        """All times multiplied by ``factor`` (to move to another micro-batch size)."""
        return MeasuredTimes(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name) * factor
                for f in fields(self)
            }
        )


@dataclass(frozen=True)
class ChipProfile:
    """What is known about one chip type: an efficiency, timings per micro-batch size, or both."""

    efficiency: float | None = None
    micro_batch_sizes: Mapping[int, MeasuredTimes] | None = None
    optimizer_ns_per_param: float = 0.0
    cpu_micro_batch_sizes: Mapping[int, MeasuredTimes] | None = None
    """CPU emulation: the CPU milliseconds of the passes of ``micro_batch_sizes``."""
    optimizer_cpu_ns_per_param: float | None = None
    """CPU emulation: the CPU time of ``optimizer_ns_per_param``."""

    def __post_init__(self) -> None:
        if self.cpu_micro_batch_sizes is not None:
            if sorted(self.cpu_micro_batch_sizes) != sorted(self.micro_batch_sizes or {}):
                raise ConfigError("cpu_micro_batch_sizes must list the micro-batch sizes of "
                                  "micro_batch_sizes")
            object.__setattr__(self, "cpu_micro_batch_sizes", dict(self.cpu_micro_batch_sizes))
        if self.optimizer_cpu_ns_per_param is not None:
            object.__setattr__(self, "optimizer_cpu_ns_per_param", positive_float(
                self.optimizer_cpu_ns_per_param, "optimizer_cpu_ns_per_param", 0.0, inclusive=True))
        object.__setattr__(
            self,
            "optimizer_ns_per_param",
            positive_float(
                self.optimizer_ns_per_param, "optimizer_ns_per_param", 0.0, inclusive=True
            ),
        )
        if self.efficiency is not None:
            value = positive_float(self.efficiency, "efficiency")
            if value > 1.0:
                raise ConfigError(f"efficiency must be a fraction in (0, 1], got {value}")
        if self.micro_batch_sizes is not None:
            for size in self.micro_batch_sizes:
                positive_int(size, "profiled micro batch size")
            object.__setattr__(self, "micro_batch_sizes", dict(self.micro_batch_sizes))

    def times(self, micro_batch_size: int, cpu: bool = False) -> MeasuredTimes | None:
        """Timings for ``micro_batch_size`` (nearest measured size scaled linearly), or None;
        with ``cpu`` their CPU times (the wall times where none were measured)."""
        table = (self.cpu_micro_batch_sizes or self.micro_batch_sizes if cpu
                 else self.micro_batch_sizes)
        if not table:
            return None
        if micro_batch_size in table:
            return table[micro_batch_size]
        nearest = min(table, key=lambda size: (abs(size - micro_batch_size), size))
        return table[nearest].scaled(micro_batch_size / nearest)


@dataclass(frozen=True)
class ProfileTable:
    """Per chip type profiles plus, optionally, the model shape they were measured for."""

    chips: Mapping[str, ChipProfile]
    model: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "chips", dict(self.chips))
        if self.model is not None:
            object.__setattr__(self, "model", dict(self.model))

    def check(self, model: ModelConfig, chip_names: list[str]) -> None:
        """Raise ConfigError if the table names unknown chips or was measured for another model."""
        for name in self.chips:
            if name not in chip_names:
                raise ConfigError(
                    f"profile names chip type '{name}' that is not in the cluster"
                    f"{closest(name, chip_names)}; known: {', '.join(chip_names)}"
                )
        for key, value in (self.model or {}).items():
            actual = getattr(model, key)
            if actual != value:
                raise ConfigError(
                    f"profile was measured for {key} {value} but the model has {actual};"
                    " re-profile or drop the timings"
                )

    def for_chip(self, name: str) -> ChipProfile | None:
        """The profile of chip type ``name``, if any."""
        return self.chips.get(name)

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> ProfileTable:
        """Build from the YAML-shaped mapping (schema in the module docstring)."""
        top = check_keys(data, ("chips",), ("model",), source)
        model = None
        if top.get("model") is not None:
            model = dict(check_keys(top["model"], (), _MODEL_KEYS, f"'model' of {source}"))
            for key, value in model.items():
                if key.endswith("_dropout"):  # a probability the step's time depends on
                    model[key] = positive_float(value, key, 0.0, inclusive=True)
                else:
                    positive_int(value, key)
        raw = top["chips"]
        if not isinstance(raw, Mapping):
            raise ConfigError(f"'chips' in {source} must map chip type names to profiles")
        chips = {
            str(name): _chip_profile(entry, f"chip '{name}' of {source}")
            for name, entry in raw.items()
        }
        return cls(chips, model)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ProfileTable:
        """Read and check a profile file."""
        return cls.from_dict(load_yaml_mapping(path, "profile"), source=f"profile '{path}'")


def _chip_profile(entry: Any, where: str) -> ChipProfile:
    fields_ = check_keys(
        entry, (), ("efficiency", "micro_batch_sizes", "optimizer_ns_per_param",
                    "cpu_micro_batch_sizes", "optimizer_cpu_ns_per_param"), where,
    )
    try:
        return ChipProfile(
            fields_.get("efficiency"),
            _times_table(fields_.get("micro_batch_sizes"), "micro_batch_sizes", where),
            fields_.get("optimizer_ns_per_param", 0.0),
            _times_table(fields_.get("cpu_micro_batch_sizes"), "cpu_micro_batch_sizes", where),
            fields_.get("optimizer_cpu_ns_per_param"),
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _times_table(raw: Any, key: str, where: str) -> dict[int, MeasuredTimes] | None:
    table = None
    if raw is not None:
        if not isinstance(raw, Mapping) or not raw:
            raise ConfigError(f"'{key}' of {where} must map sizes to measured times")
        table = {}
        names = [f.name for f in fields(MeasuredTimes)]
        for size, times in raw.items():
            inner = f"micro batch size {size} of {where}"
            values = check_keys(times, names[:2], names[2:], inner)
            try:
                table[positive_int(size, "profiled micro batch size")] = MeasuredTimes(
                    **dict(values)
                )
            except ConfigError as exc:
                raise ConfigError(f"{inner}: {exc}") from None
    return table
