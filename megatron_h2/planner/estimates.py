"""What the cost model's estimates are made of: the cost knobs (:class:`CostConfig`), one stage's
and one plan's estimate (:class:`StageEstimate`, :class:`PlanEstimate`) and the step-time formula
of each pipeline schedule (:func:`step_time_terms`); :mod:`.cost_model` computes them (its
module docstring has the formulas)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_h2.config import (
    MEGATRON_BF16,
    RECOMPUTE_MODES,
    Recompute,
    state_bytes_per_param,
)
from megatron_h2.errors import ConfigError
from megatron_h2.plan.orders import routed_warmups
from megatron_h2.plan.yaml_io import positive_float

MODES: tuple[Recompute, ...] = RECOMPUTE_MODES
"""Recompute modes, fastest first (and most memory-hungry first)."""


@dataclass(frozen=True)
class CostConfig:
    """Tunable constants of the cost model (defaults documented in docs/planner.md)."""

    compute_efficiency: float = 0.5
    comm_efficiency: float = 0.8
    collective_latency_s: float = 10e-6
    p2p_latency_s: float = 20e-6
    memory_usable_fraction: float = 0.9
    memory_reserved_gib: float = 0.0
    use_distributed_optimizer: bool = False
    moe_imbalance: float = 1.2
    """Token imbalance of MoE layers under expert parallelism: the busiest expert-parallel
    rank's routed tokens over the even share (1 = perfect balance). With EP > 1 the experts'
    compute and the all-to-all's bytes are multiplied by it (the slowest rank sets the pace);
    with EP 1 every rank holds every expert and the imbalance costs nothing."""

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "comm_efficiency", "memory_usable_fraction"):
            value = positive_float(getattr(self, name), name)
            if value > 1.0:
                raise ConfigError(f"{name} must be a fraction in (0, 1], got {value}")
        for name in ("collective_latency_s", "p2p_latency_s", "memory_reserved_gib"):
            positive_float(getattr(self, name), name, 0.0, inclusive=True)
        if positive_float(self.moe_imbalance, "moe_imbalance") < 1.0:
            raise ConfigError(f"moe_imbalance must be >= 1 (1: perfectly balanced experts), "
                              f"got {self.moe_imbalance}")
        if not isinstance(self.use_distributed_optimizer, bool):
            raise ConfigError("use_distributed_optimizer must be true or false")

    def bytes_per_param(self, data_parallel_size: int) -> float:
        """Static bytes per parameter of ``--bf16`` training as the runtime allocates it
        (:func:`~megatron_h2.config.state_bytes_per_param`): bf16 weight, fp32 gradient, fp32
        main weight + Adam (sharded with the distributed optimizer)."""
        return state_bytes_per_param(MEGATRON_BF16, data_parallel_size,
                                     self.use_distributed_optimizer)


@dataclass(frozen=True)
class StageEstimate:
    """Predicted numbers for one stage of a plan (times per micro-batch, memory per chip)."""

    chip: str
    tensor_parallel_size: int
    num_layers: int
    recompute: Recompute
    forward_s: float
    backward_s: float
    in_flight: int
    """Peak chunk-micro-batches between forward and backward (micro-batches without chunks)."""
    memory_bytes: float
    capacity_bytes: float
    dp_sync_s: float
    """End-of-step work after the stage's last backward: DP gradient sync + optimizer step."""
    optimizer_s: float = 0.0
    """The optimizer's part of ``dp_sync_s`` (0 unless the profile table measures it)."""
    chunk_layers: tuple[int, ...] = ()
    chunk_forward_s: tuple[float, ...] = ()
    chunk_backward_s: tuple[float, ...] = ()
    chunk_weight_s: tuple[float, ...] = ()
    """Per chunk: the weight-gradient part of ``chunk_backward_s``."""
    deferred: int = 0
    """Peak micro-batches whose weight-gradient work is deferred (zero-bubble)."""

    @property
    def work_s(self) -> float:
        """Forward + backward of one micro-batch (all chunks)."""
        return self.forward_s + self.backward_s

    @property
    def chunk_work_s(self) -> float:
        """Forward + backward of the stage's largest chunk for one micro-batch."""
        return max(f + b for f, b in zip(self.chunk_forward_s, self.chunk_backward_s))

    @property
    def weight_grad_s(self) -> float:
        """Weight-gradient part of the backward of one micro-batch (all chunks)."""
        return sum(self.chunk_weight_s)

    @property
    def fits(self) -> bool:
        """Whether the stage's peak memory fits in the chip's usable memory."""
        return self.memory_bytes <= self.capacity_bytes


@dataclass(frozen=True)
class PlanEstimate:
    """The cost model's prediction for a whole plan."""

    step_time_s: float
    pipeline_s: float
    link_s: float
    dp_sync_s: float
    num_micro_batches: int
    stages: tuple[StageEstimate, ...]
    link_times_s: tuple[float, ...]
    tokens_per_s: float
    mfu: float
    chips_used: dict[str, int] = field(default_factory=dict)
    schedule: str = "1f1b"
    virtual_pipeline_size: int = 1
    wrap_link_s: float = 0.0
    """One-way time of the link from the last stage back to the first (interleaved only)."""
    stage_micro_batches: tuple[int, ...] = ()
    """Micro-batches per DP replica of each stage (``num_micro_batches`` on every stage when
    the DP degree is uniform)."""
    host_cpu_s: float = 0.0
    """CPU emulation (the cluster's ``host_cores``): the step's CPU seconds over all ranks;
    the step takes at least ``host_cpu_s / host_cores``. 0 otherwise."""

    def micro_batches(self, stage: int) -> int:
        """Micro-batches each DP replica of ``stage`` runs per step."""
        return (
            self.stage_micro_batches[stage]
            if self.stage_micro_batches
            else (self.num_micro_batches)
        )

    @property
    def fits(self) -> bool:
        """Whether every stage fits in memory."""
        return all(stage.fits for stage in self.stages)

    def period_s(self, stage: int) -> float:
        """Busy time per step of one DP replica of ``stage`` as the steady state counts it:
        ``m_i W_i``, or under ``interleaved`` ``m V`` x its largest chunk's work."""
        est = self.stages[stage]
        if self.schedule == "interleaved":
            return self.num_micro_batches * self.virtual_pipeline_size * est.chunk_work_s
        return self.micro_batches(stage) * est.work_s

    @property
    def bottleneck(self) -> int:
        """Index of the stage that sets the steady state (largest :meth:`period_s`)."""
        periods = [self.period_s(i) for i in range(len(self.stages))]
        return periods.index(max(periods))

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-time spent idle: 1 - sum of busy time / (stages x step time)."""
        busy = sum(s.work_s * self.micro_batches(i) for i, s in enumerate(self.stages))
        return 1.0 - busy / (len(self.stages) * self.step_time_s)


def zero_bubble_share(stages: int, micro_batches: int) -> float:
    """beta of the zero-bubble step formula: the share of the other stages' weight-gradient work
    that fills the bubble besides their own (1 once there are at least as many micro-batches as
    stages)."""
    return 1.0 if stages == 1 else min(micro_batches - 1, stages - 1) / (stages - 1)


def replica_warmups(
    schedule: str, stage_dps: Sequence[int], chunks: int, total: int
) -> list[int | None]:
    """Warm-up forwards of each stage's replicas in a step of ``total`` micro-batches: the
    schedule's own rule (None) when every stage has the same DP degree, else the runtime's
    :func:`~megatron_h2.plan.orders.routed_warmups`."""
    if len(set(stage_dps)) <= 1:
        return [None] * len(stage_dps)
    return list(routed_warmups(schedule, tuple(stage_dps), chunks, total))


def step_time_terms(
    schedule: str,
    num_micro_batches: int | Sequence[int],
    chunks: int,
    stages: tuple[StageEstimate, ...],
    links: tuple[float, ...],
    wrap_link: float,
) -> tuple[float, float]:
    """(pipeline part, link part) of the step time; the step adds ``max_i Z_i``.

    ``num_micro_batches``: micro-batches per DP replica, one number or one per stage (stages
    with their own DP degree ``d_i`` run ``m_i = M / d_i`` each; ``(m - 1) max W`` then reads
    ``max_i (m_i - 1) W_i``, ``(m V - 1) max W`` reads ``max_i (m_i V - 1) W_i`` and ``b`` is
    per stage).

    With ``W_i`` stage ``i``'s forward + backward per micro-batch (all its chunks), ``G_i`` the
    weight-gradient part of ``W_i``, ``Z_i`` its end-of-step sync, ``l_j`` the one-way link
    times and ``l_ring = sum l + l_wrap`` (see docs/planner.md)::

        1f1b:         (m - 1) max W + sum W                                  + 2 sum l
        interleaved:  ((m V - 1) max W + sum W) / V                  + 2 sum l + 2 (V - 1) l_ring
        zero-bubble:  (m - 1) max W + sum (W - (1 + b) G) + max ((1 + b) G + Z) - max Z + 2 sum l

    with ``b = min(m - 1, p - 1) / (p - 1)`` (:func:`zero_bubble_share`). Each is exact on a
    uniform pipeline (equal stages, equal chunks) whose transfers hide behind compute.
    """
    p = len(stages)
    counts = (
        [num_micro_batches] * p if isinstance(num_micro_batches, int) else list(num_micro_batches)
    )
    link = 2.0 * sum(links)
    work = [s.work_s for s in stages]
    if schedule == "interleaved":  # per-stage DP: max_i (m_i V - 1) W_i, as 1F1B's max
        ring = sum(links) + wrap_link  # one trip round the ring of stages
        steady = max((m * chunks - 1) * w for m, w in zip(counts, work))
        return (steady + sum(work)) / chunks, link + 2.0 * (chunks - 1) * ring
    steady = max((m - 1) * w for m, w in zip(counts, work))
    if schedule == "zero-bubble":
        shares = [1.0 + zero_bubble_share(p, m) for m in counts]
        fill = sum(w - b * s.weight_grad_s for w, b, s in zip(work, shares, stages))
        tail = max(b * s.weight_grad_s + s.dp_sync_s for b, s in zip(shares, stages))
        return steady + fill + tail - max(s.dp_sync_s for s in stages), link
    return steady + sum(work), link
