"""What the placed stages of a pipeline suffix hold at the rows of its floor
(:func:`~megatron_h2.planner.last_floor.node_floor`), their memory caps those of their places in
a pipeline at least as long as the suffix.

The floors' rows (:func:`~megatron_h2.planner.last_floor.last_floors`: a probe interval of the
slowest folded steady term and a level of the end-of-step term) read every stage's capacity from
the shape's table by warm-up (:meth:`~megatron_h2.planner.bounds.BatchShape.capacity`), which
under zero-bubble and interleaving is that of the shortest pipeline with a stage at that
warm-up: a stage's held memory grows with its index from the front (zero-bubble defers the
weight gradients of up to that many micro-batches). A suffix of ``p`` stages fixes each placed
stage's place from the end, and every pipeline below it has at least ``p`` stages, so each
placed stage holds at most its capacity at its place in a pipeline of the fewest stages, at
least ``p``, that runs the schedule (:meth:`~megatron_h2.planner.shape_memory.ShapeMemory.
placed_block`'s caps, which the option bounds of :mod:`.search` use for the same reason), at the
row's probe and within the row's level. On the 1,024-chip 8-type family member (seed 1) a
suffix ``T5 TP1 x45 | T7 TP2 x5 | T2 TP4 x5`` of the micro-batch-1 zero-bubble DP 4 shape has a
floor below the cutoff (1.3164 s) where every child is at 1.47 s or more: its 55 stages hold
far less at the back of a 55-stage pipeline than the table says.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_h2.planner.shape_memory import _most_units

if TYPE_CHECKING:
    from megatron_h2.planner.bounds import BatchShape


class PlacedRows:
    """Per row of a shape's floors the probe its capacities are read at (``probes``, the top of
    its interval) and per kind the most units a stage holds within its level (``held``, kind x
    row); the placed stages' memory caps (per kind, by warm-up and index from the front) and
    time caps (per kind)."""

    def __init__(self, probes: np.ndarray, held: np.ndarray) -> None:
        self.probes, self.held = probes, held
        self._timed: dict[int, np.ndarray] = {}
        self._memory: dict[int, np.ndarray] = {}
        self._bind: dict[int, bool] = {}

    def block_units(self, shape: BatchShape, kind: int, warmups: np.ndarray, behind: int,
                    stages: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
        """Per row of ``rows`` and stage of a placed block of ``kind`` (pipeline order, with
        ``warmups``, ``behind`` stages after it) the most units the stage holds in a pipeline of
        at least ``stages`` stages (per row; each one that runs the schedule): row x stage
        (None where the schedule's memory does not grow with the pipeline's length)."""
        if shape.schedule != "zero-bubble" or not self._binds(shape, kind):
            return None
        count = len(warmups)
        fronts = stages[:, None] - behind - count + np.arange(count)  # index from the front
        warmups = np.minimum(warmups, shape.kinds[kind].micro_batches)  # the same caps beyond
        memory = self._memory_caps(shape, kind, int(warmups.max()))
        caps = memory[warmups[None, :], np.minimum(fronts, memory.shape[1] - 1)]  # row x stage
        if not behind:  # the pipeline's last stage (the head's memory): its exact caps
            for length in np.unique(stages).tolist():
                head = shape._placed_stage_caps(kind, int(warmups[-1]), 0, length)
                caps[stages == length, -1] = head
        timed = self._timed_caps(shape, kind)[rows]  # row x mode
        units = np.minimum(timed[:, None, :], caps).max(axis=2)
        return np.minimum(np.clip(units, 0.0, shape.layers), self.held[kind, rows][:, None])

    def _binds(self, shape: BatchShape, kind: int) -> bool:
        """Whether some stage of ``kind`` (warm-ups up to the positions) holds less at some
        place than its time caps allow at some row, in some mode (else its placed caps are its
        time caps, as the table's: nothing to gain, and none read)."""
        if kind not in self._bind:
            top = self._timed_caps(shape, kind).max(axis=0)  # per mode, the most at any row
            warmups = min(shape.kinds[kind].micro_batches, shape.positions) + 1
            least = self._memory_caps(shape, kind, warmups - 1)[:warmups]
            least = np.minimum(least.min(axis=(0, 1)), shape._placed_stage_caps(
                kind, 0, 0, max(shape.positions, 2)))  # the last stage's too, the longest
            self._bind[kind] = bool((least < np.minimum(top, shape.layers)).any())
        return self._bind[kind]

    def _memory_caps(self, shape: BatchShape, kind: int, warmup: int) -> np.ndarray:
        """:func:`zero_bubble_caps` of ``kind`` up to warm-up ``warmup`` at least (cached,
        twice as many warm-ups when a larger one is asked)."""
        table = self._memory.get(kind)
        if table is None or len(table) <= warmup:
            size = max(warmup + 1, shape.positions + 1, 2 * len(table) if table is not None else 0)
            table = self._memory[kind] = zero_bubble_caps(shape, kind, size)
        return table

    def _timed_caps(self, shape: BatchShape, kind: int) -> np.ndarray:
        """Per row and recompute mode, the most units of ``kind`` within the row's probe."""
        if kind not in self._timed:
            unit = shape.unit[kind]
            with np.errstate(divide="ignore", invalid="ignore"):
                timed = np.floor(self.probes[:, None] / unit[None, :])
            self._timed[kind] = np.where(unit[None, :] > 0, timed, np.inf)
        return self._timed[kind]


def zero_bubble_caps(shape: BatchShape, kind: int, warmups: int) -> np.ndarray:
    """Most units per recompute mode that fit the memory of a zero-bubble stage of ``kind``
    neither first nor last (no embedding, no head), by warm-up ``q < warmups`` and index from
    the front ``s`` (``0 .. positions``): ``q x s x mode``.

    Its held (active, deferred) peaks (:func:`~megatron_h2.planner.held_activations.
    zero_bubble_peaks`) cost ``A act + D keep`` bytes per unit, linear in each; along the
    cool-down ``(q - 1 - c, min(steady + c, s) + 1)`` that is linear in ``c`` up to where the
    deferred count stops growing and falls after it, so its most is at ``c = 0`` or there.
    The most units are the room over the most bytes per unit of the warm-up's two peaks and
    those two (:meth:`~megatron_h2.planner.stage_costs.StageCosts.max_units` of the same
    peaks)."""
    k = shape.kinds[kind]
    costs, m = k.costs, k.micro_batches
    q = np.minimum(np.arange(warmups), m)[:, None].astype(np.float64)  # q x 1
    s = np.arange(shape.positions + 1, dtype=np.float64)[None, :]  # 1 x s
    steady = m - q
    late = np.where(steady > 0, np.minimum(steady - 1, s), 0.0)
    cool = np.where(steady > 0, np.minimum(q - 1, np.maximum(s - steady, 0.0)),
                    np.minimum(s, m - 1))  # the cool-down step where the deferred stop growing
    peaks = [  # (active, deferred, exists)
        (np.where(steady > 0, q + 1, m), np.where(steady > 0, late, 0.0), True),
        (np.where(steady > 0, q, m - 1), late + 1, True),
        (q - 1, np.minimum(steady, s) + 1, (steady > 0) & (q >= 1)),
        (q - 1 - cool, np.minimum(steady + cool, s) + 1, (steady > 0) & (q >= 1)),
        (m - 1 - cool, cool + 1, steady == 0),
    ]
    room = costs.capacity - costs.working
    out = np.zeros((warmups, s.shape[1], len(costs.layer_activation)))
    for mode, act in enumerate(costs.layer_activation):
        per = np.zeros(out.shape[:2])
        for active, deferred, exists in peaks:
            bytes_per = costs.layer_static + active * act + deferred * costs.layer_weight_inputs
            per = np.maximum(per, np.where(exists, bytes_per, 0.0))
        out[:, :, mode] = _most_units(room, per)
    return out
