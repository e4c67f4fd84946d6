"""Stage two of the search: the exact layer split for a fixed sequence of stages.

Given the stages of a pipeline (chip type, TP, position) and its schedule, the split
``l_0 .. l_{p-1}`` (every stage at least one layer per model chunk) minimises the cost model's
step time, which for every schedule has the form

    T(l) = max_i F_i w_i(l_i) + sum_i f_i(l_i) + max_i z_i(l_i) + links

with each stage's recompute mode the fastest that fits its memory (``inf`` when none fits):

* ``1f1b``: ``F_i = m_i - 1`` (``m_i`` the micro-batches of each of the stage's DP replicas),
  ``w = f = W`` (forward + backward per micro-batch), ``z = Z`` (DP sync);
* ``interleaved`` (``V`` equal chunks per stage): ``F = m V - 1``, ``w = f = W / V``,
  ``z = Z``; the split counts *units* of ``V`` layers (one per chunk), so ``l_i = V u_i``;
* ``zero-bubble``: ``F_i = m_i - 1``, ``w = W``, ``f = W - (1 + b_i) G``, ``z = (1 + b_i) G + Z``
  with ``G`` the weight-gradient part of ``W`` and ``b_i`` from
  :func:`~megatron_h2.planner.cost_model.zero_bubble_share`.

All of ``F w``, ``f`` and ``z`` are non-decreasing in ``l``. For bounds ``W`` on the largest
``F_i w_i`` and ``Z`` on the largest ``z`` each stage can take at most ``cap_i(W, Z)`` units, and
the best split under those bounds is a greedy fill or a small min-plus dynamic programme over
the stages, ``S(W, Z)``. The optimum is ``min W + Z + S(W, Z)`` over the finitely many values
``W`` and ``Z`` that some ``F_i w_i(l)`` and ``z_i(l)`` take. Both are scanned upwards from their
smallest feasible values until ``W + Z + S(inf, inf)`` cannot beat the best found, so the result
is exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from megatron_h2.planner.cost_model import MODES, zero_bubble_share
from megatron_h2.planner.stage_costs import StageCosts

INF = float("inf")


@dataclass(frozen=True)
class StageSlot:
    """A stage of a fixed pipeline before its layers are known (what it holds in memory comes
    with its recompute modes' layer caps)."""

    costs: StageCosts
    first: bool
    last: bool


@dataclass(frozen=True)
class Split:
    """An optimal split: layers and recompute mode index per stage, and the predicted step time."""

    layers: tuple[int, ...]
    modes: tuple[int, ...]
    step_time_s: float


def step_factors(schedule: str, micro_batches: Sequence[int], chunks: int) -> list[int]:
    """``F_i`` of the step formula per stage: ``m_i - 1``, or ``m V - 1`` under interleaving."""
    if schedule == "interleaved":
        return [m * chunks - 1 for m in micro_batches]
    return [m - 1 for m in micro_batches]


class StageTable:
    """Per stage and unit count: the three terms of the step time and the recompute mode.

    A unit is one layer per model chunk (``chunks`` layers). ``mode_caps[i]`` holds, per
    recompute mode, the most units stage ``i`` fits in memory; ``micro_batches`` the
    micro-batches of each of its DP replicas (one number when every stage has the same). The
    ``work`` term already carries the factor ``F_i``.
    """

    def __init__(
        self,
        slots: list[StageSlot],
        num_units: int,
        mode_caps: list[tuple[int, int, int]],
        schedule: str = "1f1b",
        chunks: int = 1,
        micro_batches: int | Sequence[int] = 1,
    ):
        p, size = len(slots), num_units + 1
        counts = [micro_batches] * p if isinstance(micro_batches, int) else list(micro_batches)
        factors = np.array(step_factors(schedule, counts, chunks), dtype=np.float64)[:, None]
        layers = np.arange(size, dtype=np.float64) * chunks
        share = np.array([[1.0 + zero_bubble_share(p, m)] for m in counts])

        def column(value: Callable[[StageCosts], float]) -> np.ndarray:
            """One number per stage, as a column."""
            return np.array([[value(slot.costs)] for slot in slots], dtype=np.float64)

        def edge(name: str) -> np.ndarray:
            """The embedding's ``name`` on the first stage plus the head's on the last."""
            return np.array(
                [
                    [
                        (getattr(slot.costs, f"embedding_{name}") if slot.first else 0.0)
                        + (getattr(slot.costs, f"head_{name}") if slot.last else 0.0)
                    ]
                    for slot in slots
                ]
            )

        caps = np.array(mode_caps, dtype=np.int64).reshape(p, len(MODES))
        steps = np.arange(size)
        mode = np.full((p, size), -1, dtype=np.int8)
        for index in range(len(MODES) - 1, -1, -1):  # the fastest fitting mode wins
            mode[steps[None, :] <= caps[:, index : index + 1]] = index
        backward = np.take_along_axis(
            np.array([slot.costs.layer_backward for slot in slots]), np.maximum(mode, 0), axis=1
        )
        forward = column(lambda c: c.layer_forward)
        work = (edge("forward") + layers * forward) + (edge("backward") + layers * backward)
        synced = column(lambda c: c.data_parallel_size > 1) > 0  # one replica: no DP sync
        per_param = column(lambda c: c.sync_per_param)
        seconds = edge("params") * per_param + layers * column(lambda c: c.sync_per_layer)
        sync = np.where(synced, column(lambda c: c.sync_fixed) + seconds, 0.0)
        weight = edge("weight_grad") + layers * column(lambda c: c.layer_weight_grad)
        fill, tail = work, sync
        if schedule == "interleaved":
            work = fill = work / chunks
        elif schedule == "zero-bubble":
            fill, tail = work - share * weight, sync + share * weight
        self.mode = mode
        self.work = np.where(mode >= 0, factors * work, INF)
        self.fill = np.where(mode >= 0, fill, INF)
        self.tail = tail
        self.num_layers = num_units
        with np.errstate(invalid="ignore"):
            marginal = np.diff(self.fill, axis=1)  # marginal[i, l - 1] = fill(l) - fill(l - 1)
        with np.errstate(invalid="ignore"):
            drops = marginal[:, 1:] < marginal[:, :-1] * (1 - 1e-12) - 1e-300
        drops &= np.isfinite(marginal[:, 1:])
        # fill_i is convex on 1..convex_i: the greedy fill is exact while caps stay within it
        first_drop = np.where(drops.any(axis=1), drops.argmax(axis=1), num_units)
        self.convex = first_drop + 1
        self.marginal = np.where(np.isfinite(marginal), marginal, INF)

    def feasible(self, caps: np.ndarray) -> bool:
        """Whether per-stage caps admit a split (every stage one layer or more, total L)."""
        return bool((caps >= 1).all() and caps.sum() >= self.num_layers)

    def best_sum(self, caps: np.ndarray) -> tuple[float, list[int]] | None:
        """Min of sum_i fill_i(l_i) with 1 <= l_i <= caps_i and sum l_i = L (in units).

        Greedy (one unit each, then the cheapest marginal units) where every stage's fill is
        convex up to its cap; a min-plus dynamic programme otherwise.
        """
        if (caps < 1).any() or caps.sum() < self.num_layers:
            return None
        if (caps <= self.convex).all():
            return self._greedy(caps)
        return self._programme(caps)

    def lower_sum(self, caps: np.ndarray) -> float | None:
        """A lower bound on :meth:`best_sum` (None exactly when it is None for lack of room):
        one unit on every stage and the cheapest marginal units wherever they are, as if every
        fill were convex (rounded down a little, so that it stays below the exact sum)."""
        if (caps < 1).any() or caps.sum() < self.num_layers:
            return None
        extra = self.num_layers - len(caps)
        total = float(self.fill[:, 1].sum())
        if extra:
            steps = np.arange(1, self.num_layers)[None, :]  # column j adds layer j + 1
            pool = np.where(steps < caps[:, None], self.marginal[:, 1:], INF).ravel()
            total += float(np.partition(pool, extra - 1)[:extra].sum())
        return total - 1e-12 * abs(total)

    def _greedy(self, caps: np.ndarray) -> tuple[float, list[int]]:
        p = len(caps)
        extra = self.num_layers - p
        base = float(self.fill[:, 1].sum())
        if extra == 0:
            return base, [1] * p
        steps = np.arange(1, self.num_layers)[None, :]  # marginal column j adds layer j + 1
        pool = np.where(steps < caps[:, None], self.marginal[:, 1:], INF)
        flat = pool.ravel()
        chosen = np.argpartition(flat, extra - 1)[:extra]
        counts = np.bincount(chosen // pool.shape[1], minlength=p)
        split = [1 + int(c) for c in counts]
        rows = np.arange(p)
        return float(self.fill[rows, split].sum()), split

    def _programme(self, caps: np.ndarray) -> tuple[float, list[int]] | None:
        size = self.num_layers + 1
        padded = np.full(self.num_layers + size, INF)  # padded[L + k] = total[k], INF before
        padded[self.num_layers] = 0.0
        total = padded[self.num_layers :]
        every = np.arange(size)
        choices = []
        for i in range(self.work.shape[0]):
            high = int(min(caps[i], self.num_layers))
            if high < 1:
                return None
            row = self.fill[i, 1 : high + 1]
            step = padded.strides[0]
            windows = as_strided(  # windows[k, x] = total[k - high + x] (read only)
                padded[self.num_layers - high :], (size, high), (step, step), writeable=False
            )
            sums = windows + row[::-1]  # column x holds l = high - x
            arg = sums.argmin(axis=1)
            total[:] = sums[every, arg]
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

    def step_time(self, split: list[int], links_s: float) -> float:
        """Step time of a concrete split (in units), as the cost model defines it."""
        rows = np.arange(len(split))
        terms = self.work[rows, split].max() + self.tail[rows, split].max()
        return float(terms + self.fill[rows, split].sum() + links_s)


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
    num_micro_batches: int | Sequence[int],
    links_s: float,
    mode_caps: list[tuple[int, int, int]],
    cutoff: float = INF,
    schedule: str = "1f1b",
    chunks: int = 1,
) -> Split | None:
    """Exact best split of ``num_layers`` over ``slots``.

    None if nothing fits or nothing beats ``cutoff``.

    ``mode_caps[i]`` holds, per recompute mode, the most layers per chunk stage ``i`` fits in
    memory; ``num_micro_batches`` the micro-batches of each DP replica, one number or one per
    stage. ``links_s`` is the constant point-to-point part of the step time. Interleaved
    splits give every chunk of a stage the same number of layers (``num_layers`` must then be a
    multiple of ``chunks``, else there is no split).
    """
    if num_layers % chunks:
        return None
    table = StageTable(slots, num_layers // chunks, mode_caps, schedule, chunks, num_micro_batches)
    valid = table.mode >= 0
    loose = valid.sum(axis=1) - 1
    if not table.feasible(loose):
        return None
    works = np.unique(table.work[valid])
    syncs = np.unique(table.tail[valid])
    w_caps, z_caps = _cap_matrix(works, table.work, valid), _cap_matrix(syncs, table.tail, valid)
    w_first = _smallest(len(works), lambda j: table.feasible(w_caps[j]))
    z_min = syncs[_smallest(len(syncs), lambda k: table.feasible(z_caps[k]))]
    relaxed = table.lower_sum(loose)  # not None: loose is feasible
    if relaxed is None or works[w_first] + z_min + relaxed + links_s >= cutoff:
        return None  # cannot beat the cutoff: no need for the exact floor
    floor = table.best_sum(loose)
    if floor is None:
        return None
    if works[w_first] + z_min + floor[0] + links_s >= cutoff:
        return None
    best, best_value = None, cutoff
    seen: set[bytes] = set()
    for j in range(w_first, len(works)):
        if works[j] + z_min + floor[0] + links_s >= best_value:
            break
        by_work = w_caps[j]
        relaxed = table.lower_sum(by_work)
        if relaxed is None:
            continue
        k_first = _smallest(
            len(syncs), lambda k, w=by_work: table.feasible(np.minimum(w, z_caps[k]))
        )
        if works[j] + syncs[k_first] + relaxed + links_s >= best_value:
            continue  # the loop below would stop at once
        unbounded = table.best_sum(by_work)  # the same W with no bound on the sync
        if unbounded is None:
            continue
        for k in range(k_first, len(syncs)):
            if works[j] + syncs[k] + unbounded[0] + links_s >= best_value:
                break
            caps = np.minimum(by_work, z_caps[k])
            key = caps.tobytes()
            if key in seen:
                continue
            seen.add(key)
            found = unbounded if np.array_equal(caps, by_work) else table.best_sum(caps)
            if found is None:
                continue
            value = table.step_time(found[1], links_s)
            if value < best_value:
                best_value, best = value, found[1]
    if best is None:
        return None
    rows = np.arange(len(best))
    modes = tuple(int(m) for m in table.mode[rows, best])
    return Split(tuple(n * chunks for n in best), modes, best_value)
