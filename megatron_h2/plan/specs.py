"""The parts of a plan: a chip type (:class:`ChipSpec`), a pipeline stage (:class:`StageSpec`)
and the bridge's transport between two chip types (:class:`LinkSpec`), each checked as it is
built. :class:`~megatron_h2.plan.schema.HeteroPlan` puts them together (and documents the file)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_h2.config import RECOMPUTE_MODES, Recompute
from megatron_h2.errors import ConfigError
from megatron_h2.plan.yaml_io import closest, positive_float, positive_int

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

    ``expert_model_parallel_size`` (EP, default 1) and ``expert_tensor_parallel_size`` (ETP,
    default ``None``: the stage's TP degree, as Megatron's ``--expert-tensor-parallel-size``)
    say how the stage's MoE layers split their experts: the stage's ``TP x DP`` ranks are carved
    into ``ETP x EP x expert-DP`` as Megatron-Core carves a pipeline stage's ranks
    (:meth:`check_experts`).
    """

    chip: str
    tensor_parallel_size: int
    num_layers: int
    recompute: Recompute = "none"
    chunk_layers: tuple[int, ...] = ()
    data_parallel_size: int | None = None  # None: the plan's data_parallel_size
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: tensor_parallel_size

    def __post_init__(self) -> None:
        positive_int(self.expert_model_parallel_size, "expert_model_parallel_size")
        if self.expert_tensor_parallel_size is not None:
            positive_int(self.expert_tensor_parallel_size, "expert_tensor_parallel_size")
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

    @property
    def expert_tp(self) -> int:
        """The experts' TP degree: ``expert_tensor_parallel_size``, else the stage's TP."""
        etp = self.expert_tensor_parallel_size
        return self.tensor_parallel_size if etp is None else etp

    def check_experts(self, data_parallel_size: int, num_experts: int | None = None,
                      validate: bool = False) -> None:
        """Raise a one-line ConfigError unless ``ETP x EP`` divides the stage's ``TP x DP``
        ranks (``data_parallel_size``: the stage's DP degree) and, when ``num_experts`` is
        given, EP divides the experts; ``validate``: the model is known, so EP > 1 without
        experts (``num_experts`` None) is an error too."""
        ep, etp = self.expert_model_parallel_size, self.expert_tp
        if validate and num_experts is None and ep > 1:
            raise ConfigError(f"expert_model_parallel_size {ep} is set but the model has no "
                              "experts (--num-experts); remove it or make the model MoE")
        ranks = self.tensor_parallel_size * data_parallel_size
        if ranks % (ep * etp):
            raise ConfigError(f"expert_model_parallel_size {ep} x expert_tensor_parallel_size "
                              f"{etp} = {ep * etp} does not divide the stage's TP x DP = "
                              f"{ranks} ranks; pick EP x ETP dividing {ranks}")
        if num_experts is not None and num_experts % ep:
            raise ConfigError(f"expert_model_parallel_size {ep} does not divide the "
                              f"{num_experts} experts (--num-experts); pick an EP dividing "
                              f"{num_experts}")


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
