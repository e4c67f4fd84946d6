"""Exact early-outs for the option bound of :meth:`~megatron_h2.planner.bounds.BatchShape.bound`.

Most option columns of a bound call are pruned: their bound is not below the K-th best plan's
step time (the ``cutoff``). Below that cutoff a column's value orders the search; at or above
it the value only says "pruned". So each column is first bounded with a *floor* of its summed
fill (:func:`fill_floor`: the layers left at the cheapest per-layer fill of any segment, which
needs neither sorting nor stacking the segments), with the same admissible probes
(:func:`admissible_rows` of the segments' summed widths: the greedy fill covers the layers
exactly where the widths add up to them) and every other term as the exact bound has it; a
column whose floor is at least the cutoff is pruned with that floor, and only the others go
through the exact fill (:func:`take_columns`). Each column's exact value depends on that
column's inputs only, so the columns kept get the same floats as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_h2.planner.partition import INF

MARGIN = 1e-9
"""Relative margin of the floor over the cutoff before a column counts as pruned (the floor
and the exact fill round differently)."""

FLOOR_SIZE = 800
"""Fewest segments x option columns of a bound call that go through the floors first (below,
the exact fill costs less than the floors and the second call; the values are the same)."""


def admissible_rows(
    grid: np.ndarray, covered: Any, remaining: Any, short: Any, need: Any
) -> np.ndarray:
    """Probe rows ``j`` (probe ``g_j+1`` holds the layers left: ``covered`` units of them,
    probe x option) that the bound takes the least term over (the row before the first probe
    where they fit and every row above it, at probes not below ``need``)."""
    ok = (covered >= remaining - 1e-9) & ~np.asarray(short)
    ok = np.broadcast_to(ok, np.broadcast_shapes(np.shape(ok), (len(grid), 1)))
    first = np.where(ok.any(axis=0), ok.argmax(axis=0), len(grid))
    rows = np.arange(len(grid) - 1)[:, None]
    return (rows >= np.maximum(first - 1, 0)[None, :]) & (grid[1:, None] >= need)


def fill_floor(units: np.ndarray, remaining: Any, fixed_cost: Any, edges: Any,
               shape: tuple[int, ...]) -> np.ndarray:
    """A floor of the summed fill wherever the layers left fit (probe x option, ``shape``):
    every layer left at the least per-layer fill of ``units`` (whatever its sign: the layers
    taken add up to those left), plus the known blocks' ``fixed_cost`` and the ``edges``."""
    floor = float(units.min()) * np.maximum(remaining, 0.0) + fixed_cost + edges
    return np.broadcast_to(floor, shape)


def live_columns(floor: np.ndarray, cutoff: float) -> np.ndarray:
    """Indices of the columns whose floor may be below ``cutoff`` (with :data:`MARGIN`)."""
    return np.flatnonzero(floor < cutoff * (1 + MARGIN))


def take_columns(columns: np.ndarray, width: int, *values: Any) -> list[Any]:
    """``values`` restricted to ``columns`` of ``width`` option columns: an array whose last
    axis has ``width`` entries is indexed on it, a sequence (the known blocks' tuples, the
    rates, the fronts) item by item, anything else (one number for every column) kept."""
    out: list[Any] = []
    for value in values:
        if isinstance(value, np.ndarray):
            out.append(value[..., columns] if value.ndim and value.shape[-1] == width else value)
        elif isinstance(value, (list, tuple)):
            item = take_columns(columns, width, *value)
            out.append(tuple(item) if isinstance(value, tuple) else item)
        else:
            out.append(value)
    return out


class ColumnFloor:
    """The unused chip types' summed widths for the floors of
    :class:`~megatron_h2.planner.bounds.BatchShape` (kept apart so that each module stays
    short)."""

    _unused_widths: dict[int, np.ndarray]
    _unused_segments: Any  # :class:`~megatron_h2.planner.rest_bound.RestBound`'s method

    def unused_widths(self, mask: int) -> np.ndarray:
        """The summed widths of the unused types' segments (:meth:`_unused_segments`): the
        most units they add together, probe x grid lead (cached per grid; whole numbers)."""
        if mask not in self._unused_widths:
            self._unused_widths[mask] = self._unused_segments(mask)[1].sum(axis=0)
        return self._unused_widths[mask]


class ColumnTerms:
    """The step-time terms of one bound call per probe row and option column, whatever the
    summed fill (the floor or the exact one): the slowest stage's steady term at least the
    probe (and ``need``), its own work, its fill and tail, the links, and above the top probe
    (when the grid stops below the largest steady term) the work alone."""

    def __init__(self, shape: Any, need: Any, sync: np.ndarray, links: Any, extra: Any,
                 fronts: tuple[np.ndarray, float, float] | None) -> None:
        self.shape, self.links, self.extra, self.fronts = shape, links, extra, fronts
        grid = shape.grid[:, None]
        self.low = np.maximum(grid[:-1], need)
        self.own = shape._own_work(self.low)
        self.beyond = None
        if not shape.grid_is_max:  # work above the top probe: already worse than the K-th best
            top = np.maximum(shape.grid[-1], need)
            if shape.schedule == "zero-bubble":
                self.beyond = shape.steady * top + np.maximum(sync, shape._own_work(top))
            else:
                self.beyond = shape.steady * top + shape._own_work(top) + sync

    def step(self, z: np.ndarray, fill: np.ndarray) -> np.ndarray:
        """The slowest stage's fill + tail (its work) at the end-of-step term ``z``."""
        shape, low, own = self.shape, self.low, self.own
        if shape.schedule == "zero-bubble":
            tail = np.maximum(z, shape.tail_share * own)
            return shape.steady * low + np.maximum(fill[1:] + tail, own)
        return shape.steady * low + np.maximum(fill[1:], own) + z

    def settle(self, probed: np.ndarray, fill: np.ndarray, admissible: np.ndarray) -> np.ndarray:
        """Per column the least term over the ``admissible`` rows (and above the top probe)
        with the end-of-step term at least ``probed`` and the summed ``fill``."""
        return self.least(self.rows(probed, fill, admissible))

    def least(self, rows: np.ndarray) -> np.ndarray:
        """Per column the least of :meth:`rows` (and above the top probe), with the links."""
        best = rows.min(axis=0)
        return (best if self.beyond is None else np.minimum(best, self.beyond)) + self.links

    def rows(self, probed: np.ndarray, fill: np.ndarray, admissible: np.ndarray) -> np.ndarray:
        """Per probe row and column the term of :meth:`settle` without the links (INF where
        not ``admissible``)."""
        extra = self.extra
        if self.fronts is None:
            terms = self.step(probed, fill) + extra
        else:  # close with this block in front, or an unused type's block in front of it
            closing, opening, link = self.fronts
            terms = np.minimum(self.step(np.maximum(probed, closing), fill) + extra,
                               self.step(np.maximum(probed, opening), fill)
                               + np.maximum(extra, link))
        return np.where(admissible, terms, INF)
