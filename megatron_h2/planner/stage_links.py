"""The least link time and number of the stages that chip types not yet placed must add, for
the bounds of :class:`~megatron_h2.planner.bounds.BatchShape`.

The units a suffix's placed blocks cannot take need new stages of unused types, each sending to
the stage after it over a link of at least its type's cheapest ``l_t``
(:attr:`RestBound.type_link`). The loose count (:meth:`RestBound.new_stage_links`) takes every
new stage at the largest capacity of any unused type and the cheapest link of any: at the
lowest option left on the 100,000-chip 70B family member (seed 1) after 20 s of CPU, 11 stages
and 0.023 s, where each type's own capacities and link give 0.053 s (the best plan below it
has 33 stages and 0.224 s of links). This module counts them per type.

A chip type runs one kind ``k`` in one block: ``n`` stages hold at most ``min(n c_k, C_k)``
units, ``c_k`` the most any one of its stages holds in front of the lead and ``C_k`` the most
any block of its most stages holds there, wherever it starts (under zero-bubble the pipeline's
last stage, warm-up 0, holds two deferred inputs and may hold less than the stage in front of
it: so the most over every start from the lead's on, not the block at the lead; other types'
blocks may sit between). Its kinds sorted by
``c_1 >= c_2 >= ...``, the concave ``phi(n)`` with slope ``c_j`` up to ``max(C_1 .. C_j)`` is at
least each of them (before it reaches ``max(C_1 .. C_k)`` its slope is at least ``c_k``). So
``x`` units on that type cost at least ``l_t`` per ``c_j`` units along those segments, a convex
cost; the least total over any split of the units among the types, stages taken fractionally,
is a greedy fill of every type's segments cheapest per unit first: a lower bound on the link
time of every way to place them. Counted in stages (each stage 1, not ``l_t``), the same
greedy's total, rounded up, is a least number of new stages; under zero-bubble the deferred
share ``b(p)`` falls with the pipeline's stages ``p`` (:mod:`.zero_bubble_fill`), so the fill
rises to that of the placed stages plus those.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_h2.planner.zero_bubble_fill import _tables

if TYPE_CHECKING:
    from megatron_h2.planner.bound_columns import ColumnTerms
    from megatron_h2.planner.bounds import BatchShape


def raise_new_stages(shape: BatchShape, terms: ColumnTerms, fill: np.ndarray, mask: int,
                     leads: np.ndarray, units: np.ndarray | float, placed: np.ndarray | float,
                     live: np.ndarray | None) -> np.ndarray:
    """At the probe rows and option columns of ``live`` (row ``j`` of
    :meth:`~megatron_h2.planner.bound_columns.ColumnTerms.rows`, read at probe ``j + 1``; every
    one where None), the new stages' link term ``terms.extra`` at least
    :func:`new_stage_floor`'s, and under zero-bubble the summed ``fill`` (probe x option) with
    the deferred share of a pipeline of the ``placed`` stages plus the fewest new stages that
    hold ``units``: the fill raised by what that adds to
    :func:`~megatron_h2.planner.zero_bubble_fill.share_rise` (already in the fill for the
    placed stages). Only the rows whose term is below the cutoff need it: a column's least term
    below the cutoff is the same, one at or above it stays there. The fill is returned;
    nothing changes where no chip type is unused."""
    if not mask or not shape.uniform:  # own-DP kinds: too many segments for what they add
        return fill
    rows = len(shape.grid)
    if live is None:
        live = np.ones((rows - 1, len(leads)), dtype=bool)
    row, column = np.nonzero(live)
    if not len(row):
        return fill
    probe = row + 1
    index = shape.lead_index(np.asarray(leads))[column]
    need = np.broadcast_to(units, (rows, len(leads)))[probe, column]
    extra = np.array(np.broadcast_to(terms.extra, (rows - 1, len(leads))), dtype=np.float64)
    links = _floor_at(shape, mask, index, probe, need, True)
    extra[row, column] = np.maximum(extra[row, column], links)
    terms.extra = extra
    per_layer, least = _tables(shape)
    if per_layer is None:
        return fill
    placed = np.broadcast_to(np.asarray(placed, dtype=np.int64), (len(leads),))[column]
    new = np.ceil(_floor_at(shape, mask, index, probe, need, False) - 1e-9).astype(np.int64)
    before = np.minimum(np.maximum(least[np.minimum(probe, len(least) - 1)], placed),
                        shape.positions)
    after = np.minimum(np.maximum(before, placed + new), shape.positions)
    out = np.array(np.broadcast_to(fill, (rows, len(leads))), dtype=np.float64)
    out[probe, column] += shape.layers * (per_layer[after] - per_layer[before])
    return out


def new_stage_floor(shape: BatchShape, mask: int, leads: np.ndarray, units: np.ndarray | float,
                    links: bool) -> np.ndarray:
    """Least link time (``links``) or least number of the new stages of the chip types in
    ``mask`` that hold ``units`` (probe x option: what the placed blocks cannot take) in front
    of suffixes with ``leads`` (one per option), stages taken fractionally: probe x option
    (module docstring; 0 where no units are left)."""
    rows, columns = len(shape.grid), len(leads)
    probe, column = np.divmod(np.arange(rows * columns), columns)
    index = shape.lead_index(np.asarray(leads))[column]
    need = np.broadcast_to(units, (rows, columns)).ravel()
    return _floor_at(shape, mask, index, probe, need, links).reshape(rows, columns)


def _floor_at(shape: BatchShape, mask: int, index: np.ndarray, probe: np.ndarray,
              need: np.ndarray, links: bool) -> np.ndarray:
    """:func:`new_stage_floor` at pairs of grid lead ``index`` and probe ``probe``, holding
    ``need`` units each (one value per pair)."""
    ends, rates = _segments(shape, mask, links, index)  # grid lead x segment x probe
    end, rate = ends[index, :, probe], rates[index, :, probe]  # pair x segment, cheapest first
    start = np.zeros_like(end)
    start[:, 1:] = end[:, :-1]
    take = np.clip(np.maximum(need, 0.0)[:, None] - start, 0.0, end - start)
    return (take * rate).sum(axis=1)


def _segments(shape: BatchShape, mask: int, links: bool,
              index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per grid lead and probe, every unused type's capacity segments sorted by link time per
    unit (``links``) or stages per unit: (cumulative units, cost per unit), grid lead x segment
    x probe, sorted at least at the grid leads ``index``; cached on the shape per grid, mask and
    type links, each grid lead sorted when first read."""
    cache = shape.__dict__.setdefault("_new_stage_segments", {})
    key = (shape._grid_key, mask, links, tuple(shape.type_link.values()) if links else ())
    if key not in cache:
        types = [(chip, _type_segments(shape, chip)) for t_index, chip in enumerate(shape.types)
                 if mask >> t_index & 1]
        size = (len(shape.leads), sum(len(w) for _, (w, _) in types), len(shape.grid))
        cache[key] = (types, np.empty(size), np.empty(size), np.zeros(size[0], dtype=bool))
    types, ends, sorted_rates, done = cache[key]
    todo = np.unique(index[~done[index]])
    if len(todo):  # grid lead x segment x probe at the leads not yet sorted
        width = np.concatenate([w[:, :, todo] for _, (w, _) in types]).transpose(2, 0, 1)
        cost = np.concatenate([
            np.where(w[:, :, todo] > 0, (shape.type_link[chip] if links else 1.0)
                     / np.maximum(c[:, :, todo], 1e-30), 0.0)
            for chip, (w, c) in types]).transpose(2, 0, 1)  # fmt: skip
        order = np.argsort(cost, axis=1, kind="stable")
        ends[todo] = np.cumsum(np.take_along_axis(width, order, axis=1), axis=1)
        sorted_rates[todo] = np.take_along_axis(cost, order, axis=1)
        done[todo] = True
    return ends, sorted_rates


def _type_segments(shape: BatchShape, chip: int) -> tuple[np.ndarray, np.ndarray]:
    """One chip type's capacity segments in front of each grid lead: (widths, units per stage),
    kind x probe x grid lead, its kinds sorted by units per stage, largest first (cached on the
    shape per grid)."""
    cache = shape.__dict__.setdefault("_type_capacity_segments", {})
    key = (shape._grid_key, chip)
    if key not in cache:
        per_stage, block = [], []
        for kind in shape.kinds_of[chip]:
            prefix = shape.prefix[kind]  # probe x (warm-up + 1), beyond the table its last
            starts = np.minimum(-(-shape.leads // shape.kinds[kind].dp), shape.depth - 1)
            per_stage.append(_from_on(np.diff(prefix, axis=1))[:, starts])
            count = min(shape.kinds[kind].max_stages, shape.positions)
            windows = prefix[:, count : count + shape.depth] - prefix[:, : shape.depth]
            block.append(_from_on(windows)[:, starts])  # its most stages, wherever they start
        c, cap = np.array(per_stage), np.array(block)
        order = np.argsort(-c, axis=0, kind="stable")
        c = np.take_along_axis(c, order, axis=0)
        reach = np.maximum.accumulate(np.take_along_axis(cap, order, axis=0), axis=0)
        cache[key] = (np.diff(reach, axis=0, prepend=0.0), c)
    return cache[key]


def _from_on(values: np.ndarray) -> np.ndarray:
    """Per row the most of ``values`` from each column on (a suffix maximum along axis 1)."""
    return np.maximum.accumulate(values[:, ::-1], axis=1)[:, ::-1]
