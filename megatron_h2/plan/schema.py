"""The heterogeneous parallel plan: the one file the planner writes and the runtime reads.

A :class:`HeteroPlan` says how one model is laid out over a cluster whose pipeline stages run on
different kinds of chips (HeteroPP). ``tools/plan.py`` writes it; ``pretrain_gpt.py --hetero-plan
FILE`` reads it with :meth:`HeteroPlan.from_yaml` and checks it against the model flags with
:meth:`HeteroPlan.validate` before any process group is created.

YAML schema (every key is required unless a default is given)::

    data_parallel_size: 1        # DP degree of every stage that does not set its own
    micro_batch_size: 1          # sequences per micro-batch, shared by every stage
    global_batch_size: 8         # multiple of micro_batch_size * every stage's DP
    chips:                       # chip name -> how the runtime drives that chip
      fast: {device: cpu}                          # device: torch device type (cuda, npu, cpu...)
      slow: {device: cpu, emulate_slowdown: 2.0}   # optional, default 1.0: CPU emulation only
    stages:                      # pipeline order: stage 0 holds the embedding, the last the head
      - {chip: fast, tensor_parallel_size: 2, num_layers: 3}
      - {chip: slow, tensor_parallel_size: 1, num_layers: 1, recompute: full}
    schedule: 1f1b               # optional: 1f1b | interleaved | zero-bubble (see below)
    transports:                  # optional: the bridge's transfer library per pair of chip types
      - {chips: [fast, slow], transport: nixl}     # gloo (default for unlisted pairs) or nixl

A boundary between stages on different chip types (or any boundary with ``--force-bridge``)
crosses the host-staged bridge; ``transports`` picks what carries the bridge's chunks between
two chip types: ``gloo`` (torch.distributed over TCP, the default) or ``nixl`` (NVIDIA's NIXL
transfer library over UCX; ``pip install 'megatron_h2[nixl]'``). See
:mod:`megatron_h2.distributed.transport`.

``recompute`` is ``none`` (default), ``selective`` (norms, core attention and the SwiGLU
activation are recomputed in backward) or ``full`` (whole layers are recomputed from their input).

Virtual pipeline stages (interleaving): a stage's ``num_layers`` may be a list, one layer count
per model chunk, e.g. ``num_layers: [2, 1]``; every stage then has the same number of chunks
``V`` (:attr:`HeteroPlan.virtual_pipeline_size`). Layers are assigned chunk-major, as Megatron's
interleaved schedule orders them: chunk 0 of stage 0, chunk 0 of stage 1, ..., chunk 0 of the
last stage, then chunk 1 of stage 0, ... (:meth:`HeteroPlan.chunk_layer_ranges`). Only chunk 0
of the first stage and the last chunk of the last stage (which hold the embedding and the head)
may be empty. ``schedule`` defaults to ``interleaved`` when ``V > 1`` and to ``1f1b`` otherwise.

Per-stage data parallelism: a stage may set its own ``data_parallel_size`` (``DP_s``), e.g.
``{chip: slow, tensor_parallel_size: 1, num_layers: 2, data_parallel_size: 2}``. The global batch
is cut into ``M = global_batch_size / micro_batch_size`` micro-batches numbered ``0 .. M-1``;
every stage processes all ``M``, its replica ``r`` the micro-batches ``j`` with
``j mod DP_s == r`` (:meth:`HeteroPlan.stage_micro_batches` of them per step).

Rank layout (what the runtime must build its process groups from):

* Stage ``s`` owns ``tensor_parallel_size * DP_s`` consecutive global ranks, stages in pipeline
  order, so stage 0 starts at rank 0 (:meth:`HeteroPlan.stage_ranks`).
* Inside a stage, ``rank = first_rank + dp_rank * tensor_parallel_size + tp_rank``: a TP group is
  ``tensor_parallel_size`` consecutive ranks (kept inside one node), a DP group takes every
  ``tensor_parallel_size``-th rank of the stage (:meth:`HeteroPlan.rank_coordinates`).
* Micro-batch ``j`` runs on replica ``j mod DP_s`` of every stage: its pipeline point-to-point
  traffic goes from the TP group of replica ``j mod DP_s`` of stage ``s`` to that of replica
  ``j mod DP_{s+1}`` of stage ``s + 1`` (the same replica when both have the same DP degree),
  even where the two stages have different TP degrees
  (:mod:`megatron_h2.distributed.boundary`, :mod:`megatron_h2.plan.orders`).
* Layers are numbered globally; stage ``s`` runs ``layer_ranges()[s]`` (0-based, contiguous)
  when it has one chunk, and ``chunk_layer_ranges()[s]`` in general.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import yaml

from megatron_h2.config import RECOMPUTE_MODES, Recompute
from megatron_h2.errors import ConfigError
from megatron_h2.plan.orders import SCHEDULES
from megatron_h2.plan.yaml_io import (
    check_keys,
    closest,
    load_yaml_mapping,
    positive_float,
    positive_int,
)

_PLAN_KEYS = ("data_parallel_size", "micro_batch_size", "global_batch_size", "chips", "stages",
              "schedule")
"""Pipeline schedules a plan may name (``schedule``)."""
_CHIP_KEYS = ("device", "emulate_slowdown")
_STAGE_KEYS = ("chip", "tensor_parallel_size", "num_layers", "recompute", "data_parallel_size")
_LINK_KEYS = ("chips", "transport")
TRANSPORTS = ("gloo", "nixl")
"""Transfer libraries the bridge can run on (megatron_h2.distributed.transport)."""


@dataclass(frozen=True)
class ChipSpec:
    """How the runtime drives one chip type: its torch device type and an optional slowdown.

    ``emulate_slowdown`` (>= 1.0) makes a chip run that many times slower than it is (each
    pass sleeps ``emulate_slowdown - 1`` times its own CPU time after it), so that a CPU-only
    machine can emulate a heterogeneous cluster; leave it at 1.0 on real accelerators.
    """

    device: str
    emulate_slowdown: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not self.device.strip():
            raise ConfigError(
                f"chip device must be a non-empty string such as 'cuda', got {self.device!r}"
            )
        slowdown = positive_float(self.emulate_slowdown, "emulate_slowdown", 1.0, inclusive=True)
        object.__setattr__(self, "emulate_slowdown", slowdown)


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: the chip type it runs on, its TP degree, layer count and recompute.

    ``num_layers`` is the stage's total; ``chunk_layers`` splits it over model chunks (virtual
    pipeline stages, see the module docstring), empty for one chunk.
    """

    chip: str
    tensor_parallel_size: int
    num_layers: int
    recompute: Recompute = "none"
    chunk_layers: tuple[int, ...] = ()
    data_parallel_size: int | None = None  # None: the plan's data_parallel_size

    def __post_init__(self) -> None:
        if self.data_parallel_size is not None:
            positive_int(self.data_parallel_size, "data_parallel_size")
        if not isinstance(self.chip, str) or not self.chip:
            raise ConfigError(f"stage chip must be a chip name, got {self.chip!r}")
        positive_int(self.tensor_parallel_size, "tensor_parallel_size")
        positive_int(self.num_layers, "num_layers", minimum=0)
        object.__setattr__(self, "chunk_layers", tuple(self.chunk_layers))
        for count in self.chunk_layers:
            positive_int(count, "num_layers of a chunk", minimum=0)
        if self.chunk_layers and sum(self.chunk_layers) != self.num_layers:
            raise ConfigError(f"chunk layers {list(self.chunk_layers)} add up to "
                              f"{sum(self.chunk_layers)}, not the stage's {self.num_layers}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(
                f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {self.recompute!r}"
                f"{closest(str(self.recompute), RECOMPUTE_MODES)}"
            )

    @property
    def chunks(self) -> tuple[int, ...]:
        """Layer count of each model chunk of the stage (one entry without interleaving)."""
        return self.chunk_layers or (self.num_layers,)


@dataclass(frozen=True)
class LinkSpec:
    """The bridge's transport between two chip types (order does not matter)."""

    chips: tuple[str, str]
    transport: str = "gloo"

    def __post_init__(self) -> None:
        chips = self.chips
        if (not isinstance(chips, (list, tuple)) or len(chips) != 2
                or not all(isinstance(c, str) and c for c in chips)):
            raise ConfigError(f"transports entry needs chips: [chip_a, chip_b], got {chips!r}")
        object.__setattr__(self, "chips", tuple(chips))
        if self.transport not in TRANSPORTS:
            hint = (" (mooncake was evaluated but is not integrated: see docs/devices.md)"
                    if self.transport == "mooncake" else closest(str(self.transport), TRANSPORTS))
            raise ConfigError(f"transport must be one of {', '.join(TRANSPORTS)}, got "
                              f"{self.transport!r}{hint}")


@dataclass(frozen=True)
class HeteroPlan:
    """A validated heterogeneous plan (see the module docstring for the schema and rank layout).

    Construction checks everything that does not need the model: positive sizes, the global batch
    being a multiple of ``micro_batch_size * data_parallel_size``, chip names, and that only the
    first and last stages (which hold the embedding and the head) may have no layer. Call
    :meth:`validate` with the model flags for the rest.
    """

    data_parallel_size: int
    micro_batch_size: int
    global_batch_size: int
    chips: Mapping[str, ChipSpec]
    stages: Sequence[StageSpec]
    schedule: str | None = None  # None: "interleaved" with virtual stages, else "1f1b"
    transports: Sequence[LinkSpec] = ()

    def __post_init__(self) -> None:
        positive_int(self.data_parallel_size, "data_parallel_size")
        positive_int(self.micro_batch_size, "micro_batch_size")
        positive_int(self.global_batch_size, "global_batch_size")
        if not isinstance(self.chips, Mapping) or not self.chips:
            raise ConfigError("chips must map at least one chip name to {device: ...}")
        for name, chip in self.chips.items():
            if not isinstance(chip, ChipSpec):
                raise ConfigError(f"chip '{name}' must be a ChipSpec, got {type(chip).__name__}")
        object.__setattr__(self, "chips", dict(self.chips))
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise ConfigError("stages is empty; a plan needs at least one pipeline stage")
        self._check_batch()
        self._check_stages()
        self._check_chunks()
        if self.schedule is None:
            default = "interleaved" if self.virtual_pipeline_size > 1 else "1f1b"
            object.__setattr__(self, "schedule", default)
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got "
                              f"{self.schedule!r}{closest(str(self.schedule), SCHEDULES)}")
        if self.schedule == "interleaved" and self.virtual_pipeline_size == 1:
            raise ConfigError("the interleaved schedule needs virtual pipeline stages: give "
                              "every stage's num_layers as a list with one count per chunk")
        if self.schedule == "1f1b" and self.virtual_pipeline_size > 1:
            raise ConfigError("the stages have several model chunks, which the 1f1b schedule "
                              "cannot run; use schedule: interleaved")
        object.__setattr__(self, "transports", tuple(self.transports))
        self._check_transports()

    def _check_transports(self) -> None:
        seen: set[frozenset[str]] = set()
        for link in self.transports:
            if not isinstance(link, LinkSpec):
                raise ConfigError(f"transports entries must be LinkSpec, got {type(link).__name__}")
            for chip in link.chips:
                if chip not in self.chips:
                    raise ConfigError(f"transports names unknown chip '{chip}'"
                                      f"{closest(chip, list(self.chips))}; known chips: "
                                      f"{', '.join(self.chips)}")
            pair = frozenset(link.chips)
            if pair in seen:
                raise ConfigError(f"transports lists the chip pair {' / '.join(link.chips)} "
                                  "twice; keep one entry")
            seen.add(pair)

    def transport_between(self, chip_a: str, chip_b: str) -> str:
        """The bridge's transport between two chip types (``gloo`` unless the plan says)."""
        for link in self.transports:
            if frozenset(link.chips) == frozenset((chip_a, chip_b)):
                return link.transport
        return "gloo"

    def _check_chunks(self) -> None:
        counts = {len(stage.chunks) for stage in self.stages}
        if len(counts) > 1:
            per_stage = ", ".join(str(len(stage.chunks)) for stage in self.stages)
            raise ConfigError(f"every stage needs the same number of model chunks, got {per_stage};"
                              " give each stage's num_layers as a list of the same length")
        v, last = counts.pop(), len(self.stages) - 1
        if v == 1:
            return
        for index, stage in enumerate(self.stages):
            for chunk, count in enumerate(stage.chunks):
                edge = (index, chunk) in ((0, 0), (last, v - 1))
                if count == 0 and not edge:
                    raise ConfigError(
                        f"chunk {chunk} of stage {index} has no layer; only the first chunk of "
                        "the first stage and the last chunk of the last stage may be empty")

    def _check_batch(self) -> None:
        """The global batch splits into whole micro-batches for every DP replica of every stage
        (replica ``r`` of a stage of DP ``d`` runs micro-batches ``j`` with ``j mod d == r``)."""
        for index, stage in enumerate(self.stages):
            if not isinstance(stage, StageSpec):
                continue  # reported by _check_stages
            dp = self.stage_dp(index)
            per_step = self.micro_batch_size * dp
            if self.global_batch_size % per_step:
                whose = (f"stage {index}'s data_parallel_size {dp}"
                         if stage.data_parallel_size is not None else "data_parallel_size")
                raise ConfigError(
                    f"global_batch_size {self.global_batch_size} is not divisible by "
                    f"micro_batch_size x {whose} = {per_step}; change one of them")

    def _check_stages(self) -> None:
        last = len(self.stages) - 1
        for index, stage in enumerate(self.stages):
            if not isinstance(stage, StageSpec):
                raise ConfigError(f"stage {index} must be a StageSpec, got {type(stage).__name__}")
            if stage.chip not in self.chips:
                raise ConfigError(
                    f"stage {index} uses unknown chip '{stage.chip}'"
                    f"{closest(stage.chip, list(self.chips))};"
                    f" known chips: {', '.join(self.chips)}"
                )
            if stage.num_layers == 0 and 0 < index < last:
                raise ConfigError(
                    f"stage {index} has no layer and holds neither the embedding (first stage) nor"
                    " the head (last stage); give it at least one layer or remove it"
                )

    def __hash__(self) -> int:
        return hash((self.data_parallel_size, self.micro_batch_size, self.global_batch_size,
                     tuple(sorted(self.chips.items())), tuple(self.stages), self.schedule,
                     tuple(self.transports)))

    # ----------------------------------------------------------------------------- derived sizes
    @property
    def pipeline_parallel_size(self) -> int:
        """Number of pipeline stages."""
        return len(self.stages)

    def stage_dp(self, stage: int) -> int:
        """Data-parallel degree of ``stage`` (its own ``data_parallel_size``, else the plan's)."""
        own = self.stages[stage].data_parallel_size
        return self.data_parallel_size if own is None else own

    @property
    def uniform_dp(self) -> bool:
        """Whether every stage has the plan's DP degree."""
        return all(self.stage_dp(s) == self.data_parallel_size for s in range(len(self.stages)))

    @property
    def total_micro_batches(self) -> int:
        """Micro-batches per step over the whole global batch: global batch / micro batch."""
        return self.global_batch_size // self.micro_batch_size

    def stage_micro_batches(self, stage: int) -> int:
        """Micro-batches per step that each DP replica of ``stage`` runs (replica ``r`` runs
        the micro-batches ``j`` with ``j mod DP_stage == r``)."""
        return self.total_micro_batches // self.stage_dp(stage)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step and DP replica: global batch / (micro batch x DP); with
        per-stage DP degrees see :meth:`stage_micro_batches`."""
        if not self.uniform_dp:
            raise ConfigError("the stages have different data_parallel_size: ask "
                              "stage_micro_batches(stage) for a stage's micro-batches")
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def num_layers(self) -> int:
        """Total transformer layers over all stages."""
        return sum(stage.num_layers for stage in self.stages)

    @property
    def virtual_pipeline_size(self) -> int:
        """Model chunks per stage (V; 1 without interleaving)."""
        return len(self.stages[0].chunks)

    @property
    def world_size(self) -> int:
        """Ranks the plan needs: sum over stages of TP x DP (each stage's own DP)."""
        return sum(stage.tensor_parallel_size * self.stage_dp(index)
                   for index, stage in enumerate(self.stages))

    def stage_ranks(self, stage: int) -> range:
        """Global ranks of ``stage``: ``tensor_parallel_size x data_parallel_size`` in a row."""
        if (
            isinstance(stage, bool)
            or not isinstance(stage, int)
            or not 0 <= stage < len(self.stages)
        ):
            raise ConfigError(f"stage index {stage!r} is out of range 0..{len(self.stages) - 1}")
        start = sum(s.tensor_parallel_size * self.stage_dp(i)
                    for i, s in enumerate(self.stages[:stage]))
        ranks = self.stages[stage].tensor_parallel_size * self.stage_dp(stage)
        return range(start, start + ranks)

    def rank_coordinates(self, rank: int) -> tuple[int, int, int]:
        """Return ``(stage, dp_rank, tp_rank)`` of a global rank (see the rank layout above)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank!r} is out of range 0..{self.world_size - 1}")
        for index in range(len(self.stages)):
            ranks = self.stage_ranks(index)
            if rank in ranks:
                tp = self.stages[index].tensor_parallel_size
                offset = rank - ranks.start
                return index, offset // tp, offset % tp
        raise AssertionError("unreachable: rank inside world size but in no stage")

    def chunk_layer_ranges(self) -> list[list[range]]:
        """``[stage][chunk]``: the global layers of every model chunk, numbered chunk-major
        (chunk 0 of every stage in pipeline order, then chunk 1, ...)."""
        out: list[list[range]] = [[] for _ in self.stages]
        start = 0
        for chunk in range(self.virtual_pipeline_size):
            for index, stage in enumerate(self.stages):
                out[index].append(range(start, start + stage.chunks[chunk]))
                start += stage.chunks[chunk]
        return out

    def layer_ranges(self) -> list[range]:
        """Global (0-based) layer indices run by each stage, in pipeline order (one chunk per
        stage; see :meth:`chunk_layer_ranges` for interleaved plans)."""
        if self.virtual_pipeline_size > 1:
            raise ConfigError("an interleaved plan's stages hold several layer ranges; use "
                              "chunk_layer_ranges()")
        ranges, start = [], 0
        for stage in self.stages:
            ranges.append(range(start, start + stage.num_layers))
            start += stage.num_layers
        return ranges

    def validate(
        self,
        num_layers: int,
        num_attention_heads: int,
        num_query_groups: int | None = None,
        world_size: int | None = None,
    ) -> None:
        """Check the plan against the model flags (and the launched world size if given).

        Raises ConfigError when the stage layers do not add up to ``num_layers``, when a stage's
        TP degree does not divide the attention heads or the query groups, or when ``world_size``
        differs from :attr:`world_size`. ``num_query_groups`` defaults to the number of heads.
        """
        positive_int(num_layers, "num_layers")
        positive_int(num_attention_heads, "num_attention_heads")
        groups = num_attention_heads if num_query_groups is None else num_query_groups
        positive_int(groups, "num_query_groups")
        if self.num_layers != num_layers:
            split = "+".join(str(stage.num_layers) for stage in self.stages)
            raise ConfigError(
                f"plan stages hold {split} = {self.num_layers} layers but the model has"
                f" {num_layers}; make the stage num_layers add up to {num_layers}"
            )
        for index, stage in enumerate(self.stages):
            tp = stage.tensor_parallel_size
            for count, name in ((num_attention_heads, "attention heads"), (groups, "query groups")):
                if count % tp:
                    raise ConfigError(
                        f"stage {index} tensor_parallel_size {tp} does not divide the"
                        f" {count} {name};"
                        " pick a TP degree that divides both heads and query groups"
                    )
        if world_size is not None and world_size != self.world_size:
            raise ConfigError(
                f"the plan needs world size {self.world_size} (sum of TP x DP over stages) but"
                f" {world_size} processes were launched; launch {self.world_size}"
            )

    # ------------------------------------------------------------------------------- conversion
    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> HeteroPlan:
        """Build a plan from the YAML-shaped mapping; ``source`` names it in error messages."""
        top = check_keys(data, _PLAN_KEYS[:5], _PLAN_KEYS[5:] + ("transports",), source)
        raw_chips = top["chips"]
        if not isinstance(raw_chips, Mapping) or not raw_chips:
            raise ConfigError(f"'chips' in {source} must map chip names to {{device: ...}}")
        chips = {}
        for name, chip in raw_chips.items():
            entry = check_keys(chip, _CHIP_KEYS[:1], _CHIP_KEYS[1:], f"chip '{name}' of {source}")
            chips[str(name)] = ChipSpec(**dict(entry))
        raw_stages = top["stages"]
        if not isinstance(raw_stages, list) or not raw_stages:
            raise ConfigError(f"'stages' in {source} must be a non-empty list of stages")
        stages = []
        for index, stage in enumerate(raw_stages):
            where = f"stage {index} of {source}"
            entry = dict(check_keys(stage, _STAGE_KEYS[:3], _STAGE_KEYS[3:], where))
            layers = entry["num_layers"]
            if isinstance(layers, list):  # one count per model chunk
                if not layers:
                    raise ConfigError(f"{where}: num_layers is an empty list; give one layer "
                                      "count per model chunk")
                entry["chunk_layers"] = tuple(layers)
                entry["num_layers"] = sum(n for n in layers if isinstance(n, int))
            try:
                stages.append(StageSpec(**entry))
            except ConfigError as exc:
                raise ConfigError(f"stage {index} of {source}: {exc}") from None
        raw_links = top.get("transports", [])
        if not isinstance(raw_links, list):
            raise ConfigError(f"'transports' in {source} must be a list of "
                              "{chips: [a, b], transport: ...}")
        links = []
        for index, link in enumerate(raw_links):
            entry = check_keys(link, _LINK_KEYS, (), f"transports entry {index} of {source}")
            links.append(LinkSpec(**dict(entry)))
        return cls(
            data_parallel_size=top["data_parallel_size"],
            micro_batch_size=top["micro_batch_size"],
            global_batch_size=top["global_batch_size"],
            chips=chips,
            stages=stages,
            schedule=top.get("schedule"),
            transports=links,
        )

    @classmethod
    def from_yaml(cls, path: str | Path) -> HeteroPlan:
        """Read and check a plan file (see the module docstring for the schema)."""
        return cls.from_dict(load_yaml_mapping(path, "plan"), source=f"plan '{path}'")

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-ready mapping; ``emulate_slowdown`` is written only when it is not 1.0."""
        chips: dict[str, Any] = {}
        for name, chip in self.chips.items():
            entry: dict[str, Any] = {"device": chip.device}
            if chip.emulate_slowdown != 1.0:
                entry["emulate_slowdown"] = chip.emulate_slowdown
            chips[name] = entry
        stages = [
            {
                "chip": s.chip,
                "tensor_parallel_size": s.tensor_parallel_size,
                "num_layers": list(s.chunk_layers) if s.chunk_layers else s.num_layers,
                "recompute": s.recompute,
                **({} if s.data_parallel_size is None
                   else {"data_parallel_size": s.data_parallel_size}),
            }
            for s in self.stages
        ]
        out = {
            "data_parallel_size": self.data_parallel_size,
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.global_batch_size,
            "chips": chips,
            "stages": stages,
        }
        default = "interleaved" if self.virtual_pipeline_size > 1 else "1f1b"
        if self.schedule != default:
            out["schedule"] = self.schedule
        if self.transports:
            out["transports"] = [{"chips": list(link.chips), "transport": link.transport}
                                 for link in self.transports]
        return out

    def to_yaml(self, path: str | Path, header: str | None = None) -> None:
        """Write the plan; ``header`` lines (e.g. the planner's prediction) become YAML comments."""
        data = self.to_dict()
        lines = [f"# {line}".rstrip() for line in (header or "").splitlines()]
        for key in ("data_parallel_size", "micro_batch_size", "global_batch_size"):
            lines.append(f"{key}: {data[key]}")
        lines.append("chips:")
        for name, chip in data["chips"].items():
            key = _flow({name: 0})[1:-4]  # the name as YAML writes a key (quoted if needed)
            lines.append(f"  {key}: {_flow(chip)}")
        lines.append("stages:  # pipeline order: stage 0 holds the embedding, the last the head")
        for stage in data["stages"]:
            lines.append(f"  - {_flow(stage)}")
        if "schedule" in data:
            lines.append(f"schedule: {data['schedule']}")
        if data.get("transports"):
            lines.append("transports:  # the bridge's transfer library per pair of chip types")
            for link in data["transports"]:
                lines.append(f"  - {_flow(link)}")
        Path(path).write_text("\n".join(lines) + "\n")


def _flow(value: Mapping[str, Any]) -> str:
    """One-line YAML flow mapping, e.g. ``{chip: fast, num_layers: 3}``."""
    text = yaml.safe_dump(dict(value), default_flow_style=True, sort_keys=False, width=10_000)
    return cast(str, text).strip()
