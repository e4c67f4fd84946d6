"""The fill and links of a one-DP shape's root, bounded jointly over its chip types' choices.

Under one DP degree (:class:`~megatron_h2.planner.bounds.BatchShape` with ``dp`` given) a chip
type is either unused or runs one stage kind in one block of ``n`` stages, ``n`` from 1 to the
kind's most. Where the slowest folded steady term is at most a probe ``g``, no stage holds more
than its capacity there (time and memory caps, :meth:`~megatron_h2.planner.bounds.BatchShape.
capacity`), so ``n`` stages of a kind hold at most its ``n`` largest capacities over the
warm-ups, and a kind that holds ``x`` layers needs at least the fewest stages whose largest
capacities sum to ``x``. Every stage but one has a link of at least its type's cheapest (a
block of one type sends mostly to itself, and some types' links are several times others'). So
the summed fill plus links of every plan is at least the least, over the choices of one kind
or none per type and its layers ``x`` (summing to ``L``), of ``sum (x fill_k + n_k(x) link)``
minus the largest link, plus the edges' least fill: a knapsack over types and layer counts
``0 .. L`` per probe, like the own-DP shapes' (:mod:`.own_root`) but with the stage count that
the layers need instead of every chip of the type.

The root's loose form takes the fill (the cheapest capacity of every kind at once) and the
links (the fewest stages that hold every layer, each with the cheapest link of any type) apart:
many stages of a type with slow links are then counted at the fastest type's link, which holds
only a few stages. On the 1,024-chip 8-type family member (seed 1) the micro-batch-1
zero-bubble roots rise 1.136 -> 1.234 s (DP 8) and 1.032 -> 1.137 s (DP 4).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_h2.planner.cost_model import zero_bubble_share
from megatron_h2.planner.head_block import (
    add_blocks,
    block_links,
    head_units,
    last_block_links,
    least_with_last,
)

if TYPE_CHECKING:
    from megatron_h2.planner.bounds import BatchShape


def uniform_fill_links(shape: BatchShape, caps: np.ndarray, probes: np.ndarray | None = None,
                       tops: np.ndarray | None = None) -> np.ndarray:
    """Per probe, a lower bound on the summed fill (edges included) plus the links of every
    one-DP plan of ``shape`` whose stages hold at most ``caps`` (kind x probe x warm-up, from
    :meth:`~megatron_h2.planner.bounds.BatchShape.capacity`): the knapsack of the module
    docstring; inf where no choice holds the layers. With the ``probes`` (per row of ``caps``;
    ``tops``: the end-of-step term's top per row, if bounded) the block that ends the pipeline
    is one of the choices (:mod:`.head_block`): its head stage at warm-up 0 and the rest at
    warm-ups ``1 .. n - 1``."""
    heads = None if probes is None else head_units(shape, probes, caps[:, :, 0], tops)
    tables, lasts = uniform_tables(shape, caps, heads)
    if heads is None:
        return least_over_types(shape, tables)
    return least_with_last(shape, tables, lasts)


def uniform_tables(shape: BatchShape, caps: np.ndarray,
                   heads: np.ndarray | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """:func:`uniform_fill_links`' tables per chip type (row x units ``0 .. L``): the least fill
    and links of its block holding that many units, and of its block ending the pipeline with
    its head stage holding at most ``heads`` (kind x row; None: those all inf)."""
    layers, rows = shape.layers, caps.shape[1]
    units = np.arange(1, layers + 1)
    tables, lasts = [], []
    for chip in shape.types:
        value = np.full((rows, layers + 1), np.inf)  # the type holding exactly x units
        last = np.full((rows, layers + 1), np.inf)  # the same, its block ending the pipeline
        for kind in shape.kinds_of[chip]:
            most = min(shape.kinds[kind].max_stages, shape.positions)
            largest = -np.sort(-caps[kind], axis=1)[:, :most]  # probe x stage, largest first
            stages = fewest_stages(largest.cumsum(axis=1), layers)  # probe x units
            fill = units * float(shape.fill_unit[kind])
            spent = fill + block_links(shape, chip, stages)
            np.minimum(value[:, 1:], np.where(stages <= most, spent, np.inf), out=value[:, 1:])
            if heads is None:
                continue
            running = heads[kind][:, None] + np.concatenate(
                (np.zeros((rows, 1)), caps[kind, :, 1:most].cumsum(axis=1)), axis=1)
            stages = fewest_stages(running, layers)
            spent = fill + (stages - 1) * shape.inner_link[chip] + float(shape.head_time[kind])
            held = (stages <= most) & (heads[kind][:, None] >= 1)
            np.minimum(last[:, 1:], np.where(held, spent, np.inf), out=last[:, 1:])
        tables.append(value)
        lasts.append(last)
    return tables, lasts


def least_over_types(shape: BatchShape, tables: list[np.ndarray]) -> np.ndarray:
    """Per probe, the least summed cost over one choice per chip type (its ``tables`` entry:
    probe x units ``0 .. L``, the cost of holding that many units; 0 units: the type unused)
    whose units add up to ``L`` (a min-plus knapsack), less the largest link (one stage has
    none) plus the edges' least fill."""
    layers = shape.layers
    cost = np.full((tables[0].shape[0], layers + 1), np.inf)  # probe x units placed so far
    cost[:, 0] = 0.0
    for table in tables:
        chosen = cost.copy()  # the type unused
        add_blocks(chosen, cost, table)
        cost = chosen
    edges = float(shape.head_time.min() + shape.embedding_time.min())
    return cost[:, layers] - last_block_links(shape) + edges


def fewest_stages(running: np.ndarray, layers: int) -> np.ndarray:
    """Per probe and ``x = 1 .. layers``: one more than the count of ``running`` (probe x
    stages, whole numbers, non-decreasing) below ``x``, the fewest stages that hold ``x``
    units (more than there are where none do)."""
    probes, width = running.shape[0], layers + 2
    index = np.minimum(running, layers + 1).astype(np.int64)
    index += (np.arange(probes) * width)[:, None]
    counts = np.bincount(index.ravel(), minlength=probes * width).reshape(probes, width)
    return counts.cumsum(axis=1)[:, :layers] + 1


LEVELS = 24
"""Levels of the largest end-of-step term on which :func:`level_fill_links` couples it."""


def sync_levels(shape: BatchShape) -> tuple[np.ndarray, np.ndarray] | None:
    """Levels ``Z_0 < Z_1 < ...`` of the largest end-of-step term ``z`` of a one-DP plan
    (``Z_0`` the shape's floor of it, then geometric up to the most any stage can have) and,
    per kind and level ``i``, the most units a stage of the kind holds with ``z <= Z_i+1``
    (no limit at the last level): ``z`` of a stage is at least its DP sync plus, under
    zero-bubble, the deferred weight gradients ``(1 + b) G`` at ``b`` of the longest pipeline,
    and grows with its units (:class:`~megatron_h2.planner.partition.StageTable`'s ``tail``
    without the embedding or head). None where no stage has such a term, and for MoE models
    (whose per-layer sync is a mean over dense and MoE layers)."""
    if shape.cost.model.is_moe:
        return None
    units = np.arange(1, shape.layers + 1, dtype=np.float64)
    tails = np.zeros((len(shape.kinds), shape.layers))
    for index, kind in enumerate(shape.kinds):
        c = kind.costs
        if c.data_parallel_size > 1:
            tails[index] = c.sync_fixed + units * shape.chunks * c.sync_per_layer
        if shape.schedule == "zero-bubble":
            share = 1.0 + zero_bubble_share(max(shape.positions, 2), kind.micro_batches)
            tails[index] += share * c.layer_weight_grad * units
    top, floor = float(tails[:, -1].max()), max(shape.tail_floor, 0.0)
    if not top > floor:
        return None
    levels = np.unique(np.append(floor, np.geomspace(max(floor, 1e-3 * top), top, LEVELS)))
    upper = np.append(levels[1:], np.inf) * (1 + 1e-9)  # float noise never cuts a layer
    held = (tails[:, None, :] <= upper[None, :, None]).sum(axis=2).astype(np.float64)
    return levels, held


def level_fill_links(shape: BatchShape, caps: np.ndarray, found: tuple[np.ndarray, np.ndarray],
                     probes: np.ndarray) -> np.ndarray:
    """:func:`uniform_fill_links` per level (``found`` from :func:`sync_levels`: the levels and
    what a stage of each kind holds at each, kind x level) with every stage's capacity also at
    most what it holds at that level and the head stage's end-of-step term within its top
    (``probes``: per column of ``caps``): level x probe."""
    levels, held = found
    capped = np.minimum(caps[:, None, :, :], held[:, :, None, None])  # kind x level x probe x q
    flat = capped.reshape(caps.shape[0], -1, caps.shape[2])
    tops = np.repeat(np.append(levels[1:], np.inf), caps.shape[1])
    rows = np.tile(probes, len(levels))
    return uniform_fill_links(shape, flat, rows, tops).reshape(held.shape[1], caps.shape[1])
