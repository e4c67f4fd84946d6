"""What the chip types not yet placed in front of a pipeline suffix can add, for the bounds of
:class:`~megatron_h2.planner.bounds.BatchShape`: per unused type a convex lower bound on the
cost of the layers it takes (:meth:`RestBound.segment_table`), and for a set of unused types the
most layers they hold together in any order (:meth:`RestBound.rest`, a max-plus programme over
subsets of types, kinds and stage counts on a grid of leads), which caps those segments
(:meth:`RestBound._unused_segments`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_h2.planner.lead_cache import at_leads

EXACT_REST_TYPES = 4
"""Most unused chip types whose joint capacity :meth:`RestBound.rest` computes exactly."""


class RestBound:
    """The unused-types bound of :class:`~megatron_h2.planner.bounds.BatchShape` (its kinds,
    grid and prefix tables; kept apart so that each module stays short)."""

    kinds: tuple[Any, ...]
    types: list[int]
    kinds_of: dict[int, list[int]]
    uniform: bool
    dp: int | None
    depth: int
    positions: int
    grid: np.ndarray
    fill_unit: np.ndarray
    prefix: np.ndarray
    coarse_prefix: np.ndarray
    coarse_of: np.ndarray
    leads: np.ndarray
    _segment_units: dict[int, np.ndarray]
    _segment_tables: dict[int, np.ndarray]
    _rest: dict[int, np.ndarray]
    _from_leads: dict[int, tuple[np.ndarray, np.ndarray]]
    _unused: dict[int, tuple[np.ndarray, np.ndarray]]
    _stage_caps: dict[int, np.ndarray]
    type_link: dict[int, float]
    layers: int
    head_time: np.ndarray
    embedding_time: np.ndarray

    def _lead_grid(self) -> np.ndarray:
        """Leads at which the programme over unused chip types (:meth:`rest`) is tabled: under
        uniform DP the multiples of ``d`` (exact), else every integer up to 8 and then about 25%
        apart, up to the lead from which every kind reads the last warm-up of its table (a lead
        between two grid points reads the lower one, which only adds capacity)."""
        if self.uniform:
            return self.dp * np.arange(self.depth + 1, dtype=np.int64)
        largest = self.depth * max(k.dp for k in self.kinds)
        values, value = set(range(min(largest, 8) + 1)), 8.0
        while value < largest:
            value *= 1.25
            values.add(min(int(value), largest))
        return np.array(sorted(values), dtype=np.int64)

    def lead_index(self, lead: int | np.ndarray) -> np.ndarray:
        """Index of the largest grid lead not above ``lead``."""
        return np.searchsorted(self.leads, lead, side="right") - 1

    def _block_from_leads(
        self, prefix: np.ndarray, kind: int, counts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Capacity of ``counts`` stages of ``kind`` in front of each grid lead (probe x lead x
        count) and the lead they leave (lead x count)."""
        starts = -(-self.leads // self.kinds[kind].dp)  # exact warm-ups at the grid leads
        table = np.minimum(starts, self.depth - 1)
        ends = table[:, None] + counts[None, :]
        caps = prefix[kind][:, ends] - prefix[kind][:, table][:, :, None]
        return caps, self.kinds[kind].dp * (starts[:, None] + counts[None, :])

    def segment_units(self, chip: int) -> np.ndarray:
        """The distinct per-layer fills of the kinds of chip type ``chip``, cheapest first (kinds
        that differ only in their DP degree have the same)."""
        if chip not in self._segment_units:
            self._segment_units[chip] = np.unique(self.fill_unit[self.kinds_of[chip]])
        return self._segment_units[chip]

    def segment_table(self, chip: int) -> np.ndarray:
        """A convex lower bound on the cost of taking layers from unused chip type ``chip`` in
        front of each grid lead: widths per segment (cheapest first) x probe x grid lead (a lead
        between grid leads reads the lower one, which only adds capacity; exact under uniform
        DP).

        Its kinds sorted by per-layer fill ``u_1 <= u_2 <= ...``: the first ``C_1`` layers cost
        ``u_1`` each, the next ``C_2 - C_1`` cost ``u_2`` (``C_j``: most layers any of the first
        ``j`` kinds can hold in a block in front of the lead), and so on. Taking ``x`` layers
        from a block of one kind costs at least that much, whichever kind it is.
        """
        if chip not in self._segment_tables:
            running = np.zeros((len(self.grid), len(self.leads)))
            widths = []
            for unit in self.segment_units(chip):  # kinds of equal fill make one segment
                group = running
                for kind in self.kinds_of[chip]:
                    if self.fill_unit[kind] == unit:
                        most = np.array([min(self.kinds[kind].max_stages, self.positions)])
                        caps, _ = self._block_from_leads(self.prefix, kind, most)
                        group = np.maximum(group, caps[:, :, 0])
                widths.append(group - running)
                running = group
            self._segment_tables[chip] = np.stack(widths)  # segment x probe x grid lead
        return self._segment_tables[chip]

    def rest(self, mask: int) -> np.ndarray:
        """Most units the chip types in ``mask`` can add, in any order, in front of each grid
        lead: fine probe x lead (a max-plus programme over subsets of types, kinds and stage
        counts; the lead each block leaves is rounded down to the grid).

        Masks of more than :data:`EXACT_REST_TYPES` types are split in two halves and the
        halves' values added: an upper bound, since the value falls with the lead and a type
        placed behind others starts from a larger lead than in its half alone (each block
        leaves a lead at least as large as the one it starts from, and the next lead is
        monotone in it). So the programme visits ``O(T ** EXACT_REST_TYPES)`` masks of ``T``
        types, not ``2 ** T``."""
        return self._rest_coarse(mask)[self.coarse_of]

    def _rest_coarse(self, mask: int) -> np.ndarray:
        if mask in self._rest:
            return self._rest[mask]
        bits = [t for t in range(len(self.types)) if mask >> t & 1]
        if len(bits) > EXACT_REST_TYPES:
            low = sum(1 << t for t in bits[: len(bits) // 2])
            result = self._rest_coarse(low) + self._rest_coarse(mask & ~low)
            self._rest[mask] = result
            return result
        result = np.zeros((self.coarse_prefix.shape[1], len(self.leads)))
        for t_index, chip in enumerate(self.types):
            if not mask >> t_index & 1:
                continue
            after = self._rest_coarse(mask & ~(1 << t_index))
            if self.uniform:  # kinds of as many stages at most at once
                most: dict[int, list[int]] = {}
                for kind in self.kinds_of[chip]:
                    stages = min(self.kinds[kind].max_stages, self.positions)
                    most.setdefault(stages, []).append(kind)
                for kinds in most.values():
                    np.maximum(result, self._rest_uniform(kinds, after).max(axis=0), out=result)
                continue
            for kind in self.kinds_of[chip]:
                if kind not in self._from_leads:  # the same for every mask
                    most = min(self.kinds[kind].max_stages, self.positions)
                    counts = np.arange(1, most + 1)
                    caps, leads = self._block_from_leads(self.coarse_prefix, kind, counts)
                    self._from_leads[kind] = (caps, self.lead_index(leads))
                caps, index = self._from_leads[kind]
                value = caps + after[:, index]
                np.maximum(result, value.max(axis=2), out=result)
        self._rest[mask] = result
        return result

    def _rest_uniform(self, kinds: list[int], after: np.ndarray) -> np.ndarray:
        """Under one DP degree (grid lead ``i`` = ``i`` stages behind): the most units a block
        of each of ``kinds`` (of as many stages at most) plus ``after`` (what the types in
        front of it add) hold in front of each grid lead, as the general case computes it:
        ``max over c of P[i + c] - P[i] + after[i + c]`` (``P`` the kind's prefix sums; whole
        numbers, so the sums are exact in any order), with a sliding maximum over ``c = 1 ..
        most`` instead of every ``c`` of every lead: kind x coarse probe x grid lead."""
        most = min(self.kinds[kinds[0]].max_stages, self.positions)
        depth = self.depth
        prefix = self.coarse_prefix[kinds]  # kind x coarse probe x (warm-up + 1)
        ends = np.arange(depth + most)
        windows = _window_max(prefix[:, :, ends] + after[None, :, np.minimum(ends, depth)], most)
        out = np.empty(prefix.shape[:2] + (depth + 1,))
        out[:, :, :depth] = windows[:, :, 1 : depth + 1] - prefix[:, :, :depth]
        # the last grid lead reads the table's last warm-up, and what it leaves is the last lead
        last = prefix[:, :, depth : depth + most] - prefix[:, :, [depth - 1]]
        out[:, :, depth] = last.max(axis=2) + after[None, :, depth]
        return out

    def stage_caps(self, mask: int) -> np.ndarray:
        """Most units one stage of a chip type in ``mask`` holds in front of each grid lead:
        probe x grid lead (the largest first-stage capacity of any of their kinds there; a lead
        between grid leads reads the lower one, which only adds capacity)."""
        if mask not in self._stage_caps:
            out = np.zeros((len(self.grid), len(self.leads)))
            for t_index, chip in enumerate(self.types):
                if mask >> t_index & 1:
                    np.maximum(out, self._type_stage_caps(chip), out=out)
            self._stage_caps[mask] = out
        return self._stage_caps[mask]

    def _type_stage_caps(self, chip: int) -> np.ndarray:
        """:meth:`stage_caps` of one chip type (cached per grid under the key ``-1 - chip``)."""
        key = -1 - chip
        if key not in self._stage_caps:
            out = np.zeros((len(self.grid), len(self.leads)))
            for kind in self.kinds_of[chip]:
                starts = np.minimum(-(-self.leads // self.kinds[kind].dp), self.depth - 1)
                prefix = self.prefix[kind]
                np.maximum(out, prefix[:, starts + 1] - prefix[:, starts], out=out)
            self._stage_caps[key] = out
        return self._stage_caps[key]

    def new_stage_links(
        self, mask: int, leads: np.ndarray, units: np.ndarray | float
    ) -> np.ndarray:
        """Least link time that ``units`` (probe x option, what the placed blocks cannot take)
        add in front of pipeline suffixes with ``leads`` (one per option) when only chip types
        in ``mask`` may take them: each new stage holds at most :meth:`stage_caps` units and
        sends to the stage after it over a link of at least its type's cheapest
        (:attr:`type_link`). Probe x option."""
        leads = np.asarray(leads)
        most, some, link = at_leads(self, leads, ("stage", mask),  # type: ignore[arg-type]
                                    lambda: self._stage_terms(mask, leads))
        with np.errstate(divide="ignore", invalid="ignore"):  # whole numbers: exact quotients
            stages = np.ceil(np.maximum(units, 0.0) / most - 1e-9)
        return np.where(some, stages, 0.0) * link

    def _stage_terms(self, mask: int, leads: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """:meth:`new_stage_links`' tables at ``leads``: the stage caps (at least 1), where they
        are positive, and the least link of a type in ``mask``."""
        caps = self.stage_caps(mask)[:, self.lead_index(leads)]
        link = min(self.type_link[chip] for t, chip in enumerate(self.types) if mask >> t & 1)
        return np.maximum(caps, 1.0), caps > 0, link

    def _segment_fill(self, most: np.ndarray) -> np.ndarray:
        """Per probe, the least summed fill (edges included) of the layers where each kind
        holds at most ``most`` (kind x probe, :meth:`_most_layers`): each chip type's kinds as
        convex segments (by fill per layer, each adding what it holds beyond the cheaper ones;
        a type runs one kind, whose layers cost no less than these segments' up to its
        ``most``), the layers filled into the cheapest first; inf where they do not fit."""
        units, widths = [], []
        for chip in self.types:
            running = np.zeros(most.shape[1])
            for kind in sorted(self.kinds_of[chip], key=lambda k: self.fill_unit[k]):
                units.append(float(self.fill_unit[kind]))
                widths.append(np.maximum(most[kind] - running, 0.0))
                running = np.maximum(running, most[kind])
        order = np.argsort(units, kind="stable")
        stacked = np.array(widths)[order]  # segment x probe, cheapest first
        before = running_sum(stacked) - stacked
        take = np.minimum(np.maximum(self.layers - before, 0.0), stacked)
        fill = np.asarray(units)[order] @ take
        fill = np.where(take.sum(axis=0) >= self.layers - 1e-9, fill, np.inf)
        return fill + float(self.head_time.min() + self.embedding_time.min())

    def _unused_segments(self, mask: int) -> tuple[np.ndarray, np.ndarray]:
        """The cost segments of the unused chip types in ``mask`` (:meth:`segment_table`),
        cheapest first, with widths capped so that together they add at most :meth:`rest`:
        (per-layer fills, widths segment x probe x grid lead; cached per grid)."""
        if mask not in self._unused:
            chips = [chip for t, chip in enumerate(self.types) if mask >> t & 1]
            units = np.concatenate([self.segment_units(chip) for chip in chips])
            order = np.argsort(units, kind="stable")
            table = np.concatenate([self.segment_table(chip) for chip in chips])[order]
            cumulative = np.minimum(running_sum(table), self.rest(mask)[None])
            self._unused[mask] = (units[order], np.diff(cumulative, axis=0, prepend=0.0))
        return self._unused[mask]


def running_sum(stack: np.ndarray) -> np.ndarray:
    """``stack.cumsum(axis=0)`` (the same sums in the same order), one row at a time: numpy's
    cumsum along the first axis of a short, wide stack is several times slower."""
    out = stack.copy()
    for row in range(1, len(stack)):
        np.add(out[row - 1], stack[row], out=out[row])
    return out


def greedy_take(stack: np.ndarray, layers: Any) -> np.ndarray:
    """What filling ``layers`` into the rows of ``stack`` (widths, whole numbers) in order takes
    of each: ``min(max(layers - before, 0), width)`` with ``before`` the widths of the rows
    ahead (summed one row at a time, exact), in one buffer."""
    out = np.empty_like(stack)
    out[0] = 0.0
    for row in range(1, len(stack)):
        np.add(out[row - 1], stack[row - 1], out=out[row])
    np.subtract(layers, out, out=out)
    np.maximum(out, 0.0, out=out)
    return np.minimum(out, stack, out=out)


def _window_max(values: np.ndarray, width: int) -> np.ndarray:
    """``out[..., a] = values[..., a : a + width].max(axis=-1)`` for every full window (by
    doubling spans: a few passes instead of ``width``)."""
    span = 1
    while 2 * span <= width:
        values = np.maximum(values[..., :-span], values[..., span:])  # spans of 2 * span
        span *= 2
    if span == width:
        return values
    return np.maximum(values[..., : values.shape[-1] - (width - span)], values[..., width - span :])
