"""Memory caps of a batch shape's stages (:class:`~megatron_h2.planner.bounds.BatchShape`).

A stage's memory cap depends on how many micro-batches it holds, which its warm-up sets: exact
caps for the stages of a closed pipeline (:meth:`ShapeMemory.mode_caps`), optimistic ones per
warm-up for the bound tables (:meth:`ShapeMemory._memory_caps`), and caps of a suffix's placed
stages in a pipeline at least one stage longer (:meth:`ShapeMemory.placed_block`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_h2.planner.cost_model import MODES
from megatron_h2.planner.held_activations import held_totals, schedule_problem, zero_bubble_peaks
from megatron_h2.planner.partition import INF

if TYPE_CHECKING:
    from collections.abc import Sequence


class ShapeMemory:
    """Memory-cap methods of :class:`~megatron_h2.planner.bounds.BatchShape` (its kinds,
    schedule, grid and caches; kept apart so that each module stays short)."""

    kinds: tuple[Any, ...]
    schedule: str
    chunks: int
    uniform: bool
    total: int
    positions: int
    depth: int
    layers: int
    grid: np.ndarray
    unit: np.ndarray
    _mode_caps: dict[tuple[int, int, int, int | None], tuple[int, int, int]]
    _placed_caps: dict[tuple[int, int, int, int], tuple[int, int, int]]
    _placed: dict[tuple[int, int, int, int, int], np.ndarray]
    _timed: dict[int, np.ndarray]
    _closed: dict[tuple[int, int, int, tuple[int, ...]], np.ndarray]

    def closes(self, stages: int) -> bool:
        """Whether a pipeline of ``stages`` stages can run this shape's schedule."""
        m = self.kinds[0].micro_batches if self.uniform else self.total
        return schedule_problem(self.schedule, stages, m, self.chunks) is None

    def warmups(self, suffix: Sequence[tuple[int, int]]) -> list[int]:
        """Warm-up ``q`` of every stage of a closed pipeline (blocks of (kind, stages), pipeline
        order): :func:`~megatron_h2.plan.orders.routed_leads` of the stages' DP degrees."""
        out: list[int] = []
        lead = 0
        for kind, count in reversed(suffix):
            d = self.kinds[kind].dp
            start = -(-lead // d)
            out += [start + i for i in range(count)]
            lead = d * (start + count)
        return out[::-1]

    def mode_caps(
        self, kind: int, stages: int, stage: int, warmup: int | None = None
    ) -> tuple[int, int, int]:
        """Most units that fit per recompute mode for stage ``stage`` of ``stages`` of ``kind``
        with ``warmup`` warm-up forwards (None: the schedule's own rule; exact, from the
        schedule's held states; cached)."""
        if self.uniform:
            warmup = None  # interleaved: the schedule's own rule
        key = (kind, stages, stage, warmup)
        if key not in self._mode_caps:
            k = self.kinds[kind]
            states = held_totals(self.schedule, stages, k.micro_batches, self.chunks, stage, warmup)
            caps = k.costs.unit_caps(self.chunks, states, stage == 0, stage == stages - 1)
            self._mode_caps[key] = (caps[0], caps[1], caps[2])
        return self._mode_caps[key]

    def _optimistic_pairs(self, m: int, q: int) -> list[tuple[int, int]]:
        """(activations, deferred weight-gradient inputs) held at the peaks of a middle stage
        (no embedding or head) with warm-up ``q`` and ``m`` micro-batches per replica, in the
        pipeline that holds least (under interleaving, uniform DP, ``q`` is the position from
        the end: the shortest pipeline with that position); [] if no stage can have ``q``."""
        if self.schedule == "1f1b":
            return [(min(q + 1, m), 0)]
        if self.schedule == "zero-bubble":  # front index 0, or 1 for the last stage (p >= 2)
            return zero_bubble_peaks(q, m, 1 if q == 0 else 0)
        for stages in range(max(q + 1, 1), self.positions + 1):
            if self.closes(stages):
                totals = held_totals(self.schedule, stages, m, self.chunks, stages - 1 - q)
                return [(t[0], t[1]) for t in totals]
        return []

    def _memory_caps(self) -> np.ndarray:
        """Upper bound on the units per (kind, mode, warm-up) that fit in memory."""
        caps = np.zeros((len(self.kinds), len(MODES), self.depth))
        for m in sorted({k.micro_batches for k in self.kinds}):
            pairs = [self._optimistic_pairs(m, q) for q in range(self.depth)]
            valid = np.array([bool(p) for p in pairs])
            width = max(len(p) for p in pairs)
            padded = np.array(
                [(p or [(0, 0)]) + [(p or [(0, 0)])[0]] * (width - len(p or [0])) for p in pairs],
                dtype=np.float64,
            )  # warm-up x pair x (A, D)
            kinds = [i for i, k in enumerate(self.kinds) if k.micro_batches == m]
            costs = [self.kinds[i].costs for i in kinds]
            act = np.array([c.layer_activation for c in costs])[:, :, None, None]  # kind x mode
            keep = np.array([c.layer_weight_inputs for c in costs])[:, None, None, None]
            held = (padded[None, None, :, :, 0] * act + padded[None, None, :, :, 1] * keep).max(3)
            static = np.array([self.chunks * c.layer_static for c in costs])[:, None, None]
            room = np.array([c.capacity - c.working for c in costs])[:, None, None]
            caps[kinds] = np.where(valid[None, None, :], _most_units(room, static + held), 0.0)
        if self.schedule == "zero-bubble" and self.closes(1):
            # warm-up 0 was the last stage of two or more (front index 1); a pipeline of one
            # stage (front index 0: fewer deferred inputs) may hold more: its exact caps
            one = np.array([self.mode_caps(kind, 1, 0) for kind in range(len(self.kinds))])
            caps[:, :, 0] = np.maximum(caps[:, :, 0], one)
        return caps

    def shortest(self, stages: int) -> int:
        """The fewest stages, at least ``stages``, that can run the schedule (0 if none)."""
        for count in range(max(stages, 1), self.positions + 1):
            if self.closes(count):
                return count
        return 0

    def placed_block(
        self, kind: int, start: int, position: int, count: int, stages: int
    ) -> np.ndarray:
        """Capacity of ``count`` placed stages of ``kind`` with warm-ups from ``start``,
        ``position`` stages before the end, in a pipeline of at least ``stages`` stages (memory
        grows with the pipeline's length under zero-bubble and interleaved): per probe."""
        shortest = self.shortest(stages)
        if not shortest:
            return np.zeros(len(self.grid))
        key = (kind, start, position, count, shortest)
        if key not in self._placed:
            caps = np.array(
                [
                    self._placed_stage_caps(kind, start + i, position + i, shortest)
                    for i in range(count)
                ]
            )
            self._placed[key] = self._timed_sum(kind, caps)
        return self._placed[key]

    def _timed_sum(self, kind: int, caps: np.ndarray) -> np.ndarray:
        """Per probe: units of stages with memory caps ``caps`` (stage x mode) under the time
        caps."""
        timed = self._timed.get(kind)
        if timed is None:  # probe x 1 x mode, per grid
            with np.errstate(divide="ignore", invalid="ignore"):
                timed = np.floor(self.grid[:, None, None] / self.unit[kind][None, None, :])
            timed = self._timed[kind] = np.where(self.unit[kind][None, None, :] > 0, timed, INF)
        per_stage = np.minimum(timed, caps[None, :, :]).max(axis=2)  # probe x stage
        return np.minimum(np.maximum(per_stage, 0), self.layers).sum(axis=1)

    def _placed_stage_caps(
        self, kind: int, warmup: int, position: int, stages: int
    ) -> tuple[int, int, int]:
        key = (kind, warmup, position, stages)
        if key not in self._placed_caps:
            k, stage = self.kinds[kind], stages - 1 - position
            states = held_totals(
                self.schedule,
                stages,
                k.micro_batches,
                self.chunks,
                stage,
                None if self.uniform else warmup,
            )
            if stage == 0:  # not the first stage: more will be placed in front
                states = tuple((a, d, ha, hd, 0) for a, d, ha, hd, _ in states)
            caps = k.costs.unit_caps(self.chunks, states, False, position == 0)
            self._placed_caps[key] = (caps[0], caps[1], caps[2])
        return self._placed_caps[key]

    def closed_block(
        self, kind: int, stages: int, front: int, warmups: Sequence[int]
    ) -> np.ndarray:
        """Capacity of the stages ``front, front + 1, ...`` (counted from the front, with
        ``warmups``) of ``kind`` in a closed pipeline of ``stages`` stages, with their exact
        memory caps: per probe (cached per grid)."""
        key = (kind, stages, front, tuple(warmups))
        if key not in self._closed:
            caps = [self.mode_caps(kind, stages, front + i, q) for i, q in enumerate(warmups)]
            self._closed[key] = self._timed_sum(kind, np.array(caps))
        return self._closed[key]


def _most_units(room: float, per: np.ndarray) -> np.ndarray:
    """Most whole units of ``per`` bytes within ``room`` bytes (exact despite rounding)."""
    units = np.maximum(np.floor(room / per), 0.0)
    units = np.where(units * per > room, np.maximum(units - 1, 0.0), units)
    return np.where((units + 1) * per <= room, units + 1, units)
