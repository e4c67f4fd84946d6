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
    dive_stale: int = 4
    """The short dives stop after this many batch shapes in a row whose dives found no better
    plan (the search's time then goes to the bounds; :mod:`.dives`)."""
    schedules: tuple[str, ...] = SCHEDULES
    """Pipeline schedules to consider (``1f1b``, ``interleaved``, ``zero-bubble``)."""
    max_virtual_stages: int = 4
    """Most model chunks per stage (``V``) under ``interleaved``."""
    own_dp: str = "all"
    """Plans whose chip types have their own DP degrees (1f1b and zero-bubble; each such type
    uses all its chips): ``all`` (every such plan, searched after the re-splits of the
    ``top_k`` best one-DP plans found, which find good ones early), ``derived`` (the re-splits
    only: the same micro-batch size, schedule and chip types in any order, each type any TP
    degree and half, equal to or twice its stages there; the other own-DP plans are bounded by
    their batch shapes' roots, so the proven gap still covers them) or ``none`` (one DP degree
    only: the searched space is then that of one DP degree)."""
    own_dp_share: float = 0.1
    """Share of the time limit kept for the own-DP search: the one-DP search pauses at the rest
    of the limit when it has not finished by then, the re-splits run, and the rest of the search
    (one-DP and own-DP suffixes together, best bound first) goes on until the whole limit. No
    effect with ``own_dp="none"`` or one chip type, and none on a search that finishes in
    time."""
    merge_ep: bool = True
    """MoE models: search the pipeline structure over stage kinds merged across their EP
    degrees (:mod:`~megatron_h2.planner.merged_shape`) and choose each block's EP degree when
    a pipeline closes; False searches every (chip type, TP, DP, EP) kind separately (the same
    plans, for comparisons)."""
    polish: bool = True
    """Climb from each new best plan to faster neighbouring plans (:mod:`.improve`): better
    plans sooner, the same space and the same meaning of the proven bound."""
    max_prefixes: int | None = None
    """Benches and tests only: stop after this many pipeline prefixes as at the time limit
    (the pause for own DP at the same share of them), so that two versions of the search can
    be compared on the same work whatever the clock (None: the time limit alone)."""
    cutoff_s: float = INF
    """Only plans faster than this are sought (the data-parallel pipelines search passes the
    best step it must beat): a bound at or above it prunes as the K-th best would, and a
    search that finds none returns no candidates (exhaustive: every plan of its space takes at
    least this) instead of an error."""

    def __post_init__(self) -> None:
        positive_int(self.global_batch_size, "global_batch_size")
        positive_int(self.top_k, "top_k")
        positive_int(self.max_micro_batch_size, "max_micro_batch_size")
        positive_int(self.grid_points, "grid_points", minimum=8)
        positive_int(self.dive_shapes, "dive_shapes", minimum=0)
        positive_int(self.dive_nodes, "dive_nodes")
        positive_int(self.dive_stale, "dive_stale")
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

    def space_text(self, num_layers: int, chip_types: int, mixed_layers: bool = False) -> str:
        """The plan space the search covers, in words (what its "optimal" and gap are over);
        ``mixed_layers``: a model with dense and MoE layers (no interleaving)."""
        variants = self.schedule_variants(num_layers)
        if mixed_layers:
            variants = [v for v in variants if v[0] != "interleaved"]
        names = [s for s, v in variants if v == 1]
        chunks = [v for s, v in variants if s == "interleaved"]
        if chunks:
            names.append(
                f"interleaved V={chunks[0]}" + (f"-{chunks[-1]}" if len(chunks) > 1 else "")
            )
        sizes = self.micro_batch_candidates()
        text = (
            "one pipeline, each chip type used one block of stages with one TP degree, micro-batch"
            f" {'/'.join(map(str, sizes))}, {', '.join(names)}, every layer split;"
        )
        own = [s for s, v in variants if s != "interleaved"]
        if chip_types < 2 or self.own_dp == "none" or not own:
            return text + " one DP degree for every stage"
        return (
            text + " one DP degree for every stage, or under " + "/".join(own)
            + " each chip type its own DP degree using all its chips"
        )

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
    """One-DP plans whose own-DP re-splits were searched."""
    one_dp_resumed: bool = False
    """The one-DP search paused (:attr:`SearchOptions.own_dp_share` of the limit before its
    end) for the own-DP search and went on in the time left after it."""
    space: str = ""
    """The plan space that :attr:`lower_bound_s` covers, in words
    (:meth:`SearchOptions.space_text`)."""


@dataclass(frozen=True)
class SearchResult:
    """Best plans first, with search statistics."""

    candidates: tuple[Candidate, ...]
    stats: SearchStats

    @property
    def best(self) -> Candidate:
        """The fastest plan found."""
        return self.candidates[0]

    @property
    def gap(self) -> float:
        """Proven relative gap of the best plan over the searched space (:attr:`SearchStats.space`):
        0 when it is proven optimal there."""
        best, bound = self.best.estimate.step_time_s, self.stats.lower_bound_s
        if bound >= best * (1 - 1e-9):
            return 0.0
        return best / bound - 1 if bound > 0 else INF
