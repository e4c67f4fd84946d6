"""Stage two for models whose layers differ: the exact split when dense and MoE layers mix.

With ``--moe-layer-freq`` making some layers MoE and others dense, what a stage costs depends on
*which* layers it holds, not only on how many (:mod:`.partition` counts layers). Here every
stage ``i`` and every contiguous layer range ``[a, b)`` get the terms of the step formula
``T = max_i F_i w_i + sum_i f_i + max_i z_i + links`` (:mod:`.partition`) from the range's dense
and MoE layer counts (:meth:`StageCosts.blend`), with the fastest recompute mode under which the
stage fits in memory over its schedule's held states. For bounds ``W`` on the largest
``F_i w_i`` and ``Z`` on the largest ``z_i`` the least ``sum f_i`` of a split into contiguous
ranges is a min-plus programme over layer positions, ``S(W, Z)``; the optimum is the least
``W + Z + S(W, Z)`` over the values the terms take. ``W`` is scanned upwards from the least
largest work of any split (a min-max programme) until ``W`` + the least largest tail +
``S(inf, inf)`` cannot beat the best found; per ``W``, ``Z`` falls from no bound to just below
the largest tail of each best split found (``S`` only grows as it falls), until ``W`` + the least
largest tail + ``S`` cannot win, so the result is exact. Plans with one chunk per stage only (the
search leaves interleaving out for such models).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_h2.planner.cost_model import MODES, zero_bubble_share
from megatron_h2.planner.held_activations import State
from megatron_h2.planner.partition import INF, Split, step_factors
from megatron_h2.planner.stage_costs import StageCosts


@dataclass(frozen=True)
class RangeSlot:
    """A stage of a fixed pipeline: its costs for dense and for MoE layers (same chip type, TP,
    micro-batch, DP and EP), whether it holds the embedding / head, and its schedule's held
    states (:func:`~megatron_h2.planner.held_activations.held_states`, one chunk)."""

    dense: StageCosts
    moe: StageCosts
    first: bool
    last: bool
    states: tuple[State, ...]


def _terms(slot: RangeSlot, dense: np.ndarray, moe: np.ndarray) -> dict[str, np.ndarray]:
    """Per range (arrays of dense and MoE layer counts): forward, backward and memory per
    recompute mode, weight-gradient and sync seconds, with the embedding / head."""
    d, m, first, last = slot.dense, slot.moe, slot.first, slot.last
    layers = dense + moe
    forward = d.forward(0, first, last) + dense * d.layer_forward + moe * m.layer_forward
    backward = [d.backward(0, r, first, last) + dense * d.layer_backward[r]
                + moe * m.layer_backward[r] for r in range(len(MODES))]
    weight = d.chunk_times(0, 0, first, last)[2] + dense * d.layer_weight_grad \
        + moe * m.layer_weight_grad
    sync = np.zeros_like(forward)
    if d.data_parallel_size > 1:
        fixed = np.where(moe > 0, m.sync_fixed, d.sync_fixed)
        sync = fixed + d.params(0, first, last) * d.sync_per_param \
            + dense * d.sync_per_layer + moe * m.sync_per_layer
    working = np.maximum(np.where(dense > 0, d.working, 0.0), np.where(moe > 0, m.working, 0.0))
    static = d.edge_memory(0, first, last) + working + dense * d.layer_static \
        + moe * m.layer_static
    memory = []
    for r in range(len(MODES)):
        act = dense * d.layer_activation[r] + moe * m.layer_activation[r]
        keep = dense * d.layer_weight_inputs + moe * m.layer_weight_inputs
        peak = np.zeros_like(forward)
        for active, deferred in slot.states:
            held = active[0] * act + deferred[0] * keep
            if first:
                held = held + deferred[0] * d.embedding_weight_inputs
            if last:
                held = held + active[0] * d.head_activation + deferred[0] * d.head_weight_inputs
            peak = np.maximum(peak, held)
        memory.append(np.where(layers > 0, static + peak, INF))
    return {"forward": forward, "backward": np.array(backward), "weight": weight,
            "sync": sync, "memory": np.array(memory)}


class RangeTable:
    """Per stage and layer range ``[a, b)``: the step formula's three terms and the recompute
    mode (``work`` carries the factor ``F_i``; ``INF`` where the range is empty or nothing
    fits)."""

    def __init__(
        self,
        slots: Sequence[RangeSlot],
        layer_is_moe: Sequence[bool],
        micro_batches: Sequence[int],
        schedule: str,
        cache: dict[tuple[object, ...], tuple[np.ndarray, ...]] | None = None,
    ) -> None:
        p, size = len(slots), len(layer_is_moe) + 1
        cache = {} if cache is None else cache  # rows of equal stages, across tables
        moe_before = np.concatenate([[0], np.cumsum(np.asarray(layer_is_moe, dtype=np.int64))])
        start, stop = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
        count = np.maximum(stop - start, 0)
        moe = np.where(stop > start, moe_before[stop] - moe_before[np.minimum(start, stop)], 0)
        dense = count - moe
        factors = step_factors(schedule, micro_batches, 1)
        self.mode = np.full((p, size, size), -1, dtype=np.int8)
        self.work = np.full((p, size, size), INF)
        self.fill = np.full((p, size, size), INF)
        self.tail = np.zeros((p, size, size))
        for i, slot in enumerate(slots):
            share = 1.0 + zero_bubble_share(p, micro_batches[i])
            key = (id(slot.dense), id(slot.moe), slot.first, slot.last, slot.states, size,
                   factors[i], share, schedule)
            if key not in cache:
                cache[key] = self._row(slot, dense, moe, factors[i], share, schedule)
            self.mode[i], self.work[i], self.fill[i], self.tail[i] = cache[key]
        self.num_layers = size - 1

    @staticmethod
    def _row(slot: RangeSlot, dense: np.ndarray, moe: np.ndarray, factor: int, share: float,
             schedule: str) -> tuple[np.ndarray, ...]:
        """(mode, work, fill, tail) of one stage over every range."""
        count = dense + moe
        t = _terms(slot, dense.astype(np.float64), moe.astype(np.float64))
        fits = t["memory"] <= slot.dense.capacity
        mode = np.full(count.shape, -1, dtype=np.int8)
        for r in range(len(MODES) - 1, -1, -1):  # the fastest fitting mode wins
            mode[fits[r]] = r
        mode[count == 0] = -1
        ok = mode >= 0
        backward = np.take_along_axis(t["backward"], np.maximum(mode, 0)[None], axis=0)[0]
        total = t["forward"] + backward
        fill, tail = total, t["sync"]
        if schedule == "zero-bubble":
            fill, tail = total - share * t["weight"], tail + share * t["weight"]
        return (mode, np.where(ok, factor * total, INF), np.where(ok, fill, INF),
                np.where(ok, tail, INF))

    def best_sum(self, w_cap: float, z_cap: float) -> tuple[float, list[int]] | None:
        """Least ``sum_i fill_i`` over splits into contiguous non-empty ranges whose terms stay
        within the bounds (None if there is none), and the split's layer counts."""
        size = self.num_layers + 1
        total = np.full(size, INF)
        total[0] = 0.0
        choices = []
        for i in range(self.fill.shape[0]):
            allowed = (self.work[i] <= w_cap) & (self.tail[i] <= z_cap)
            sums = total[:, None] + np.where(allowed, self.fill[i], INF)  # [start, stop]
            arg = sums.argmin(axis=0)
            total = sums[arg, np.arange(size)]
            choices.append(arg)
        if not np.isfinite(total[-1]):
            return None
        split, stop = [], self.num_layers
        for arg in reversed(choices):
            start = int(arg[stop])
            split.append(stop - start)
            stop = start
        return float(total[-1]), split[::-1]

    def bottleneck(self, terms: np.ndarray) -> float:
        """Least over splits into contiguous non-empty ranges of the largest of the stages'
        ``terms`` (``work`` or ``tail``, per stage and range): a min-max programme."""
        total = np.full(self.num_layers + 1, INF)
        total[0] = 0.0
        for row in terms:
            total = np.maximum(total[:, None], row).min(axis=0)
        return float(total[-1])

    @staticmethod
    def _cells(split: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(stage, start, stop) indices of a concrete split's ranges (layer counts)."""
        starts = np.concatenate([[0], np.cumsum(split)[:-1]]).astype(np.int64)
        return np.arange(len(split)), starts, starts + np.asarray(split, dtype=np.int64)

    def step_time(self, split: Sequence[int], links_s: float) -> float:
        """Step time of a concrete split (layer counts), as the cost model defines it."""
        cells = self._cells(split)
        terms = self.work[cells].max() + self.tail[cells].max()
        return float(terms + self.fill[cells].sum() + links_s)

    def largest_tail(self, split: Sequence[int]) -> float:
        """The largest ``tail`` term of a concrete split (layer counts)."""
        return float(self.tail[self._cells(split)].max())

    def modes(self, split: Sequence[int]) -> tuple[int, ...]:
        """Recompute mode index of every stage of a split."""
        return tuple(int(m) for m in self.mode[self._cells(split)])


def solve_range_split(
    slots: Sequence[RangeSlot],
    layer_is_moe: Sequence[bool],
    micro_batches: Sequence[int],
    links_s: float,
    schedule: str = "1f1b",
    cutoff: float = INF,
    cache: dict[tuple[object, ...], tuple[np.ndarray, ...]] | None = None,
) -> Split | None:
    """Exact best split of the layers (``layer_is_moe``: per global layer, whether it is MoE)
    over ``slots`` (one chunk per stage; ``schedule`` 1f1b or zero-bubble); None if nothing fits
    or nothing beats ``cutoff``; ``cache``: per-stage rows kept across calls (one search)."""
    if schedule == "interleaved":
        raise ValueError("the range split covers one chunk per stage")
    if len(slots) > len(layer_is_moe):
        return None
    table = RangeTable(slots, layer_is_moe, micro_batches, schedule, cache)
    floor = table.best_sum(INF, INF)
    if floor is None:
        return None
    # every split's largest work is at least w_low, its largest tail z_low, its sum the floor
    w_low, z_low = table.bottleneck(table.work), table.bottleneck(table.tail)
    if w_low + z_low + floor[0] + links_s >= cutoff:
        return None
    best, best_value = None, cutoff
    value = table.step_time(floor[1], links_s)
    if value < best_value:
        best_value, best = value, floor[1]
    works = np.unique(table.work[np.isfinite(table.work)])
    for w in works[np.searchsorted(works, w_low):].tolist():
        if w + z_low + floor[0] + links_s >= best_value:
            break
        # the splits whose largest work is at most w, by falling bounds on the tail: each
        # step's best split sets the next bound just below its largest tail; S(w, z) only
        # grows as z falls, so w + z_low + S bounds every split left under w
        z_cap = INF
        while (found := table.best_sum(w, z_cap)) is not None:
            if w + z_low + found[0] + links_s >= best_value:
                break
            value = table.step_time(found[1], links_s)
            if value < best_value:
                best_value, best = value, found[1]
            z_cap = float(np.nextafter(table.largest_tail(found[1]), -INF))
    if best is None:
        return None
    return Split(tuple(best), table.modes(best), best_value)
