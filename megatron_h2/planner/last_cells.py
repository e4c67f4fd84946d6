"""Blocks at places of pipelines as long as themselves, and the block that ends the pipeline,
in the joint knapsack of a one-DP shape's root cells
(:class:`~megatron_h2.planner.joint_root.CellBounds`).

The joint knapsack (:func:`~megatron_h2.planner.joint_root.kind_costs`) gives every chip type's
block of ``n`` stages its ``n`` best places, with the memory caps of a pipeline of the fewest
stages ``p`` at the cell's probe (:func:`~megatron_h2.planner.length_floor.position_caps`), and
no block holds the head. Two things every plan has that this leaves out:

* A block of ``n`` stages lies in a pipeline of at least ``max(p, n)`` stages. Under
  zero-bubble a stage's caps fall as the pipeline grows (its index from the front ``s`` grows,
  and with it the deferred inputs it holds), so the block's stages hold at most the caps of a
  pipeline of ``max(p, a)`` stages (``a`` the fewest of its stage-count range): its ``n`` best
  places as :mod:`.position_slots` names them for that length (back slots, front slots, each
  once, then the base). With ``p`` alone, 40 stages of T1 TP4 at DP 64 on the 100,000-chip
  70B family member (seed 1) held two units each at the places of a 30-stage pipeline; in a
  40-stage one the last 18 hold one.
* Every plan has one last block, its ``n`` stages at the last ``n`` places, warm-ups
  ``0 .. n - 1`` from the end, in that order (under zero-bubble the places with the most
  deferred inputs), with the caps of a pipeline of ``max(p, a)`` stages there. Its warm-up-0
  stage holds the head: at most ``(g - F h) / (F u)`` units at a probe ``g`` and, where the
  largest end-of-step term is at most ``Z``, only units whose sync with the head's fits in
  ``Z`` (:func:`~megatron_h2.planner.head_block.head_units`); a kind whose head and one unit
  do not fit cannot end the pipeline. The block sends no link onwards and fills its kind's
  head. So one chip type's choice is its block as the last one, and the knapsack keeps whether
  the last block is placed (:func:`~megatron_h2.planner.head_block.least_with_last`): twice
  the min-plus work.

On that member the lowest cell at DP 64 held every layer on 27 stages of T1 TP8 at their best
places, three units each, where the last seven places of any such pipeline hold two, and no
kind's head sync fits under that cell's end-of-step term.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_h2.planner.head_block import head_units, least_with_last
from megatron_h2.planner.length_floor import position_caps
from megatron_h2.planner.position_slots import slot_caps

if TYPE_CHECKING:
    from megatron_h2.planner.bounds import BatchShape


def timed_caps(shape: BatchShape, probes: np.ndarray, per_stage: np.ndarray) -> np.ndarray:
    """Per row, kind and mode: the most units a stage holds at the row's probe (its time cap)
    and at most ``per_stage`` (row x kind): row x kind x mode."""
    with np.errstate(divide="ignore", invalid="ignore"):
        timed = np.where(shape.unit[None] > 0, np.floor(probes[:, None, None] / shape.unit[None]),
                         np.inf)
    return np.minimum(timed, per_stage[:, :, None])


def _best_places(shape: BatchShape, length: int, limit: np.ndarray, count: int,
                 kinds: np.ndarray) -> np.ndarray:
    """Per row, kind, mode and ``n = 1 .. count``: the most units ``n`` stages of the kind hold
    in a pipeline of at least ``length`` stages, each at most ``limit`` (row x kind x mode) and
    in modes up to that one: the best ``n`` of the slots of that length (each once) and the
    base, or, where the places are not slots, of the places' caps (:func:`position_caps`);
    ``kinds``: the kinds of ``limit``'s columns."""
    found = slot_caps(shape, length)
    if found is None:
        places = position_caps(shape, np.array([length]))[0][kinds]  # kind x mode x place
        base = np.zeros(places.shape[:2])
    else:
        places, base = found[0][kinds], found[1][kinds]
    held = np.maximum.accumulate(np.minimum(places[None], limit[:, :, :, None]), axis=2)
    held = -np.sort(-held, axis=3)[:, :, :, :count]
    floor = np.maximum.accumulate(np.minimum(base[None], limit), axis=2)[:, :, :, None]
    more = np.repeat(floor, max(count - held.shape[3], 0), axis=3)  # the base's, no better
    return np.concatenate((held, more), axis=3).cumsum(axis=3)


def _last_places(shape: BatchShape, length: int, limit: np.ndarray, heads: np.ndarray,
                 count: int, kinds: np.ndarray) -> np.ndarray:
    """As :func:`_best_places` for the block that ends the pipeline: its stages at the places
    ``0 .. n - 1`` from the end of a pipeline of at least ``length`` stages, in order, the
    head stage at most ``heads`` (row x kind) units."""
    places = position_caps(shape, np.array([length]))[0][kinds, :, :count]  # kind x mode x place
    held = np.minimum(places[None], limit[:, :, :, None])
    held[:, :, :, 0] = np.minimum(held[:, :, :, 0], heads[:, :, None])
    return np.maximum.accumulate(held, axis=2).cumsum(axis=3)


def placed_widths(
    shape: BatchShape, probes: np.ndarray, per_stage: np.ndarray, stages: np.ndarray,
    heads: np.ndarray | None, low: np.ndarray, high: np.ndarray,
) -> np.ndarray:
    """Per stage-count range ``[low, high]``: the most units ``high`` stages of each kind (at
    most its most stages) hold in modes up to each, in a pipeline of at least ``max(stages,
    low)`` stages (``stages`` per row); with ``heads`` (row x kind) as the block that ends the
    pipeline: mode x row x kind x range."""
    limit = timed_caps(shape, probes, per_stage)  # row x kind x mode
    out = np.zeros((limit.shape[2], len(probes), limit.shape[1], len(low)))
    holds = np.flatnonzero(limit.max(axis=(0, 2)) >= 1)  # the other kinds hold nothing
    if not len(holds):
        return out
    limit, most = limit[:, holds], np.array([min(shape.kinds[k].max_stages, shape.positions)
                                             for k in holds])
    lengths = np.minimum(np.maximum(stages[:, None], low[None, :]), max(shape.positions, 1))
    for length in np.unique(lengths).tolist():  # each length's places once, every range read
        rows = np.flatnonzero((lengths == length).any(axis=1))
        count = int(high[(lengths[rows] == length).any(axis=0)].max())
        if heads is None:
            held = _best_places(shape, int(length), limit[rows], count, holds)
        else:
            held = _last_places(shape, int(length), limit[rows], heads[rows][:, holds], count,
                                holds)
        for index in np.flatnonzero((lengths[rows] == length).any(axis=0)).tolist():
            mine = rows[lengths[rows, index] == length]
            pick = np.clip(np.minimum(most, high[index]), 1, held.shape[3]) - 1  # per kind
            values = held[np.searchsorted(rows, mine)][:, np.arange(len(most)), :, pick]
            column = out[:, :, :, index]  # a view: mode x row x kind
            column[:, mine[:, None], holds[None, :]] = values.transpose(2, 1, 0)
    return np.minimum(out, shape.layers)


def head_stage_units(
    shape: BatchShape, probes: np.ndarray, per_stage: np.ndarray, stages: np.ndarray,
    tops: np.ndarray,
) -> np.ndarray:
    """Per row and kind: the most units the last stage holds with the head
    (:func:`~megatron_h2.planner.head_block.head_units`), its caps without the head those of
    warm-up 0 in a pipeline of at least ``stages`` (per row) stages, at most ``per_stage``."""
    limit = timed_caps(shape, probes, per_stage)  # row x kind x mode
    first = np.zeros(limit.shape[:2])
    for length in np.unique(np.minimum(stages, max(shape.positions, 1))).tolist():
        rows = np.flatnonzero(np.minimum(stages, max(shape.positions, 1)) == length)
        places = position_caps(shape, np.array([length]))[0][:, :, 0]  # kind x mode
        first[rows] = np.minimum(places[None], limit[rows]).max(axis=2)
    return head_units(shape, probes, np.minimum(first, shape.layers).T, tops).T


def placed_fill_links(
    shape: BatchShape, probes: np.ndarray, per_stage: np.ndarray, stages: np.ndarray,
    tops: np.ndarray,
) -> np.ndarray:
    """Per row (a cell: its probe, per-stage unit caps ``per_stage`` row x kind, fewest
    ``stages`` and end-of-step top ``tops``): the joint knapsack with every block at places of
    a pipeline as long as itself, its fill raised by zero-bubble's share of that length, and one
    block ending the pipeline with the head (module docstring); inf where no choice holds the
    layers."""
    from megatron_h2.planner.joint_root import bucket_costs, share_rises, stage_buckets

    most = max(min(k.max_stages, shape.positions) for k in shape.kinds)
    low, high = stage_buckets(most)
    heads = head_stage_units(shape, probes, per_stage, stages, tops)
    widths = placed_widths(shape, probes, per_stage, stages, None, low, high)
    lasts = placed_widths(shape, probes, per_stage, stages, heads, low, high)
    lengths = np.minimum(np.maximum(stages[:, None], low[None, :]), max(shape.positions, 1))
    rises = share_rises(shape, lengths.ravel()).reshape((len(shape.kinds),) + lengths.shape)
    tables, ends = [], []
    for chip in shape.types:
        kinds = shape.kinds_of[chip]
        tables.append(np.min([bucket_costs(shape, k, widths[:, :, k], low, rises[k])
                              for k in kinds], axis=0))
        ends.append(np.min([bucket_costs(shape, k, lasts[:, :, k], low, rises[k], heads[:, k])
                            for k in kinds], axis=0))
    return least_with_last(shape, tables, ends)
