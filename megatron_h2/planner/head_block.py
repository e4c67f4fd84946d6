"""A chip type's block in the roots' knapsacks over the chip types' choices: its links, and
the block that ends the pipeline.

Every chip type used by a plan runs one block of contiguous stages (one kind, ``n`` stages), so
``n - 1`` of its links go from a stage of the type to another of the same type, and its last
stage sends to the first stage of the next block, of another type, unless the block ends the
pipeline. So a block of ``n`` stages of type ``t`` costs at least
``(n - 1) l_tt + o_t`` of links (``l_tt`` the type's link to itself, ``o_t`` its cheapest to any
other type of the shape), less ``o_t`` for the last block: summed over the blocks, every plan's
links are at least ``sum_t ((n_t - 1) l_tt + o_t) - max_t o_t``.

The roots' knapsacks (:mod:`.uniform_root`, :mod:`.own_root`, :mod:`.joint_root`) counted ``n``
links at the type's cheapest to any type, ``min(l_tt, o_t)``, less the largest of those. Where a
type's links to itself are slower than to the others (a slow network between its own nodes: on
the 1,024-chip 8-type family member, seed 1, T3 sends 4.97 ms to itself and 3.46 ms to any
other type), a block of many stages was counted at the faster one: a 20-stage T3 block 29 ms
short.

Every plan's last block (one chip type's, one kind, ``n`` stages at warm-ups ``0 .. n - 1``)
holds the head on its last stage, at warm-up 0, with at least one unit: where the slowest folded
steady term is at most a probe ``g``, that stage holds at most ``(g - F h) / (F u)`` units
(``h`` the head's forward and backward, ``u`` the kind's fastest per-unit time; a kind with
``F (h + u) > g`` cannot end the pipeline), and its end-of-step term is the head's sync plus
its units' (at least the kind's :attr:`~megatron_h2.planner.bounds.BatchShape.head_tail` and
growing by ``1 / r`` a unit, ``r`` the kind's sync inverse). The block sends no link onwards and
its fill includes its kind's head (:attr:`~megatron_h2.planner.bounds.BatchShape.head_time`).

The knapsacks of :mod:`.uniform_root` and :mod:`.own_root` took every block as one that sends
onwards, less the largest such link, every kind's last stage as if it held no head, and the
least head fill of any kind. Here one chip type's choice is its block as the last one (a second
table per type) and the knapsack keeps whether the last block is placed: twice the min-plus
work. On the 1,024-chip 8-type family member (seed 1) only T7's kinds can hold the head and a
unit at the probes near the best plans, and the head's sync on T7 with DP 4 (about 30 ms) is
above the levels the micro-batch-1 zero-bubble own-DP root had used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_h2.planner.cost_model import zero_bubble_share

if TYPE_CHECKING:
    from megatron_h2.planner.bounds import BatchShape


def head_units(shape: BatchShape, probes: np.ndarray, first: np.ndarray,
               top: np.ndarray | None = None) -> np.ndarray:
    """Per kind and probe (or row), the most units the pipeline's last stage of that kind holds
    with its head: at most ``first`` (kind x probe, the warm-up-0 caps without the head), the
    time cap at the probe with the head (``probes``: per row, broadcast against ``first``'s
    columns) and, where ``top`` (per row) bounds the end-of-step term, the units with the head's
    sync within it; 0 where the head and one unit do not fit."""
    unit = shape.unit[:, :1]  # the fastest mode's folded time per unit
    fold = (shape.head_need - shape.unit[:, 0])[:, None]  # F x the head's work
    with np.errstate(divide="ignore", invalid="ignore"):
        timed = np.where(unit > 0, np.floor((np.asarray(probes)[None, :] - fold) / unit), np.inf)
        held = np.minimum(first, timed)
        if top is not None:
            slope = unit_sync_slope(shape)[:, None]
            room = np.asarray(top)[None, :] * (1 + 1e-9) - shape.head_tail[:, None]
            synced = np.where(slope > 0, 1.0 + np.floor(room / slope), np.inf)
            held = np.minimum(held, np.where(room >= 0, synced, 0.0))
    return np.where(held >= 1, held, 0.0)


def least_with_last(shape: BatchShape, tables: list[np.ndarray],
                    lasts: list[np.ndarray]) -> np.ndarray:
    """Per probe, the least summed cost over one choice per chip type whose units add up to
    ``L``, exactly one of them the last block: ``tables`` (probe x units ``0 .. L``, 0 units the
    type unused) price a type's block that sends onwards, ``lasts`` (the same shape, inf at 0
    units) the type's block ending the pipeline (its head fill included); plus the edges'
    least embedding fill."""
    layers = shape.layers
    free = np.full((tables[0].shape[0], layers + 1), np.inf)  # no last block yet
    free[:, 0] = 0.0
    done = np.full_like(free, np.inf)  # the last block placed
    for table, last in zip(tables, lasts):
        new_free, new_done = free.copy(), done.copy()
        add_blocks(new_free, free, table)
        add_blocks(new_done, done, table)
        add_blocks(new_done, free, last)
        free, done = new_free, new_done
    return done[:, layers] + float(shape.embedding_time.min())


def add_blocks(out: np.ndarray, before: np.ndarray, table: np.ndarray) -> None:
    """One min-plus step of the roots' knapsacks, in place: ``out[:, x] = min(out[:, x],
    before[:, x - u] + table[:, u])`` over every block size ``u >= 1`` that ``table`` (probe x
    units ``0 .. L``) prices somewhere (``out`` and ``before``: probe x units placed)."""
    layers = out.shape[1] - 1
    for units in np.flatnonzero(np.isfinite(table[:, 1:]).any(axis=0)) + 1:
        np.minimum(out[:, units:], before[:, : layers + 1 - units] + table[:, units : units + 1],
                   out=out[:, units:])


def unit_sync_slope(shape: BatchShape) -> np.ndarray:
    """Per kind, what a stage's end-of-step term grows by with each unit it holds: its DP sync
    per unit (none with one replica) and, under zero-bubble, ``(1 + b) G`` at ``b`` of the
    longest pipeline (as :func:`~megatron_h2.planner.uniform_root.sync_levels` counts it)."""
    slope = np.zeros(len(shape.kinds))
    for index, kind in enumerate(shape.kinds):
        c = kind.costs
        if c.data_parallel_size > 1:
            slope[index] = shape.chunks * c.sync_per_layer
        if shape.schedule == "zero-bubble":
            share = 1.0 + zero_bubble_share(max(shape.positions, 2), kind.micro_batches)
            slope[index] += share * c.layer_weight_grad
    return slope


def block_link_terms(shape: BatchShape) -> tuple[dict[int, float], dict[int, float]]:
    """Per chip type of ``shape``: its stages' link to a stage of the same type (``l_tt``), and
    the cheapest to a stage of another type of the shape (``o_t``; 0 with one type only), each
    in the step time (x the shape's link factor)."""
    names = {t: shape.cost.cluster.chips[t].name for t in shape.types}
    inner = {t: shape.link_factor * shape.link(names[t], names[t]) for t in shape.types}
    outer = {
        t: shape.link_factor * min((shape.link(names[t], names[u]) for u in shape.types if u != t),
                                   default=0.0)
        for t in shape.types
    }
    return inner, outer


def block_links(shape: BatchShape, chip: int, stages: np.ndarray | float) -> np.ndarray | float:
    """The least link time of a block of ``stages`` (at least 1) stages of type ``chip`` that
    does not end the pipeline: ``(n - 1) l_tt + o_t`` (:func:`block_link_terms`)."""
    return (np.asarray(stages) - 1.0) * shape.inner_link[chip] + shape.outer_link[chip]


def last_block_links(shape: BatchShape) -> float:
    """What the block that ends the pipeline does not pay of :func:`block_links`: at most the
    largest ``o_t`` of the shape's types."""
    return max(shape.outer_link.values(), default=0.0)
