"""What the plan search (:mod:`.search`) takes and returns: its options, statistics and result."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_h2.errors import ConfigError
from megatron_h2.plan.orders import SCHEDULES
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.plan.yaml_io import closest, positive_int
from megatron_h2.planner.cost_model import PlanEstimate
from megatron_h2.planner.partition import INF

OWN_DP_SPACES = ("derived", "all", "none")


@dataclass(frozen=True)
class SearchOptions:
    """What to search over and for how long."""

    global_batch_size: int
    top_k: int = 5
    micro_batch_sizes: tuple[int, ...] | None = None
    max_micro_batch_size: int = 8
    time_limit_s: float = 55.0
    grid_points: int = 64
    dive_shapes: int = 24
    dive_nodes: int = 24
    schedules: tuple[str, ...] = SCHEDULES
    """Pipeline schedules to consider (``1f1b``, ``interleaved``, ``zero-bubble``)."""
    max_virtual_stages: int = 4
    """Most model chunks per stage (``V``) under ``interleaved``."""
    own_dp: str = "derived"
    """Plans whose chip types have their own DP degrees: ``derived`` (re-splits of the ``top_k``
    best one-DP plans found under 1f1b or zero-bubble: the same micro-batch size, schedule,
    chip types and TP degrees, any order, each type's DP half, equal to or twice its DP there, all
    its chips used), ``all`` (every such plan: exhaustive, slow on large clusters) or ``none``
    (one DP degree only)."""
    own_dp_share: float = 0.1
    """Share of the time limit kept for the own-DP search: the one-DP search stops at the rest
    of the limit when it has not finished by then (its proven gap then holds at that point);
    the own-DP search runs until the whole limit. No effect with ``own_dp="none"`` or one chip
    type, and none on a search that finishes in time."""

    def __post_init__(self) -> None:
        positive_int(self.global_batch_size, "global_batch_size")
        positive_int(self.top_k, "top_k")
        positive_int(self.max_micro_batch_size, "max_micro_batch_size")
        positive_int(self.grid_points, "grid_points", minimum=8)
        positive_int(self.dive_shapes, "dive_shapes", minimum=0)
        positive_int(self.dive_nodes, "dive_nodes")
        if self.micro_batch_sizes is not None:
            for size in self.micro_batch_sizes:
                positive_int(size, "micro_batch_size")
                if self.global_batch_size % size:
                    raise ConfigError(
                        f"global batch size {self.global_batch_size} is not divisible by micro"
                        f" batch size {size}; pick a micro batch size that divides it"
                    )
        object.__setattr__(self, "schedules", tuple(self.schedules))
        if not self.schedules:
            raise ConfigError("schedules is empty; give at least one of " + ", ".join(SCHEDULES))
        for schedule in self.schedules:
            if schedule not in SCHEDULES:
                raise ConfigError(
                    f"unknown pipeline schedule {schedule!r}{closest(str(schedule), SCHEDULES)};"
                    f" choose from {', '.join(SCHEDULES)}"
                )
        positive_int(self.max_virtual_stages, "max_virtual_stages", minimum=2)
        if self.own_dp not in OWN_DP_SPACES:
            raise ConfigError(
                f"unknown own_dp {self.own_dp!r}; choose from {', '.join(OWN_DP_SPACES)}"
            )
        if not 0 <= self.own_dp_share < 1:
            raise ConfigError(f"own_dp_share must be in [0, 1), got {self.own_dp_share}")
        if not self.time_limit_s > 0:
            raise ConfigError(f"time limit must be positive, got {self.time_limit_s}")

    def schedule_variants(self, num_layers: int) -> list[tuple[str, int]]:
        """(schedule, model chunks) pairs to search; interleaved with every ``V`` from 2 to
        :attr:`max_virtual_stages` that divides the layers (chunks are equal)."""
        variants = []
        for schedule in SCHEDULES:
            if schedule not in self.schedules:
                continue
            if schedule == "interleaved":
                chunks = range(2, self.max_virtual_stages + 1)
                variants += [(schedule, v) for v in chunks if num_layers % v == 0]
            else:
                variants.append((schedule, 1))
        return variants

    def micro_batch_candidates(self) -> list[int]:
        """Micro-batch sizes to try: the given ones, else the powers of two dividing the global
        batch."""
        if self.micro_batch_sizes is not None:
            return sorted(set(self.micro_batch_sizes))
        sizes, size = [], 1
        while size <= self.max_micro_batch_size and self.global_batch_size % size == 0:
            sizes.append(size)
            size *= 2
        return sizes


@dataclass(frozen=True)
class Candidate:
    """A searched plan with its cost-model estimate."""

    plan: HeteroPlan
    estimate: PlanEstimate


@dataclass
class SearchStats:
    """Counters of one search, to show how much was pruned."""

    batch_shapes: int = 0
    batch_shapes_pruned: int = 0
    nodes: int = 0
    nodes_pruned: int = 0
    splits_solved: int = 0
    elapsed_s: float = 0.0
    exhaustive: bool = True
    lower_bound_s: float = INF
    own_dp: str = "none"
    """Which own-DP plans the search covers (:attr:`SearchOptions.own_dp`; ``none`` with one
    chip type)."""
    own_dp_seeds: int = 0
    """One-DP plans whose own-DP re-splits were searched (``own_dp="derived"``)."""
    own_dp_status: str = "complete"
    """``complete``; ``bounded`` (the time limit stopped the own-DP search and its lowest bound
    left is in :attr:`lower_bound_s`); ``not searched`` (the time limit came first: the
    proven gap covers the one-DP plans only)."""
    one_dp_resumed: bool = False
    """The one-DP search paused (:attr:`SearchOptions.own_dp_share` of the limit before its
    end) for the own-DP search and went on in the time left after it."""


@dataclass(frozen=True)
class SearchResult:
    """Best plans first, with search statistics."""

    candidates: tuple[Candidate, ...]
    stats: SearchStats

    @property
    def best(self) -> Candidate:
        """The fastest plan found."""
        return self.candidates[0]
