"""Stage two of the search: the exact layer split for a fixed sequence of stages.

Given the stages of a pipeline (chip type, TP, position) the split ``l_0 .. l_{p-1}`` (every
stage at least one layer) minimises the cost model's step time

    T(l) = (m - 1) * max_i w_i(l_i) + max_i a_i(l_i) + sum_i w_i(l_i) + links

where ``w_i(l)`` is the stage's forward + backward time per micro-batch with ``l`` layers under
the fastest recompute mode that fits its memory (``inf`` when none fits), ``a_i(l)`` its DP
gradient synchronisation, and ``m`` the number of micro-batches. Both are non-decreasing in ``l``.

For bounds ``W`` on the slowest stage and ``Z`` on the slowest synchronisation each stage can take
at most ``cap_i(W, Z)`` layers, and the best split under those bounds is a small min-plus dynamic
programme over the stages, ``S(W, Z)``. The optimum is ``min (m - 1) W + Z + S(W, Z)`` over the
finitely many values ``W`` and ``Z`` that some ``w_i(l)`` and ``a_i(l)`` take. Both are scanned
upwards from their smallest feasible values until ``(m - 1) W + Z + S(inf, inf)`` cannot beat the
best found, so the result is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from megatron_h2.planner.cost_model import MODES, StageCosts

INF = float("inf")


@dataclass(frozen=True)
class StageSlot:
    """A stage of a fixed pipeline before its layers are known."""

    costs: StageCosts
    first: bool
    last: bool
    in_flight: int


@dataclass(frozen=True)
class Split:
    """An optimal split: layers and recompute mode index per stage, and the predicted step time."""

    layers: tuple[int, ...]
    modes: tuple[int, ...]
    step_time_s: float


class StageTable:
    """Per stage and layer count: work, DP sync time and recompute mode (index into MODES)."""

    def __init__(
        self, slots: list[StageSlot], num_layers: int, mode_caps: list[tuple[int, int, int]]
    ):
        p, size = len(slots), num_layers + 1
        layers = np.arange(size, dtype=np.float64)
        self.work = np.full((p, size), INF)
        self.sync = np.zeros((p, size))
        self.mode = np.full((p, size), -1, dtype=np.int8)
        for i, (slot, caps) in enumerate(zip(slots, mode_caps)):
            c, first, last = slot.costs, slot.first, slot.last
            edge_f = (c.embedding_forward if first else 0.0) + (c.head_forward if last else 0.0)
            edge_b = (c.embedding_backward if first else 0.0) + (c.head_backward if last else 0.0)
            mode = np.full(size, -1, dtype=np.int8)
            for index in range(len(MODES) - 1, -1, -1):  # the fastest fitting mode wins
                mode[: max(caps[index] + 1, 0)] = index
            backward = np.asarray(c.layer_backward)[np.maximum(mode, 0)]
            work = (edge_f + layers * c.layer_forward) + (edge_b + layers * backward)
            self.mode[i] = mode
            self.work[i] = np.where(mode >= 0, work, INF)
            if c.data_parallel_size > 1:
                edge = (c.embedding_params if first else 0.0) + (c.head_params if last else 0.0)
                self.sync[i] = c.sync_fixed + (edge + layers * c.layer_params) * c.sync_per_param
        self.num_layers = num_layers
        with np.errstate(invalid="ignore"):
            marginal = np.diff(self.work, axis=1)  # marginal[i, l - 1] = work(l) - work(l - 1)
        with np.errstate(invalid="ignore"):
            drops = marginal[:, 1:] < marginal[:, :-1] * (1 - 1e-12) - 1e-300
        drops &= np.isfinite(marginal[:, 1:])
        # work_i is convex on 1..convex_i: the greedy fill is exact while caps stay within it
        first_drop = np.where(drops.any(axis=1), drops.argmax(axis=1), num_layers)
        self.convex = first_drop + 1
        self.marginal = np.where(np.isfinite(marginal), marginal, INF)

    def feasible(self, caps: np.ndarray) -> bool:
        """Whether per-stage caps admit a split (every stage one layer or more, total L)."""
        return bool((caps >= 1).all() and caps.sum() >= self.num_layers)

    def best_sum(self, caps: np.ndarray) -> tuple[float, list[int]] | None:
        """Min of sum_i work_i(l_i) with 1 <= l_i <= caps_i and sum l_i = L.

        Greedy (one layer each, then the cheapest marginal layers) where every stage's work is
        convex up to its cap; a min-plus dynamic programme otherwise.
        """
        if (caps < 1).any() or caps.sum() < self.num_layers:
            return None
        if (caps <= self.convex).all():
            return self._greedy(caps)
        return self._programme(caps)

    def _greedy(self, caps: np.ndarray) -> tuple[float, list[int]]:
        p = len(caps)
        extra = self.num_layers - p
        base = float(self.work[:, 1].sum())
        if extra == 0:
            return base, [1] * p
        steps = np.arange(1, self.num_layers)[None, :]  # marginal column j adds layer j + 1
        pool = np.where(steps < caps[:, None], self.marginal[:, 1:], INF)
        flat = pool.ravel()
        chosen = np.argpartition(flat, extra - 1)[:extra]
        counts = np.bincount(chosen // pool.shape[1], minlength=p)
        split = [1 + int(c) for c in counts]
        rows = np.arange(p)
        return float(self.work[rows, split].sum()), split

    def _programme(self, caps: np.ndarray) -> tuple[float, list[int]] | None:
        size = self.num_layers + 1
        total = np.full(size, INF)
        total[0] = 0.0
        choices = []
        for i in range(self.work.shape[0]):
            high = int(min(caps[i], self.num_layers))
            if high < 1:
                return None
            row = self.work[i, 1 : high + 1]
            padded = np.concatenate((np.full(high, INF), total))
            windows = sliding_window_view(padded, high)[
                :size
            ]  # windows[k, x] = total[k - high + x]
            sums = windows + row[::-1]  # column x holds l = high - x
            arg = sums.argmin(axis=1)
            total = sums[np.arange(size), arg]
            choices.append(high - arg)
        if not np.isfinite(total[self.num_layers]):
            return None
        split, remaining = [], self.num_layers
        for i in range(len(choices) - 1, -1, -1):
            layers = int(choices[i][remaining])
            split.append(layers)
            remaining -= layers
        split.reverse()
        return float(total[self.num_layers]), split

    def step_time(self, split: list[int], factor: int, links_s: float) -> float:
        """Step time of a concrete split, as the cost model defines it."""
        rows = np.arange(len(split))
        work = self.work[rows, split]
        return float(factor * work.max() + self.sync[rows, split].max() + work.sum() + links_s)


def _smallest(count: int, ok: object) -> int:
    """Smallest index in ``range(count)`` for which ``ok(index)`` holds (it holds for the last)."""
    lo, hi = 0, count - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):  # type: ignore[operator]
            hi = mid
        else:
            lo = mid + 1
    return lo


def _cap_matrix(values: np.ndarray, table: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """caps[j, i]: most layers of stage i whose ``table`` entry is at most ``values[j]``."""
    caps = np.empty((len(values), table.shape[0]), dtype=np.int64)
    for i in range(table.shape[0]):
        row = np.where(valid[i], table[i], INF)
        caps[:, i] = np.searchsorted(row, values, side="right") - 1
    return caps


def solve_split(
    slots: list[StageSlot],
    num_layers: int,
    num_micro_batches: int,
    links_s: float,
    mode_caps: list[tuple[int, int, int]],
    cutoff: float = INF,
) -> Split | None:
    """Exact best split of ``num_layers`` over ``slots``.

    None if nothing fits or nothing beats ``cutoff``.

    ``mode_caps[i]`` holds, per recompute mode, the most layers stage ``i`` fits in memory.
    ``links_s`` is the constant point-to-point part of the step time.
    """
    table = StageTable(slots, num_layers, mode_caps)
    factor = num_micro_batches - 1
    valid = table.mode >= 0
    loose = valid.sum(axis=1) - 1
    if not table.feasible(loose):
        return None
    works = np.unique(table.work[valid])
    syncs = np.unique(table.sync[valid])
    w_caps, z_caps = _cap_matrix(works, table.work, valid), _cap_matrix(syncs, table.sync, valid)
    w_first = _smallest(len(works), lambda j: table.feasible(w_caps[j]))
    z_min = syncs[_smallest(len(syncs), lambda k: table.feasible(z_caps[k]))]
    if factor * works[w_first] + z_min + works[w_first] + links_s >= cutoff:
        return None
    floor = table.best_sum(loose)
    if floor is None:
        return None
    best, best_value = None, cutoff
    seen: set[bytes] = set()
    for j in range(w_first, len(works)):
        if factor * works[j] + z_min + floor[0] + links_s >= best_value:
            break
        by_work = w_caps[j]
        unbounded = table.best_sum(by_work)  # the same W with no bound on the sync
        if unbounded is None:
            continue
        k_first = _smallest(
            len(syncs), lambda k, w=by_work: table.feasible(np.minimum(w, z_caps[k]))
        )
        for k in range(k_first, len(syncs)):
            if factor * works[j] + syncs[k] + unbounded[0] + links_s >= best_value:
                break
            caps = np.minimum(by_work, z_caps[k])
            key = caps.tobytes()
            if key in seen:
                continue
            seen.add(key)
            found = unbounded if np.array_equal(caps, by_work) else table.best_sum(caps)
            if found is None:
                continue
            value = table.step_time(found[1], factor, links_s)
            if value < best_value:
                best_value, best = value, found[1]
    if best is None:
        return None
    rows = np.arange(len(best))
    modes = tuple(int(m) for m in table.mode[rows, best])
    return Split(tuple(best), modes, best_value)
