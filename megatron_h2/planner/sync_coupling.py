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

from megatron_h2.planner.lead_cache import at_leads
from megatron_h2.planner.option_group import OptionGroup

if TYPE_CHECKING:
    from collections.abc import Sequence


COUPLED_PROBES = 16
"""Probes of the grid at which :meth:`SyncCoupling.coupled_sync` solves :func:`least_sync`; a
probe between them reads the next one up (more capacity there, so a smaller ``Z``: still a
bound)."""


class SyncCoupling:
    """The coupled sync bound of :class:`~megatron_h2.planner.bounds.BatchShape` (its kinds,
    grid and the unused types' tables; kept apart so that each module stays short)."""

    types: list[int]
    layers: int
    grid: np.ndarray
    sync_inverse: np.ndarray
    type_sync_inverse: dict[int, float]
    _type_caps: dict[int, np.ndarray]
    _coupled_type_caps: np.ndarray | None
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
        keep: np.ndarray | None = None,
    ) -> np.ndarray | None:
        """Lower bound on the largest end-of-step term per probe and option column when the
        slowest steady term is at most the probe (:func:`least_sync` over the known blocks,
        each holding at most its capacity and ``stages x rate x Z``, and the unused types,
        each at most its capacity in front of the option's lead and its
        :attr:`type_sync_inverse` ``x Z``), solved at :data:`COUPLED_PROBES` probes of the
        grid; None where nothing couples (no rates known and no unused type). With ``keep``
        (a mask of the columns) only those are solved, the others read ``-inf`` (no bound;
        each column's value does not depend on the others)."""
        if rates is None and not unused:
            return None
        rows, fine = self._coupled_rows()
        chips = [t for t in range(len(self.types)) if unused >> t & 1]
        leads = np.atleast_1d(leads)
        width, every = len(leads), leads
        if keep is not None:  # each column's value depends on that column only
            leads = leads[keep]
        runs = _runs(fixed, rates)
        a = np.empty((len(runs) + len(chips), len(rows), len(leads)))
        r = np.empty(a.shape)
        with np.errstate(invalid="ignore"):  # 0 stages x inf: no group
            for group, run in enumerate(runs):
                if isinstance(run, OptionGroup):
                    a[group] = _columns(run.caps_at(rows), keep, width)
                    r[group] = _columns(run.held, keep, width)
                    continue
                block, count = _columns(fixed[run][1][rows], keep, width), fixed[run][2]
                rate = np.inf if rates is None else rates[run]
                if np.ndim(count) == 0 and np.ndim(rate) == 0:  # the same product, as floats
                    a[group] = block
                    r[group] = float(count) * float(rate) if count > 0 else 0.0
                    continue
                stages = _columns(np.asarray(count, dtype=np.float64), keep, width)
                a[group] = block
                r[group] = np.where(stages > 0, stages * _columns(np.asarray(rate), keep, width),
                                    0.0)
        if chips:
            held = at_leads(self, every, ("coupled", unused),  # type: ignore[arg-type]
                            lambda: self._coupled_caps(rows)[chips][:, :, self.lead_index(every)])
            a[len(runs) :] = _columns(held, keep, width)
            r[len(runs) :] = np.array([self.type_sync_inverse[self.types[t]] for t in chips])[
                :, None, None
            ]
        coarse = _least(a, r, float(self.layers))
        if keep is None:
            return coarse[fine]
        out = np.full((len(self.grid), width), -np.inf)
        out[:, keep] = coarse[fine]
        return out

    def _coupled_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The probes of :meth:`coupled_sync` (every so many of the grid and its last) and per
        probe of the grid the next one of them up (kept per number of probes)."""
        points = len(self.grid)
        cached = self.__dict__.get("_coupled_rows_at")
        if cached is None or cached[0] != points:
            step = max(points // COUPLED_PROBES, 1)
            rows = np.arange(step - 1, points, step)
            if rows[-1] != points - 1:
                rows = np.append(rows, points - 1)
            cached = (points, rows, np.searchsorted(rows, np.arange(points)))
            self.__dict__["_coupled_rows_at"] = cached
        return cached[1], cached[2]

    def _coupled_caps(self, rows: np.ndarray) -> np.ndarray:
        """Every chip type's capacity (:meth:`type_caps`) at the probes ``rows`` of
        :meth:`coupled_sync`: type x probe x grid lead (cached per grid)."""
        if self._coupled_type_caps is None:
            self._coupled_type_caps = np.stack([self.type_caps(c)[rows] for c in self.types])
        return self._coupled_type_caps


def least_sync(
    caps: Sequence[np.ndarray], rates: Sequence[np.ndarray | float], layers: float
) -> np.ndarray:
    """The least ``Z`` with ``sum_i min(caps_i, Z rates_i) >= layers`` (``caps_i``: probe x
    option capacities of group ``i``, ``rates_i``: its summed rate per option or one number;
    ``inf``: a group without DP sync, which holds its capacity at any ``Z``): probe x option.

    The sum is concave, piecewise linear and non-decreasing in ``Z`` with breakpoints
    ``caps_i / rates_i``; between the largest breakpoint where the layers do not fit and the
    least where they do it is linear, so the crossing is exact. Where even ``Z = inf`` does not
    hold the layers, the largest breakpoint (no plan has its slowest steady term there: any
    value bounds it).
    """
    shape = np.broadcast_shapes(*(np.shape(c) for c in caps))
    a, r = np.empty((len(caps),) + shape), np.empty((len(caps),) + shape)
    for index, (cap, rate) in enumerate(zip(caps, rates)):
        a[index], r[index] = cap, rate
    return _least(a, r, layers)


def _least(a: np.ndarray, r: np.ndarray, layers: float) -> np.ndarray:
    """:func:`least_sync` of stacked capacities and rates (group x probe x option)."""
    a = np.where(r > 0, np.maximum(a, 0.0), 0.0)  # rate 0: the group holds nothing
    free = np.isinf(r)  # held at any Z > 0
    if free.any():
        start = np.where(free, a, 0.0).sum(axis=0)  # held at Z = 0+
        a = np.where(free, 0.0, a)
        r = np.where(free, 0.0, r)
    else:  # nothing held at Z = 0+ (a sum of zeros)
        start = np.zeros(a.shape[1:])
    with np.errstate(divide="ignore", invalid="ignore"):
        points = np.where(a > 0, a / np.where(a > 0, r, 1.0), 0.0)
    # the sum at every breakpoint: point x group x probe x option, summed over groups
    covered = start + np.minimum(a[None], points[:, None] * r[None]).sum(axis=1)
    short = covered < layers
    low = np.where(short, points, 0.0).max(axis=0)
    low_value = np.where(short & (points >= low), covered, 0.0).max(axis=0)
    low_value = np.maximum(low_value, np.where(low > 0, 0.0, start))
    high = np.where(short, np.inf, points).min(axis=0)
    high_value = np.where(~short & (points <= high), covered, np.inf).min(axis=0)
    fits = np.isfinite(high)
    with np.errstate(divide="ignore", invalid="ignore"):
        slope = (high - low) / np.where(fits, high_value - low_value, 1.0)
        crossing = low + np.maximum(layers - low_value, 0.0) * np.where(fits, slope, 0.0)
    crossing = np.where(start >= layers, 0.0, np.minimum(crossing, high))
    return np.where(fits | (start >= layers), crossing, points.max(axis=0))


def _runs(
    fixed: Sequence[tuple[float, np.ndarray, np.ndarray | int]],
    rates: Sequence[np.ndarray | float] | None,
) -> list[int | OptionGroup]:
    """The groups of :func:`_least`: a known block's index, or an :class:`OptionGroup` in
    place of all its blocks (when they come in a row with its rates)."""
    runs: list[int | OptionGroup] = []
    index = 0
    while index < len(fixed):
        group = getattr(fixed[index], "group", None)
        end = index + len(group.parts) if group is not None else index + 1
        if (group is not None and group.whole(fixed, index) and rates is not None
                and tuple(rates[index:end]) == group.rates):
            runs.append(group)
            index = end
        else:
            runs.append(index)
            index += 1
    return runs


def _columns(value: np.ndarray, keep: np.ndarray | None, width: int) -> np.ndarray:
    """``value`` (one row or probe x option) restricted to the ``keep`` columns of ``width``
    (one column for every option kept as it is)."""
    if keep is None or not value.ndim or value.shape[-1] != width:
        return value
    return value[..., keep]
