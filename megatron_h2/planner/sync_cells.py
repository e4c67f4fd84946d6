"""The cells of :func:`~megatron_h2.planner.joint_root.deep_root`, refined where its bound is
lowest.

A cell is a probe interval ``(g_lo, g_hi]`` of the slowest folded steady term (two points of the
root's probe grid) and an interval ``(Z_lo, Z_hi]`` of the largest end-of-step term. Every plan
of the one-DP shape whose terms are in the cell has its stages hold at most their caps at
``g_hi`` (time and memory at the fewest stages there, :mod:`.length_floor`) and at most
``r_k Z_hi`` units each (``r_k`` the kind's sync inverse), so its fill and links are at least
the joint knapsack's with those caps (:func:`~megatron_h2.planner.joint_root.joint_fill_links`),
its steady term at least ``g_lo`` and its end-of-step term at least ``Z_lo``: the cell's bound.
The least over cells that cover every plan bounds the shape.

:func:`~megatron_h2.planner.joint_root.deep_root` solved 16 probe intervals by 16 geometric
intervals of ``Z`` (ratio about 1.4 on the 405B family member: a cell charged ``Z_lo`` while its
stages held ``r Z_hi``, a third more layers). Here the lowest cell is split (``Z`` in four
geometric parts, the probe interval in two at a grid point) and its parts bounded, each at
least its parent (a part's plans are its parent's), until the lowest cell reaches the cutoff,
cannot be split or :data:`CELLS` parts have been bounded: the least bound over the cells left
is still a lower bound on every plan of the shape.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable

    from megatron_h2.planner.bounds import BatchShape

CELLS = 384
"""Most cells bounded while refining one shape's root (about 1 ms of CPU each on the
100,000-chip 405B family member)."""

PARTS = 4
"""Parts of a refined cell's ``Z`` interval (geometric)."""

COUNTED = 4
"""Cells bounded with their stage count kept at once (the lowest that are not yet)."""

COUNT_COST = 16
"""What a cell bounded with its stage count kept counts against :data:`CELLS`."""


def refine(
    shape: BatchShape,
    cells: list[tuple[float, int, int, float, float]],
    evaluate: Callable[..., np.ndarray],
    cutoff: float,
    share: float = 1.0,
    count: bool = True,
) -> float:
    """The least bound over ``cells`` (bound, probe index low and high, ``Z`` low and high)
    after refining the lowest ones; ``evaluate`` bounds cells given as arrays of those four
    (probe indices into the root's grid), with ``counted=True`` more tightly
    (:mod:`.stage_count`): the lowest cell is bounded so once (:data:`COUNTED` of the
    lowest at a time; none without ``count``), then split, until ``share`` of :data:`CELLS` is
    spent. Refines no cell whose bound is at least ``cutoff``; inf without cells."""
    heap = [(*cell, not count) for cell in cells]
    heapq.heapify(heap)
    spent = 0
    while heap and heap[0][0] < cutoff and spent < CELLS * share:
        if not heap[0][5]:  # the lowest, not yet bounded with its stage count
            popped = [heapq.heappop(heap) for _ in range(min(COUNTED, len(heap)))]
            batch = [cell for cell in popped if not cell[5]]
            for cell in popped:
                if cell[5]:
                    heapq.heappush(heap, cell)
            lows, highs, zlos, zhis = (np.array(c) for c in zip(*(cell[1:5] for cell in batch)))
            bounds = np.maximum(evaluate(lows, highs, zlos, zhis, counted=True),
                                [c[0] for c in batch])
            spent += COUNT_COST * len(batch)
            for value, cell in zip(bounds.tolist(), batch):
                heapq.heappush(heap, (value, *cell[1:5], True))
            continue
        bound, lo, hi, z_lo, z_hi, _ = heap[0]
        parts = _split(shape, lo, hi, z_lo, z_hi)
        if not parts:
            break  # the lowest cell is as fine as the grid: its bound is the shape's
        heapq.heappop(heap)
        los, his, zlos, zhis = (np.array(column) for column in zip(*parts))
        bounds = np.maximum(evaluate(los, his, zlos, zhis), bound)
        spent += len(parts)
        for value, part in zip(bounds.tolist(), parts):
            heapq.heappush(heap, (value, *part, not count))
    return heap[0][0] if heap else float("inf")


def _split(
    shape: BatchShape, lo: int, hi: int, z_lo: float, z_hi: float
) -> list[tuple[int, int, float, float]]:
    """The parts of a cell: its probe interval halved at a grid point (if it spans two or more
    steps) times its ``Z`` interval in :data:`PARTS` geometric parts (if finite and wider than
    0.1%; ``Z`` is at least the shape's floor of it). Empty if neither splits."""
    probes = [(lo, hi)] if hi - lo < 2 else [(lo, (lo + hi) // 2), ((lo + hi) // 2, hi)]
    low = max(z_lo, shape.tail_floor, 1e-12)
    if np.isfinite(z_hi) and z_hi > low * 1.001:
        edges = np.geomspace(low, z_hi, PARTS + 1)
        edges[-1] = z_hi
        syncs = list(zip([z_lo, *edges[1:-1].tolist()], edges[1:].tolist()))
    else:
        syncs = [(z_lo, z_hi)]
    if len(probes) == 1 and len(syncs) == 1:
        return []
    return [(a, b, c, d) for a, b in probes for c, d in syncs]
