"""Lower bounds on the plans of a batch shape whose last block is given: floors for the suffixes
of the search (:meth:`~megatron_h2.planner.search._Search._options`).

The search builds each pipeline from its end, so a suffix's last block (kind ``k``, ``n``
stages: the one that holds the head) is fixed from depth 1 on. The root's knapsack over the chip
types' choices (:mod:`.uniform_root`, :mod:`.own_root`, with the end-of-step levels and the block
that ends the pipeline, :mod:`.head_block`) bounds every plan of the shape; with the last block
fixed to ``(k, n)`` the other types' blocks are the knapsack over every type but ``k``'s (the
knapsacks of the types before it and after it in a fixed order, convolved), and the last block
holds ``x`` units, ``n <= x <=`` its head stage's units plus its other stages' capacities,
at its own fill, ``n - 1`` links to itself and its head's fill; its head stage's end-of-step term
is at least the kind's :attr:`~megatron_h2.planner.bounds.BatchShape.head_tail`. Per cell of the
root (probe interval and level of the end-of-step term) that gives a bound on the plans there
with that last block; the least over the cells, the loose root terms of the intervals at or
above the cutoff and the terms above the top probe bounds every plan below a suffix ending in
``(k, n)``.

Every suffix below a root child keeps that child's floor, where its own bound (the placed blocks
with capacities, the unused types relaxed) had fallen back to the shape's root: on the
1,024-chip 8-type family member (seed 1) the micro-batch-1 zero-bubble DP 4 shape's depth-1 and
depth-2 suffixes all sat at its root bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from megatron_h2.planner.coupled_root import root_cells
from megatron_h2.planner.head_block import head_units
from megatron_h2.planner.own_root import _terms, own_tables
from megatron_h2.planner.placed_rows import PlacedRows
from megatron_h2.planner.uniform_root import sync_levels, uniform_tables
from megatron_h2.planner.zero_bubble_fill import fill_shares

if TYPE_CHECKING:
    from megatron_h2.planner.bounds import BatchShape


DEFER = 32
"""Expansions of a shape (calls of :func:`option_floors`) before its floors are computed: the
shapes that close in fewer do not pay for them."""

TRIAL, PRUNING = 64, 8
"""A shape's suffix floors (:func:`node_floor`) stop after ``TRIAL`` of them once fewer than one
in ``PRUNING`` has lifted its option to the cutoff (they only cost there)."""


class FloorRows(NamedTuple):
    """What :func:`last_floors` keeps for :func:`node_floor`, per row (a level x live interval
    of the root's cells): the rows below the cutoff per last block and the least of its other
    cells (``below``), the kinds' capacities (``capped``, kind x row x warm-up; ``widest`` their
    most), the head stage's units (``heads``), the rows' terms (``row_low``, ``row_tail``,
    ``row_loose``), the chip types' knapsack ``tables``, the unused types' knapsacks ``memo``
    and the placed stages' caps (``placed``)."""

    below: dict[Any, tuple[np.ndarray, float]]
    capped: np.ndarray
    heads: np.ndarray
    row_low: np.ndarray
    row_tail: np.ndarray
    row_loose: np.ndarray
    tables: list[np.ndarray]
    memo: dict[Any, np.ndarray]
    widest: np.ndarray
    placed: PlacedRows


def prepare_last_floors(shape: BatchShape, cutoff: float) -> None:
    """Compute ``shape``'s floors per last block (kind, stages), once, where its root's cells
    below ``cutoff`` are few enough to be worth it (a finite cutoff, a dense model)."""
    if "_last_floors" in shape.__dict__ or not np.isfinite(cutoff):
        return
    shape._last_floors = {}  # type: ignore[attr-defined]
    if shape.cost.model.is_moe or not shape.positions or not shape.prepared:
        return
    cells = root_cells(shape)
    if cells is None:
        return
    shape._last_floors = last_floors(shape, cells, cutoff)  # type: ignore[attr-defined]


def last_floors(shape: BatchShape, cells: tuple[Any, ...], cutoff: float) -> dict[Any, float]:
    """Per last block (kind, stages) of ``shape``, a lower bound on every plan ending in it
    (:func:`~megatron_h2.planner.coupled_root.root_cells`' ``cells``; the intervals whose loose
    terms are at or above ``cutoff`` bound by those). Keeps what :func:`node_floor` needs: the
    rows (cells) below ``cutoff`` per last block and the least of its other cells."""
    probes, caps, most, tail, _, terms, beyond = cells
    live = np.flatnonzero(terms < cutoff)
    rest = min(float(np.delete(terms, live).min(initial=np.inf)), float(beyond))
    if not len(live):
        return {}
    found = sync_levels(shape)
    if found is None:
        levels, held = np.zeros(1), np.full((len(shape.kinds), 1), np.inf)
    else:
        levels, held = found
    tops = np.append(levels[1:], np.inf)
    # rows: level x live interval, each read at g_j+1 with its level's caps
    capped = np.minimum(caps[:, None, live + 1, :], held[:, :, None, None])
    capped = capped.reshape(len(caps), -1, caps.shape[2])
    row_top = np.repeat(tops, len(live))
    row_low = np.tile(probes[live], len(levels))
    row_tail = np.maximum(np.tile(tail[live], len(levels)), np.repeat(levels, len(live)))
    row_loose = np.tile(terms[live], len(levels))
    row_probe = np.tile(probes[live + 1], len(levels))  # each row's capacities read there
    heads = head_units(shape, row_probe, capped[:, :, 0], row_top)
    block_most = shape._most_layers(capped)  # own DP: every kind's block, all its stages
    if shape.uniform:
        tables = uniform_tables(shape, capped, None)[0]
    else:
        tables = own_tables(shape, block_most, None, None)[0]
    others = _excluding(tables, shape.layers)
    floors: dict[Any, float] = {}
    below: dict[Any, tuple[np.ndarray, float]] = {}
    for index, chip in enumerate(shape.types):
        for kind in shape.kinds_of[chip]:
            for count, joint in _last_costs(shape, kind, capped, heads, block_most, others[index]):
                tails = np.maximum(row_tail, float(shape.head_tail[kind]))
                cell = np.maximum(_terms(shape, row_low, joint, tails), row_loose)
                floors[kind, count] = min(float(cell.min()), rest)
                rows = np.flatnonzero(cell < cutoff)
                below[kind, count] = (rows, min(float(np.delete(cell, rows).min(initial=np.inf)),
                                                rest))
    placed = PlacedRows(row_probe, np.repeat(held, len(live), axis=1))
    shape._floor_rows = FloorRows(below, capped, heads, row_low, row_tail,  # type: ignore
                                  row_loose, tables, {}, capped.max(axis=2), placed)
    return floors


def node_floor(shape: BatchShape, suffix: tuple[tuple[int, int], ...], mask: int,
               links: float, cutoff: float = np.inf) -> float:
    """A lower bound on every plan below the suffix ``suffix`` (blocks from the front; ``mask``
    its unused chip types, ``links`` its exact link time), from the cells of its last block
    below the cutoff (:func:`last_floors`): its blocks each hold ``n .. `` their stages'
    capacities (the last with its head stage; at their places in a pipeline as long as the
    suffix, :mod:`.placed_rows`) at their fill, and the unused types the root's knapsack over
    them; the cells still below ``cutoff`` then with the pipeline's least length below the
    suffix (:func:`_longer_units`). 0 where no floors are kept."""
    data: FloorRows | None = shape.__dict__.get("_floor_rows")
    if data is None or suffix[-1] not in data.below:
        return 0.0
    rows, outside = data.below[suffix[-1]]
    if not len(rows):
        return outside
    layers, key = shape.layers, (suffix[-1], mask)
    memo = data.memo
    if key not in memo:  # the unused types' knapsack on these rows
        free = np.full((len(rows), layers + 1), np.inf)
        free[:, 0] = 0.0
        for index in range(len(shape.types)):
            if mask >> index & 1:
                choice = data.tables[index][rows].copy()
                choice[:, 0] = 0.0
                free = _convolve(free, choice, layers)
        memo[key] = free
    position = sum(count for _, count in suffix)
    lengths = np.full(len(rows), max(shape.shortest(position), position))
    units = _block_units(shape, suffix, data, rows, lengths)
    cell = _cells(shape, suffix, mask, links, rows, memo[key], units)
    live = np.flatnonzero(cell < cutoff)
    if len(live) and shape.schedule == "zero-bubble" and mask:
        longer = _longer_units(shape, suffix, mask, rows[live], lengths[live],
                               [block[live] for block in units])
        if longer is not None:
            cell[live] = np.maximum(cell[live], _cells(shape, suffix, mask, links, rows[live],
                                                       memo[key][live], longer))
    return min(float(cell.min()), outside)


def _cells(shape: BatchShape, suffix: tuple[tuple[int, int], ...], mask: int, links: float,
           rows: np.ndarray, free: np.ndarray, units: list[np.ndarray]) -> np.ndarray:
    """Per row of ``rows`` the bound of :func:`node_floor` with the suffix's blocks holding at
    most ``units`` (per block and row) and the unused types the knapsack ``free`` (row x
    units)."""
    data: FloorRows = shape._floor_rows  # type: ignore[attr-defined]
    layers = shape.layers
    rises, unused_rise = _share_rises(shape, suffix, mask, units, data.widest[:, rows])
    x = np.arange(layers + 1)
    fixed = _blocks_fill(shape, suffix, units, rises, layers)
    fixed += unused_rise[:, None] * (layers - x)  # the unused types' units fill no cheaper
    last = suffix[-1][0]
    joint = ((fixed + free[:, ::-1]).min(axis=1) + links
             + float(shape.head_time[last] + shape.embedding_time.min()))
    tails = np.maximum(data.row_tail[rows], float(shape.head_tail[last]))
    return np.maximum(_terms(shape, data.row_low[rows], joint, tails), data.row_loose[rows])


ROUNDS = 4
"""Rounds of :func:`_longer_units`: each may lengthen the pipelines below a suffix."""


def _longer_units(shape: BatchShape, suffix: tuple[tuple[int, int], ...], mask: int,
                  rows: np.ndarray, lengths: np.ndarray,
                  units: list[np.ndarray]) -> list[np.ndarray] | None:
    """:func:`_block_units` in pipelines of at least the fewest stages those below ``suffix``
    have, per row (``units`` at ``lengths``, the suffix's): under zero-bubble the placed stages
    hold less the longer the pipeline (:mod:`.placed_rows`), so the units they cannot hold
    need new stages of the unused types (``mask``), each at most the most one of their stages
    holds at the row; that lengthens the pipeline, and so on for :data:`ROUNDS` rounds (each
    length a lower bound on every pipeline's below, given the last). A row where even the
    longest pipeline cannot hold the layers has its last block at -1 (no plan). None where no
    row gets longer, or the units and so the cells stay the same."""
    data: FloorRows = shape._floor_rows  # type: ignore[attr-defined]
    unused = [k for i, t in enumerate(shape.types) if mask >> i & 1 for k in shape.kinds_of[t]]
    most = data.widest[unused][:, rows].max(axis=0)  # units per new stage at most
    position, first, changed = sum(count for _, count in suffix), units, False
    for _ in range(ROUNDS):
        short = shape.layers - sum(np.maximum(block, 0.0) for block in units)
        with np.errstate(divide="ignore", invalid="ignore"):
            new = np.where(short > 0, np.ceil(short / most - 1e-9), 0.0)  # inf: none holds them
        longer = np.minimum(np.maximum(lengths, position + new), shape.positions + 1)
        if (longer == lengths).all():
            break
        lengths, changed = longer.astype(np.int64), True
        units = _block_units(shape, suffix, data, rows, lengths)
    same = all(np.array_equal(a, b) for a, b in zip(first, units))
    if not changed or same and (lengths <= shape.positions).all():
        return None  # the same cells
    units[-1] = np.where(lengths > shape.positions, -1.0, units[-1])
    return units


def _blocks_fill(shape: BatchShape, suffix: tuple[tuple[int, int], ...], units: list[np.ndarray],
                 rises: np.ndarray, layers: int) -> np.ndarray:
    """Per row and total ``X = 0 .. L``, the least fill of the suffix's blocks holding ``X``
    units, each from its stage count up to its ``units`` at its fill per unit (``rises``
    added): every block its stage count, then the rest cheapest first (inf where they cannot
    hold ``X``)."""
    counts = np.array([count for _, count in suffix], dtype=np.float64)
    prices = np.array([float(shape.fill_unit[kind]) + rises[kind] for kind, _ in suffix])
    room = np.array(units) - counts[:, None]  # block x row
    base = (counts[:, None] * prices).sum(axis=0)
    order = np.argsort(prices, axis=0, kind="stable")
    prices, room = np.take_along_axis(prices, order, 0), np.take_along_axis(room, order, 0)
    extra = np.arange(layers + 1, dtype=np.float64)[None, :] - counts.sum()  # units past them
    out = np.zeros((len(base), layers + 1)) + base[:, None]
    below = np.zeros(len(base))
    for price, width in zip(prices, np.maximum(room, 0.0)):
        out += price[:, None] * np.clip(extra - below[:, None], 0.0, width[:, None])
        below = below + width
    fits = (extra >= 0) & (extra <= below[:, None]) & (room.min(axis=0) >= 0)[:, None]
    return np.where(fits, out, np.inf)


def _block_units(shape: BatchShape, suffix: tuple[tuple[int, int], ...], data: FloorRows,
                 rows: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """Per block of ``suffix`` and row, the most units its stages hold (their warm-ups' caps,
    at most their places' in a pipeline of at least ``lengths`` stages per row,
    :mod:`.placed_rows`; the last block's warm-up-0 stage with the head: -1 where it cannot
    hold the head)."""
    exact = np.array(shape.warmups(suffix))
    flat = np.minimum(exact, shape.depth - 1)
    ends = np.cumsum([count for _, count in suffix])
    total, out, stage = int(ends[-1]), [], None
    for (kind, _), warmups, end in zip(suffix, np.split(flat, ends[:-1]), ends):
        held = data.capped[kind][np.ix_(rows, warmups)]  # row x stage
        more = data.placed.block_units(shape, kind, exact[end - len(warmups) : end],
                                       total - end, lengths, rows)
        if more is not None:
            held = np.minimum(held, more)
        out.append(held.sum(axis=1))
        stage = held[:, -1]  # the last block's last stage: warm-up 0
    kind = suffix[-1][0]
    head = np.minimum(data.heads[kind, rows], stage)
    out[-1] = np.where(head >= 1, out[-1] - stage + head, -1.0)
    return out


def _share_rises(shape: BatchShape, suffix: tuple[tuple[int, int], ...], mask: int,
                 units: list[np.ndarray], widest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Under zero-bubble, per kind and row what each unit's fill rises by on every pipeline
    below ``suffix`` (as :func:`~megatron_h2.planner.joint_root.share_rises`, at its stages plus
    the fewest new ones that hold what its blocks cannot: ``units`` per block and row, ``widest``
    the most one stage of each kind holds per row), and per row the least of that over the
    unused types' kinds (0 where none is unused); zeros under the other schedules."""
    zeros = np.zeros((len(shape.kinds), len(widest[0])))
    if shape.schedule != "zero-bubble":
        return zeros, zeros[0]
    placed = sum(count for _, count in suffix)
    held = sum(np.maximum(block, 0.0) for block in units)
    unused = [k for i, t in enumerate(shape.types) if mask >> i & 1 for k in shape.kinds_of[t]]
    new = np.zeros(len(widest[0]))
    if unused:
        most = widest[unused].max(axis=0)
        new = np.where(held >= shape.layers, 0.0,
                       np.ceil((shape.layers - held) / np.maximum(most, 1.0) - 1e-9))
    stages = np.clip(placed + new, 2, max(shape.positions, 2))[None, :]
    m = np.array([k.micro_batches for k in shape.kinds], dtype=np.float64)[:, None]
    shares = fill_shares(shape.schedule, [k.micro_batches for k in shape.kinds])[:, None]
    weight = np.array([k.costs.layer_weight_grad for k in shape.kinds])[:, None]
    b = np.minimum(m - 1.0, stages - 1.0) / (stages - 1.0)  # zero_bubble_share, p >= 2
    rises = np.maximum((shares - 1.0 - b) * weight, 0.0)  # kind x row
    return rises, rises[unused].min(axis=0) if unused else zeros[0]


def _last_costs(shape: BatchShape, kind: int, capped: np.ndarray, heads: np.ndarray,
                block_most: np.ndarray, others: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Per stage count ``n`` of ``kind`` as the last block, per row: the least fill and links of
    the plans whose last block it is (``others``: row x units, the other types' least for that
    many units; ``block_most``: kind x row, an own-DP block's most units), its embedding's least
    fill included."""
    layers, k = shape.layers, shape.kinds[kind]
    x = np.arange(layers + 1)
    spent = x * float(shape.fill_unit[kind]) + others[:, ::-1]  # row x its units
    base = float(shape.head_time[kind] + shape.embedding_time.min())
    if shape.uniform:
        most = min(k.max_stages, shape.positions)
        running = heads[kind][:, None] + np.concatenate(
            (np.zeros((len(heads[kind]), 1)), capped[kind, :, 1:most].cumsum(axis=1)), axis=1)
        counts = range(1, most + 1)
    else:
        running = (block_most[kind] - capped[kind, :, 0] + heads[kind])[:, None]
        counts = range(k.max_stages, k.max_stages + 1)
    out = []
    for column, count in enumerate(counts):
        top = np.where(heads[kind] >= 1, running[:, column], -1.0)[:, None]
        ok = (x >= count) & (x <= top)
        best = np.where(ok, spent, np.inf).min(axis=1)
        out.append((count, best + (count - 1) * shape.inner_link[k.chip] + base))
    return out


def _excluding(tables: list[np.ndarray], layers: int) -> list[np.ndarray]:
    """Per chip type, the min-plus knapsack of every other type's table (row x units
    ``1 .. L``; 0 units: the type unused): the types before it convolved with those after it."""
    start = np.full(tables[0].shape, np.inf)
    start[:, 0] = 0.0
    choices = []
    for table in tables:
        choice = table.copy()
        choice[:, 0] = 0.0  # unused
        choices.append(choice)
    before = [start]
    for choice in choices[:-1]:
        before.append(_convolve(before[-1], choice, layers))
    out, after = [start] * len(tables), start
    for index in range(len(tables) - 1, -1, -1):
        out[index] = _convolve(before[index], after, layers)
        after = _convolve(after, choices[index], layers)
    return out


def _convolve(cost: np.ndarray, table: np.ndarray, layers: int) -> np.ndarray:
    """Min-plus convolution of two row x units ``0 .. L`` tables (units added)."""
    out = cost + table[:, :1]
    for units in np.flatnonzero(np.isfinite(table[:, 1:]).any(axis=0)) + 1:
        more = cost[:, : layers + 1 - units] + table[:, units : units + 1]
        np.minimum(out[:, units:], more, out=out[:, units:])
    return out


def option_floors(
    shape: BatchShape, node: Any, options: list[tuple[float, int, int]], cutoff: float,
    links: Callable[[int, int], float],
) -> list[tuple[float, int, int]]:
    """``options`` of ``node`` (bound, kind, count; kind -1 closes it), each at least the shape's
    root bound and, where its last block is known (the suffix's, or at the root the option's
    own), that block's floor and, where still below ``cutoff``, the floor of the suffix it
    makes (:func:`node_floor`; ``links(kind, count)``: the link time a block adds)."""
    root = shape.root_bound()
    expanded = shape.__dict__.get("_expanded", 0) + 1
    shape._expanded = expanded  # type: ignore[attr-defined]
    if expanded == DEFER:  # a shape that does not close within a few expansions
        prepare_last_floors(shape, cutoff)
    floors = shape.__dict__.get("_last_floors")
    if not floors:
        return [(max(bound, root), kind, count) for bound, kind, count in options]
    suffix = node.suffix
    if not suffix:
        return [(max(bound, root, floors.get((kind, count), root)), kind, count)
                for bound, kind, count in options]
    floor = max(root, floors.get(suffix[-1], root))
    tried = shape.__dict__.setdefault("_floor_tries", [0, 0])  # node floors computed, pruning
    out = []
    for bound, kind, count in options:
        bound = max(bound, floor)
        if bound < cutoff and (tried[0] < TRIAL or tried[1] * PRUNING >= tried[0]):
            if kind < 0:
                bound = max(bound, node_floor(shape, suffix, node.mask, node.links, cutoff))
            else:
                bit = 1 << shape.types.index(shape.kinds[kind].chip)
                bound = max(bound, node_floor(shape, ((kind, count),) + suffix,
                                              node.mask & ~bit, node.links + links(kind, count),
                                              cutoff))
            tried[0] += 1
            tried[1] += bound >= cutoff
        out.append((bound, kind, count))
    return out
