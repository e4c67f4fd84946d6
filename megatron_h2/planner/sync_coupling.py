"""The end-of-step term coupled with the steady term, for the bounds of
:class:`~megatron_h2.planner.bounds.BatchShape`.

A stage's end-of-step term ``z`` (its DP sync, under zero-bubble with the deferred weight
gradients) grows at least linearly in its layers: ``z >= l / r`` with ``r`` the stage kind's
:attr:`~megatron_h2.planner.bounds.BatchShape.sync_inverse`. So where the largest ``z`` of a
plan is at most ``Z``, a group of stages with summed rate ``R`` holds at most ``Z R`` layers,
besides at most its capacity ``a`` at the probe of the slowest stage's steady term. The layers
must fit: ``sum_i min(a_i, Z R_i) >= L``. The least such ``Z`` (:func:`least_sync`) is a lower
bound on the largest ``z`` of every plan whose slowest steady term is at most the probe: where
few layers fit per stage at a probe, the layers crowd onto the stages that sync slowly, or the
steady term grows. This couples the two terms that the bound otherwise takes apart (the steady
term from a pipeline of one layer per stage, the sync from the layers spread over every stage).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence


class SyncCoupling:
    """The coupled sync bound of :class:`~megatron_h2.planner.bounds.BatchShape` (its kinds,
    grid and the unused types' tables; kept apart so that each module stays short)."""

    types: list[int]
    layers: int
    grid: np.ndarray
    sync_inverse: np.ndarray
    type_sync_inverse: dict[int, float]
    _type_caps: dict[int, np.ndarray]
    segment_table: Any  # :class:`~megatron_h2.planner.rest_bound.RestBound`'s methods
    lead_index: Any

    def block_rates(self, suffix: Sequence[tuple[int, int]]) -> list[float]:
        """Per block of a suffix (pipeline order), in the order its groups were prepended
        (the suffix's last block first), its kind's :attr:`sync_inverse` (``rates`` of
        :meth:`~megatron_h2.planner.bounds.BatchShape.bound`)."""
        return [float(self.sync_inverse[kind]) for kind, _ in reversed(suffix)]

    def type_caps(self, chip: int) -> np.ndarray:
        """Most units an unused chip type holds in front of each grid lead, whatever its
        kind: probe x grid lead (the sum of its cost segments' widths; cached per grid)."""
        if chip not in self._type_caps:
            self._type_caps[chip] = self.segment_table(chip).sum(axis=0)
        return self._type_caps[chip]

    def coupled_sync(
        self,
        fixed: Sequence[tuple[float, np.ndarray, np.ndarray | int]],
        rates: Sequence[np.ndarray | float] | None,
        unused: int,
        leads: np.ndarray,
    ) -> np.ndarray | None:
        """Lower bound on the largest end-of-step term per probe and option column when the
        slowest steady term is at most the probe (:func:`least_sync` over the known blocks,
        each holding at most its capacity and ``stages x rate / Z``, and the unused types,
        each at most its capacity in front of the option's lead and its
        :attr:`type_sync_inverse` / ``Z``); None where nothing couples (no rates known and no
        unused type)."""
        caps: list[np.ndarray] = []
        summed: list[np.ndarray | float] = []
        for index, (_, block, count) in enumerate(fixed):
            rate = np.inf if rates is None else rates[index]
            caps.append(block)
            stages = np.asarray(count, dtype=np.float64)
            with np.errstate(invalid="ignore"):  # 0 stages x inf: no group
                summed.append(np.where(stages > 0, stages * rate, 0.0))
        if unused:
            at = self.lead_index(np.asarray(leads))
            for t_index, chip in enumerate(self.types):
                if unused >> t_index & 1:
                    caps.append(self.type_caps(chip)[:, at])
                    summed.append(self.type_sync_inverse[chip])
        if not caps or (rates is None and not unused):
            return None
        return least_sync(caps, summed, float(self.layers))


def least_sync(
    caps: Sequence[np.ndarray], rates: Sequence[np.ndarray | float], layers: float
) -> np.ndarray:
    """The least ``Z`` with ``sum_i min(caps_i, Z rates_i) >= layers`` (``caps_i``: probe x
    option capacities of group ``i``, ``rates_i``: its summed rate per option or one number;
    ``inf``: a group without DP sync, which holds its capacity at any ``Z``): probe x option.

    The sum is concave, piecewise linear and non-decreasing in ``Z`` with breakpoints
    ``caps_i / rates_i``; between two consecutive breakpoints it is linear, so the crossing is
    exact. Where even ``Z = inf`` does not hold the layers, the largest breakpoint (no plan
    has its slowest steady term there: any value bounds it).
    """
    shape = np.broadcast_shapes(*(np.shape(c) for c in caps))
    a = np.empty((len(caps),) + shape)
    r = np.empty((len(caps),) + shape)
    for index, (cap, rate) in enumerate(zip(caps, rates)):
        r[index] = rate
        a[index] = np.where(r[index] > 0, np.maximum(cap, 0.0), 0.0)  # rate 0: holds none
    free = np.isinf(r) | (a <= 0.0)  # held at any Z > 0: breakpoint 0, no slope after it
    with np.errstate(divide="ignore", invalid="ignore"):
        points = np.where(free, 0.0, a / np.where(free, 1.0, r))
    slopes = np.where(free, 0.0, r)
    order = np.argsort(points, axis=0)
    points = np.take_along_axis(points, order, axis=0)
    held = np.take_along_axis(a, order, axis=0).cumsum(axis=0)  # saturated up to each point
    later = slopes.sum(axis=0) - np.take_along_axis(slopes, order, axis=0).cumsum(axis=0)
    covered = held + points * later  # the sum at each breakpoint (sorted)
    below = (covered < layers).sum(axis=0)  # breakpoints where the layers do not fit yet
    last = len(caps) - 1
    at = np.minimum(np.maximum(below - 1, 0), last)[None]
    base = np.take_along_axis(points, at, axis=0)[0]
    value = np.take_along_axis(covered, at, axis=0)[0]
    slope = np.take_along_axis(later, at, axis=0)[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        step = np.where(slope > 0, (layers - value) / np.where(slope > 0, slope, 1.0), 0.0)
    crossing = base + np.maximum(step, 0.0)
    # below the first breakpoint: the groups without sync held, the others' rates all count
    start = np.where(free, a, 0.0).sum(axis=0)
    total = slopes.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        first = np.where(total > 0, (layers - start) / np.where(total > 0, total, 1.0), 0.0)
    crossing = np.where(below == 0, np.maximum(first, 0.0), crossing)
    crossing = np.where(below > last, points[last], crossing)  # never fits: any value
    # the crossing lies at or below the next breakpoint (exact up to rounding)
    upper = np.take_along_axis(points, np.minimum(below, last)[None], axis=0)[0]
    return np.minimum(crossing, upper)
