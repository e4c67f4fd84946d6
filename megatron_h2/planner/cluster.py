"""Cluster descriptions: which chips there are, how many, how fast, and how they are linked.

Cluster YAML (units are in the key names; GB/s are 1e9 bytes per second, one direction, per chip)::

    chips:
      A: {device: cuda, count: 256, chips_per_node: 8, tflops_bf16: 989, memory_gib: 80,
          intra_node_gb_per_s: 450, inter_node_gb_per_s: 50}
      B: {device: npu, count: 512, chips_per_node: 8, tflops_bf16: 320, memory_gib: 64,
          intra_node_gb_per_s: 196, inter_node_gb_per_s: 25, emulate_slowdown: 1.0}
    cross_chip_gb_per_s: 25     # per chip, between nodes of different chip types

* ``tflops_bf16``: dense (not sparse) peak BF16 matrix throughput of one chip.
* ``intra_node_gb_per_s``: what one chip can send to the others in its node (NVLink, Infinity
  Fabric, HCCS, ...); tensor parallelism and DP groups that fit in a node use it.
* ``inter_node_gb_per_s``: one chip's share of its node's network to nodes of the same type.
* ``cross_chip_gb_per_s``: one chip's bandwidth to nodes of another chip type (required when the
  cluster has more than one type); only pipeline point-to-point traffic crosses types.
* ``emulate_slowdown`` (optional, >= 1): CPU emulation only; multiplies compute times and is
  copied into the plan so that the runtime slows that chip down by the same factor.
* ``host_cores`` (optional, top level): CPU emulation only, where every chip is a
  single-threaded process of one host: the cores those processes get together (measured by
  ``tools/profile_chip.py --emulate``). A step then takes at least the CPU time of all its
  passes divided by ``host_cores`` (:meth:`~megatron_h2.planner.cost_model.CostModel.evaluate`),
  and each pass as long as on a core of its own (its profiled CPU time, padded by the slowdown).

Different chip types never share a node; a chip type's chips fill nodes of ``chips_per_node``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_h2.errors import ConfigError
from megatron_h2.plan.yaml_io import (
    check_keys,
    closest,
    load_yaml_mapping,
    positive_float,
    positive_int,
)

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
_REQUIRED_CHIP_KEYS = (
    "device",
    "count",
    "chips_per_node",
    "tflops_bf16",
    "memory_gib",
    "intra_node_gb_per_s",
    "inter_node_gb_per_s",
)
_OPTIONAL_CHIP_KEYS = ("emulate_slowdown",)


@dataclass(frozen=True)
class ChipType:
    """One kind of accelerator in the cluster and how many of it there are."""

    name: str
    device: str
    count: int
    chips_per_node: int
    tflops_bf16: float
    memory_gib: float
    intra_node_gb_per_s: float
    inter_node_gb_per_s: float
    emulate_slowdown: float = 1.0

    def __post_init__(self) -> None:
        where = f"chip type '{self.name}'"
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(
                f"chip type name {self.name!r} must be a word of letters, digits, _ . -"
            )
        if not isinstance(self.device, str) or not self.device.strip():
            raise ConfigError(f"{where}: device must be a torch device type such as 'cuda'")
        _wrap(where, positive_int, self.count, "count")
        _wrap(where, positive_int, self.chips_per_node, "chips_per_node")
        for name in ("tflops_bf16", "memory_gib", "intra_node_gb_per_s", "inter_node_gb_per_s"):
            object.__setattr__(self, name, _wrap(where, positive_float, getattr(self, name), name))
        slowdown = _wrap(
            where, positive_float, self.emulate_slowdown, "emulate_slowdown", 1.0, True
        )
        object.__setattr__(self, "emulate_slowdown", slowdown)

    @property
    def nodes(self) -> int:
        """Nodes this chip type fills (the last one may be partly filled)."""
        return -(-self.count // self.chips_per_node)

    @property
    def memory_bytes(self) -> float:
        """Memory of one chip in bytes."""
        return self.memory_gib * 2**30

    def tensor_parallel_options(self, num_attention_heads: int, num_query_groups: int) -> list[int]:
        """TP degrees this chip can run: divisors of its node size that divide heads and groups."""
        return [
            tp
            for tp in range(1, self.chips_per_node + 1)
            if self.chips_per_node % tp == 0
            and num_attention_heads % tp == 0
            and num_query_groups % tp == 0
            and tp <= self.count
        ]


@dataclass(frozen=True)
class Cluster:
    """All chip types (in file order) and the bandwidth between nodes of different types."""

    chips: tuple[ChipType, ...]
    cross_chip_gb_per_s: float | None = None
    host_cores: float | None = None
    """CPU emulation: the cores the emulated chips' processes share (None: not emulated)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "chips", tuple(self.chips))
        if not self.chips:
            raise ConfigError("the cluster has no chip types; list at least one under 'chips'")
        names = [chip.name for chip in self.chips]
        if len(set(names)) != len(names):
            raise ConfigError(f"chip type names must be unique, got {', '.join(names)}")
        if self.cross_chip_gb_per_s is None:
            if len(self.chips) > 1:
                raise ConfigError(
                    "missing key 'cross_chip_gb_per_s' (bandwidth between nodes of different chip"
                    " types); a cluster with several chip types needs it"
                )
        else:
            value = positive_float(self.cross_chip_gb_per_s, "cross_chip_gb_per_s")
            object.__setattr__(self, "cross_chip_gb_per_s", value)
        if self.host_cores is not None:
            object.__setattr__(self, "host_cores", positive_float(self.host_cores, "host_cores"))

    @property
    def names(self) -> list[str]:
        """Chip type names in file order."""
        return [chip.name for chip in self.chips]

    @property
    def total_chips(self) -> int:
        """Number of chips of all types."""
        return sum(chip.count for chip in self.chips)

    def chip(self, name: str) -> ChipType:
        """The chip type called ``name`` (ConfigError with a suggestion if there is none)."""
        for chip in self.chips:
            if chip.name == name:
                return chip
        raise ConfigError(
            f"unknown chip type '{name}'{closest(name, self.names)}; known: {', '.join(self.names)}"
        )

    def link_gb_per_s(self, first: str, second: str) -> float:
        """Per-chip bandwidth of a pipeline link from a stage on ``first`` to one on ``second``."""
        if first == second:
            return self.chip(first).inter_node_gb_per_s
        assert self.cross_chip_gb_per_s is not None
        return self.cross_chip_gb_per_s

    def subset(self, names: Iterable[str]) -> Cluster:
        """A cluster with only the named chip types (e.g. to plan one type alone)."""
        wanted = list(names)
        chips = tuple(self.chip(name) for name in wanted)
        cross = self.cross_chip_gb_per_s if len(chips) > 1 else None
        return Cluster(chips, cross, self.host_cores)

    @classmethod
    def from_dict(cls, data: Any, source: str = "cluster") -> Cluster:
        """Build from the YAML-shaped mapping; ``source`` names it in error messages."""
        top = check_keys(data, ("chips",), ("cross_chip_gb_per_s", "host_cores"), source)
        raw = top["chips"]
        if not isinstance(raw, Mapping) or not raw:
            raise ConfigError(f"'chips' in {source} must map chip type names to their figures")
        chips = []
        for name, entry in raw.items():
            where = f"chip type '{name}' of {source}"
            fields = check_keys(entry, _REQUIRED_CHIP_KEYS, _OPTIONAL_CHIP_KEYS, where)
            chips.append(ChipType(name=str(name), **dict(fields)))
        return cls(tuple(chips), top.get("cross_chip_gb_per_s"), top.get("host_cores"))

    @classmethod
    def from_yaml(cls, path: str | Path) -> Cluster:
        """Read and check a cluster file (schema in the module docstring)."""
        return cls.from_dict(load_yaml_mapping(path, "cluster"), source=f"cluster '{path}'")

    def to_dict(self) -> dict[str, Any]:
        """YAML-ready mapping (the inverse of :meth:`from_dict`)."""
        chips: dict[str, Any] = {}
        for chip in self.chips:
            entry = {k: getattr(chip, k) for k in _REQUIRED_CHIP_KEYS}
            if chip.emulate_slowdown != 1.0:
                entry["emulate_slowdown"] = chip.emulate_slowdown
            chips[chip.name] = entry
        data: dict[str, Any] = {"chips": chips}
        if self.cross_chip_gb_per_s is not None:
            data["cross_chip_gb_per_s"] = self.cross_chip_gb_per_s
        if self.host_cores is not None:
            data["host_cores"] = self.host_cores
        return data


def _wrap(where: str, check: Any, value: Any, *args: Any) -> Any:
    """Run a field check and prefix its message with the chip type it is about."""
    try:
        return check(value, *args)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
