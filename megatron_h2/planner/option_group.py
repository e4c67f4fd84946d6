"""The option blocks of one bound call of :class:`~megatron_h2.planner.bounds.BatchShape`
taken together where that gives the same floats with less work.

The children of a pipeline suffix of one chip type are bounded in one call: each of its kinds
is a known block with its capacity and stages in its own option columns only (zero elsewhere).
In a column only one of them has stages, so the others add exact zeros to the summed stages and
fill of the known blocks, take no layers and (without stages, so without sync rate) hold
nothing in :func:`~megatron_h2.planner.sync_coupling.least_sync`. An :class:`OptionGroup`
keeps, built once with the columns (:mod:`.option_columns`), their free widths, the columns
where a block is short, their summed stages and fill, their capacity and summed sync rate: each
column gets the same values as when every block is taken alone, in the same order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Part = tuple[float, np.ndarray, Any]
"""A known block: (fill per layer, capacity probe x option, stages: one number or per option)."""


class OptionGroup:
    """Option blocks (``parts``, one kind each on columns of their own) and their ``rates``
    (each kind's sync rate); :attr:`parts` are the blocks to pass, which carry the group."""

    def __init__(self, parts: list[tuple[float, np.ndarray, np.ndarray]],
                 rates: list[float]) -> None:
        self.rates = tuple(rates)
        self.units = [unit for unit, _, _ in parts]
        free = [caps - count for _, caps, count in parts]  # whole numbers
        self.widths = [np.maximum(f, 0.0) for f in free]
        self.free = sum(self.widths)  # whole numbers: exact in any order
        self.short = np.logical_or.reduce([f < -1e-9 for f in free])
        self.layers = sum(count for _, _, count in parts)  # one block per column: exact
        self.cost = sum(unit * count for unit, _, count in parts)
        self.caps = sum(caps for _, caps, _ in parts)
        with np.errstate(invalid="ignore"):  # 0 stages x inf: no group
            self.held = sum(np.where(count > 0, count * rate, 0.0)
                            for (_, _, count), rate in zip(parts, rates))
        self.parts = [OptionPart(part, self) for part in parts]
        self._rows: tuple[np.ndarray, np.ndarray] | None = None

    def whole(self, fixed: Any, index: int) -> bool:
        """Whether ``fixed[index:]`` starts with all of this group's blocks, in order."""
        return all(a is b for a, b in zip(self.parts, fixed[index : index + len(self.parts)])) \
            and len(fixed) - index >= len(self.parts)

    def caps_at(self, rows: np.ndarray) -> np.ndarray:
        """The capacities at the probes ``rows`` (kept for the last rows array asked)."""
        if self._rows is None or self._rows[0] is not rows:
            self._rows = (rows, self.caps[rows])
        return self._rows[1]


class OptionPart(tuple):  # type: ignore[type-arg]
    """A known block (:data:`Part`) that belongs to an :class:`OptionGroup`."""

    group: OptionGroup

    def __new__(cls, part: Part, group: OptionGroup) -> Any:
        self = super().__new__(cls, part)
        self.group = group
        return self


def known_blocks(
    fixed: list[Part],
) -> tuple[list[np.ndarray], list[float], Any, Any, Any, Any]:
    """What the option bound sums over its known blocks: their free widths (capacity less
    stages, at least 0) and fills per layer, in order, their summed stages and fill, where
    some block is short of a layer per stage (its capacity below its stages) and their summed
    free widths (whole numbers: exact in any order)."""
    widths: list[np.ndarray] = []
    units: list[float] = []
    layers: Any = 0.0
    cost: Any = 0.0
    short: Any = False
    free_sum: Any = 0.0
    index = 0
    while index < len(fixed):
        group = getattr(fixed[index], "group", None)
        if group is not None and group.whole(fixed, index):
            layers, cost = layers + group.layers, cost + group.cost
            short, free_sum = short | group.short, free_sum + group.free
            widths += group.widths
            units += group.units
            index += len(group.parts)
            continue
        unit, caps, count = fixed[index]
        layers, cost = layers + count, cost + unit * count
        free = caps - count  # whole numbers: caps < count exactly when free < 0
        short = short | (free < -1e-9)
        widths.append(np.maximum(free, 0.0))
        units.append(unit)
        free_sum = free_sum + widths[-1]
        index += 1
    return widths, units, layers, cost, short, free_sum
