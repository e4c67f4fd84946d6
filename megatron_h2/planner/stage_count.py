"""The joint knapsack of a one-DP shape's root cells with the pipeline's stage count kept
(:class:`~megatron_h2.planner.joint_root.CellBounds`, the lowest cells once each,
:mod:`.sync_cells`).

The joint knapsack (:func:`~megatron_h2.planner.last_cells.placed_fill_links`) chooses per chip
type a block of ``n`` stages holding ``x`` units, but not how many stages the pipeline has in
all, ``N = sum n``; and ``N`` is what every stage's places and zero-bubble's share of the
deferred weight-gradient work depend on:

* where the layers need at least ``p`` stages at the cell's probe
  (:func:`~megatron_h2.planner.length_floor.fewest_stages`), every plan has ``N >= p``; the
  knapsack's least may use fewer (on the 100,000-chip 70B family member, seed 1, at DP 64: 27
  stages of T1 TP8 and one of T0 where 30 are needed);
* zero-bubble's fill ``W - (1 + b(N)) G`` per unit rises as ``b(N) = min(m - 1, N - 1) /
  (N - 1)`` falls with ``N``; the knapsack takes ``b(p)`` (at DP 128 there its least used 42
  stages where ``p = 30``: ``b`` 0.37, not 0.52).

Here the knapsack runs over (units, stages) with each type's block priced per exact stage count
``n`` (at its places in a pipeline of at least ``max(p, n)`` stages, as the joint knapsack
prices it): per ``N >= p`` the least fill and links of any plan of exactly ``N`` stages, plus
what zero-bubble's fill rises beyond ``b(p)``, at least ``(b(p) - b(N)) G_min`` a unit (``G_min``
the least weight-gradient work of any kind), and the least over ``N``. A few tens of
milliseconds of CPU a cell (``O(sum_t n_t x_t)`` min-plus steps over a units x stages table), so
only the lowest cells get it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_h2.planner.last_cells import head_stage_units, placed_widths

if TYPE_CHECKING:
    from megatron_h2.planner.bounds import BatchShape


def counted_fill_links(
    shape: BatchShape, probes: np.ndarray, per_stage: np.ndarray, stages: np.ndarray,
    tops: np.ndarray,
) -> np.ndarray:
    """Per row (a cell: its probe, per-stage unit caps ``per_stage`` row x kind, fewest
    ``stages`` and end-of-step top ``tops``): the least summed fill (edges included) plus links
    over the stage counts ``N >= stages`` (module docstring); inf where no plan fits."""
    return np.array([_counted_row(shape, probes[i:i + 1], per_stage[i:i + 1],
                                  stages[i:i + 1], tops[i:i + 1]) for i in range(len(probes))])


def _counted_row(shape: BatchShape, probe: np.ndarray, per_stage: np.ndarray,
                 stages: np.ndarray, top: np.ndarray) -> float:
    """:func:`counted_fill_links` for one row (each argument of length one)."""
    from megatron_h2.planner.joint_root import bucket_costs, share_rises  # it imports us

    fewest = int(stages[0])
    if fewest > shape.positions:
        return float("inf")
    counts = np.arange(1, max(min(k.max_stages, shape.positions) for k in shape.kinds) + 1)
    heads = head_stage_units(shape, probe, per_stage, stages, top)  # row x kind
    widths = placed_widths(shape, probe, per_stage, stages, None, counts, counts)
    lasts = placed_widths(shape, probe, per_stage, stages, heads, counts, counts)
    rises = np.repeat(share_rises(shape, stages)[:, :, None], len(counts), axis=2)
    width = min(shape.positions, 2 * fewest + 8) + 1  # the last column: that many or more
    size = (shape.layers + 1, width)  # units x stages
    sends, ends = np.full(size, np.inf), np.full(size, np.inf)  # last block not yet / placed
    sends[0, 0] = 0.0
    for chip in shape.types:
        kinds = shape.kinds_of[chip]
        table = np.min([bucket_costs(shape, k, widths[:, :, k], counts, rises[k], ranges=True)[0]
                        for k in kinds], axis=0)  # stage count x units
        last = np.min([bucket_costs(shape, k, lasts[:, :, k], counts, rises[k], heads[:, k],
                                    ranges=True)[0] for k in kinds], axis=0)
        new_sends, new_ends = sends.copy(), ends.copy()
        _add(new_sends, sends, table)
        _add(new_ends, ends, table)
        _add(new_ends, sends, last)
        sends, ends = new_sends, new_ends
    least = ends[shape.layers] + float(shape.embedding_time.min())  # per stage count
    least = least + _share_rise(shape, fewest)[:width]  # it grows with N: the last column's
    return float(least[fewest:].min())


def _add(out: np.ndarray, before: np.ndarray, table: np.ndarray) -> None:
    """One min-plus step over (units, stages), in place: ``out[u, N] = min(out[u, N],
    before[u - x, N - n] + table[n - 1, x])`` over the finite entries of ``table`` with ``x``
    at least 1; the last column holds that many stages or more (sums beyond it land there)."""
    units, width = out.shape
    tail = np.minimum.accumulate(before[:, ::-1], axis=1)[:, ::-1]  # least of column c on
    for row in np.flatnonzero(np.isfinite(table[:, 1:]).any(axis=1)).tolist():
        n = min(row + 1, width - 1)
        for x in (np.flatnonzero(np.isfinite(table[row, 1:])) + 1).tolist():
            value = table[row, x]
            if n < width - 1:
                np.minimum(out[x:, n:-1], before[: units - x, : width - 1 - n] + value,
                           out=out[x:, n:-1])
            np.minimum(out[x:, -1], tail[: units - x, width - 1 - n] + value, out=out[x:, -1])


def _share_rise(shape: BatchShape, fewest: int) -> np.ndarray:
    """Per stage count ``N = 0 .. positions``: what zero-bubble's fill of ``L`` units rises by
    beyond its share at ``fewest`` stages, at least ``L (b(fewest) - b(N)) G_min`` (0 under
    other schedules, for MoE models and below ``fewest``)."""
    out = np.zeros(shape.positions + 1)
    if shape.schedule != "zero-bubble" or shape.cost.model.is_moe:
        return out
    least = min(k.costs.layer_weight_grad for k in shape.kinds)
    m = shape.kinds[0].micro_batches  # one DP degree: every kind's
    length = np.maximum(np.arange(shape.positions + 1), max(fewest, 2))
    share = np.minimum(m - 1, length - 1) / (length - 1)  # b(N), not rising
    return shape.layers * least * np.maximum(share[0] - share, 0.0)
