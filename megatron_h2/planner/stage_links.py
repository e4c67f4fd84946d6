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
units, ``c_k`` the most any one of its stages holds in front of the lead (under zero-bubble a
stage further from the end may hold more than the one behind it, so the most over those) and
``C_k`` the most a block of its most stages holds there. Its kinds sorted by
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
                     keep: np.ndarray | None) -> np.ndarray:
    """In the columns of ``keep`` of a bound call (every column where None; only those whose
    bound may still win need it), the new stages' link term ``terms.extra`` at least
    :func:`new_stage_floor`'s, and under zero-bubble the summed ``fill`` (probe x option) with
    the deferred share of a pipeline of the ``placed`` stages plus the fewest new stages that
    hold ``units``: the fill raised by what that adds to
    :func:`~megatron_h2.planner.zero_bubble_fill.share_rise` (already in the fill for the
    placed stages). The fill is returned; nothing changes where no chip type is unused."""
    if not mask or not shape.uniform:  # own-DP kinds: too many segments for what they add
        return fill
    columns = np.arange(len(leads)) if keep is None else np.flatnonzero(keep)
    rows = len(shape.grid)
    need = np.broadcast_to(units, (rows, len(leads)))[:, columns]
    at = np.asarray(leads)[columns]
    links = new_stage_floor(shape, mask, at, need, True)[1:]
    extra = np.array(np.broadcast_to(terms.extra, (rows - 1, len(leads))), dtype=np.float64)
    extra[:, columns] = np.maximum(extra[:, columns], links)
    terms.extra = extra
    per_layer, least = _tables(shape)
    if per_layer is None:
        return fill
    placed = np.broadcast_to(np.asarray(placed, dtype=np.int64), (len(leads),))[columns]
    new = np.ceil(new_stage_floor(shape, mask, at, need, False) - 1e-9).astype(np.int64)
    before = np.minimum(np.maximum(least[:, None], placed[None, :]), shape.positions)
    after = np.minimum(np.maximum(before, placed[None, :] + new), shape.positions)
    out = np.array(np.broadcast_to(fill, (rows, len(leads))), dtype=np.float64)
    out[:, columns] += shape.layers * (per_layer[after] - per_layer[before])
    return out


def new_stage_floor(shape: BatchShape, mask: int, leads: np.ndarray, units: np.ndarray | float,
                    links: bool) -> np.ndarray:
    """Least link time (``links``) or least number of the new stages of the chip types in
    ``mask`` that hold ``units`` (probe x option: what the placed blocks cannot take) in front
    of suffixes with ``leads`` (one per option), stages taken fractionally: probe x option
    (module docstring; 0 where no units are left)."""
    ends, rates = _segments(shape, mask, links)  # segment x probe x grid lead, cheapest first
    index = shape.lead_index(np.asarray(leads))
    need = np.maximum(units, 0.0)
    end, rate = ends[:, :, index], rates[:, :, index]
    start = np.concatenate([np.zeros_like(end[:1]), end[:-1]])
    take = np.clip(need - start, 0.0, end - start)
    return (take * rate).sum(axis=0)


def _segments(shape: BatchShape, mask: int, links: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per grid lead and probe, every unused type's capacity segments sorted by link time per
    unit (``links``) or stages per unit: (cumulative units, cost per unit), segment x probe x
    grid lead; cached on the shape per grid, mask and type links."""
    cache = shape.__dict__.setdefault("_new_stage_segments", {})
    key = (shape._grid_key, mask, links, tuple(shape.type_link.values()) if links else ())
    if key not in cache:
        widths, rates = [], []
        for t_index, chip in enumerate(shape.types):
            if mask >> t_index & 1:
                width, per_stage = _type_segments(shape, chip)
                widths.append(width)
                cost = shape.type_link[chip] if links else 1.0
                rates.append(np.where(width > 0, cost / np.maximum(per_stage, 1e-30), 0.0))
        width, rate = np.concatenate(widths), np.concatenate(rates)
        order = np.argsort(rate, axis=0, kind="stable")
        width = np.take_along_axis(width, order, axis=0)
        cache[key] = (np.cumsum(width, axis=0), np.take_along_axis(rate, order, axis=0))
    return cache[key]


def _type_segments(shape: BatchShape, chip: int) -> tuple[np.ndarray, np.ndarray]:
    """One chip type's capacity segments in front of each grid lead: (widths, units per stage),
    kind x probe x grid lead, its kinds sorted by units per stage, largest first (cached on the
    shape per grid)."""
    cache = shape.__dict__.setdefault("_type_capacity_segments", {})
    key = (shape._grid_key, chip)
    if key not in cache:
        per_stage, block = [], []
        for kind in shape.kinds_of[chip]:
            stage = np.diff(shape.prefix[kind], axis=1)  # probe x warm-up
            most = np.maximum.accumulate(stage[:, ::-1], axis=1)[:, ::-1]  # from there on
            starts = np.minimum(-(-shape.leads // shape.kinds[kind].dp), shape.depth - 1)
            per_stage.append(most[:, np.minimum(starts, most.shape[1] - 1)])
            count = np.array([min(shape.kinds[kind].max_stages, shape.positions)])
            block.append(shape._block_from_leads(shape.prefix, kind, count)[0][:, :, 0])
        c, cap = np.array(per_stage), np.array(block)
        order = np.argsort(-c, axis=0, kind="stable")
        c = np.take_along_axis(c, order, axis=0)
        reach = np.maximum.accumulate(np.take_along_axis(cap, order, axis=0), axis=0)
        cache[key] = (np.diff(reach, axis=0, prepend=0.0), c)
    return cache[key]
