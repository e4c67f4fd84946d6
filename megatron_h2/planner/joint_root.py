"""The fill and links of a one-DP shape's root, bounded jointly over its chip types' blocks.

Under one DP degree (:class:`~megatron_h2.planner.bounds.BatchShape` with ``dp`` set) a chip type
is either unused or runs one block of ``n`` stages of one kind (one TP degree), ``1 <= n <=`` its
most stages, each stage holding at least one layer. Where the slowest folded steady term is at
most a probe ``g``, a stage of kind ``k`` at warm-up ``q`` holds at most ``min(g / (F u_m),
cap_m(q))`` units in recompute mode ``m`` (``u_m`` its per-unit time, ``cap_m`` its memory cap);
counted from warm-up 0 (the block as if it ended the pipeline: caps fall with the warm-up),
``n`` stages hold at most ``W_m(n)`` units in the modes up to ``m``. A stage's mode is the
fastest that fits, and a stage in mode ``m`` holds no more than ``W_m`` allows, so its units
fill at no less than the convex segments: the first ``W_0(n)`` at mode 0's per-unit fill, the
next ``W_1(n) - W_0(n)`` at mode 1's, and so on (the fills per unit grow with the mode). A
block's links are its type's own link per stage but one plus one to another type, the last
block's less (:func:`.head_block.block_links`).

So the summed fill plus links of every plan is at least the least, over the choices of one kind
and stage count (or none) per type whose units add up to ``L``, of ``sum (segment fill +
links(n))`` minus the largest cross-type link, plus the edges' least fill: per kind the best
stage count for each unit count (``O(n L)`` per probe), then a min-plus knapsack over types and
unit counts ``0 .. L`` (``O(T L^2)`` per probe): polynomial in the types, kinds and layers.

:func:`deep_root` couples the largest end-of-step term in as well (each stage's units at most
its kind's sync inverse times it), once per shape the search keeps after its root.

The root's loose form took the fill (every kind's most capacity at the no-recompute fill, a
type's kinds all counted) and the links (the fewest stages that hold the layers, each at the
cheapest link of any type) apart: a 405B model needs many stages, mostly with recompute, on the
types fast enough to hold layers at the probe, and their links are those types'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_h2.planner.cost_model import MODES
from megatron_h2.planner.head_block import block_links
from megatron_h2.planner.last_cells import placed_fill_links
from megatron_h2.planner.length_floor import fewest_stages, position_caps, stage_links
from megatron_h2.planner.stage_count import counted_fill_links
from megatron_h2.planner.sync_cells import refine
from megatron_h2.planner.uniform_root import least_over_types
from megatron_h2.planner.zero_bubble_fill import fill_shares

if TYPE_CHECKING:
    from megatron_h2.planner.bounds import BatchShape

PROBES = 16
"""Probes at which the knapsack is solved; each interval reads the next solved probe up (the
fill and links can only fall as the probe grows, so that stays a lower bound)."""

SYNCS = 16
"""Intervals of the largest end-of-step term in :func:`deep_root` (and one each below and above)."""


def mode_widths(shape: BatchShape, kind: int, probes: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Per recompute mode, probe and stage count ``n = 1 .. most``: the most units ``n`` stages
    of ``kind`` hold in modes up to that one (each mode its ``n`` best warm-ups of ``caps``,
    probe x kind x mode x warm-up, :func:`~megatron_h2.planner.length_floor.position_caps`):
    mode x probe x n."""
    most = min(shape.kinds[kind].max_stages, shape.positions)
    unit = shape.unit[kind]  # per mode, the folded steady term per unit
    with np.errstate(divide="ignore", invalid="ignore"):
        timed = np.where(unit[:, None] > 0, np.floor(probes[None, :] / unit[:, None]), np.inf)
    mem = np.moveaxis(caps[:, kind], 0, 1)  # mode x probe x warm-up
    held = np.clip(np.minimum(timed[:, :, None], mem), 0, shape.layers)
    held = np.maximum.accumulate(held, axis=0)  # modes up to m
    held = -np.sort(-held, axis=2)[:, :, :most]  # the best warm-ups first
    return held.cumsum(axis=2)


def stage_buckets(most: int) -> tuple[np.ndarray, np.ndarray]:
    """Ranges ``[low, high]`` of stage counts ``1 .. most`` that :func:`kind_costs` takes at once:
    one each up to 8, then about a quarter wider each."""
    edges = [1]
    while edges[-1] <= most:
        edges.append(edges[-1] + max(1, edges[-1] // 4 if edges[-1] > 8 else 1))
    low = np.array(edges[:-1])
    return low, np.minimum(np.array(edges[1:]) - 1, most)


def kind_costs(
    shape: BatchShape, kind: int, probes: np.ndarray, caps: np.ndarray, rise: np.ndarray
) -> np.ndarray:
    """Per probe and unit count ``x = 0 .. L``: the least segment fill plus links of one block of
    ``kind`` holding ``x`` units over its stage counts (inf where none holds them; 0 at 0);
    ``caps`` as :func:`mode_widths` takes them; ``rise``: per probe, what every unit's fill
    rises by (zero-bubble's shorter share). Stage counts ``n`` in a range ``[a, b]``
    (:func:`stage_buckets`) count ``a`` links and the segments of ``b`` stages (more stages
    hold more in each mode, so fill no more): a lower bound for each."""
    widths = mode_widths(shape, kind, probes, caps)  # mode x probe x n
    if not widths[-1, :, -1].max() >= 1:
        best = np.full((len(probes), shape.layers + 1), np.inf)
        best[:, 0] = 0.0
        return best  # holds nothing at these probes
    low, high = stage_buckets(widths.shape[2])
    return bucket_costs(shape, kind, widths[:, :, high - 1], low, np.asarray(rise)[:, None])


def bucket_costs(
    shape: BatchShape, kind: int, widths: np.ndarray, low: np.ndarray, rise: np.ndarray,
    heads: np.ndarray | None = None, ranges: bool = False,
) -> np.ndarray:
    """:func:`kind_costs` from the most units of each stage-count range (``widths``: mode x
    probe x range, starting at ``low`` stages; a range starting above the kind's most stages
    holds nothing), each unit's fill ``rise`` (probe x range) higher; with ``heads`` (per
    probe) for the kind's block that ends the pipeline (:mod:`.last_cells`): its head stage
    holds at most ``heads`` units (none: no such block), it fills its head and sends no link
    onwards (inf at 0 units). With ``ranges`` per range (probe x range x units), not their
    least."""
    best = np.full((widths.shape[1], shape.layers + 1), np.inf)
    if heads is None:
        best[:, 0] = 0.0
    if not widths[-1].max(initial=0.0) >= 1:  # holds nothing at these probes
        return np.repeat(best[:, None], len(low), axis=1) if ranges else best
    fill, below = segment_fill(shape, kind, widths, rise)
    k = shape.kinds[kind]
    x = np.arange(shape.layers + 1, dtype=np.float64)[None, None, :]
    stages = low[None, :, None].astype(np.float64)
    fits = (x <= below) & (x >= stages) & (stages <= min(k.max_stages, shape.positions))
    if heads is None:
        total = fill + block_links(shape, k.chip, stages)
    else:
        total = fill + (stages - 1.0) * shape.inner_link[k.chip] + float(shape.head_time[kind])
        fits &= np.asarray(heads)[:, None, None] >= 1
    total = np.where(fits, total, np.inf)
    if ranges:
        total[:, :, 0] = 0.0 if heads is None else np.inf
        return total
    best[:, 1:] = total.min(axis=1)[:, 1:]  # probe x units
    return best


def segment_fill(
    shape: BatchShape, kind: int, widths: np.ndarray, rise: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The least fill of ``x = 0 .. L`` units on stages of ``kind`` whose modes up to ``m`` hold
    at most ``widths[m]`` units (mode x probe x group, non-decreasing in ``m``): the convex
    segments of the module docstring, each unit's fill ``rise`` (probe x group) higher; probe
    x group x units, and the most units (probe x group x 1)."""
    k = shape.kinds[kind]
    prices = np.array([k.costs.layer_time(m) for m in range(len(MODES))])
    prices = prices - (prices[0] - shape.fill_unit[kind])  # the fill per unit by mode
    prices = np.minimum.accumulate(prices[::-1])[::-1]  # non-decreasing (no mode costs less)
    prices = prices[:, None, None] + np.asarray(rise)[None]  # mode x probe x group
    x = np.arange(shape.layers + 1, dtype=np.float64)[None, None, :]
    fill = np.zeros(widths.shape[1:] + (shape.layers + 1,))
    below = np.zeros(widths.shape[1:] + (1,))
    for mode in range(len(MODES)):
        upper = widths[mode][:, :, None]
        width = np.maximum(upper - below, 0.0)
        fill += prices[mode][:, :, None] * np.clip(x - below, 0.0, width)
        below = np.maximum(below, upper)
    return fill, below


def share_rises(shape: BatchShape, stages: np.ndarray) -> np.ndarray:
    """Per kind and probe, what zero-bubble's fill per unit rises by at least
    (:mod:`.zero_bubble_fill`): ``(s_k - 1 - b(p, m_k)) G_k`` where every plan has at least
    ``stages`` stages (per probe; 0 under other schedules and for MoE models)."""
    rises = np.zeros((len(shape.kinds), len(stages)))
    if shape.schedule != "zero-bubble" or shape.cost.model.is_moe:
        return rises
    least = np.clip(stages, 2, max(shape.positions, 2))
    shares = fill_shares(shape.schedule, [k.micro_batches for k in shape.kinds])
    for kind, k in enumerate(shape.kinds):
        b = np.minimum(k.micro_batches - 1, least - 1) / (least - 1)  # zero_bubble_share, p > 1
        rises[kind] = np.maximum((shares[kind] - 1.0 - b) * k.costs.layer_weight_grad, 0.0)
    return rises


def joint_fill_links(
    shape: BatchShape, probes: np.ndarray, caps: np.ndarray, rises: np.ndarray
) -> np.ndarray:
    """Per probe, a lower bound on the summed fill (edges included) plus the links of every plan
    of the one-DP ``shape`` whose slowest folded steady term is at most the probe: the knapsack
    of the module docstring with the memory ``caps`` (:func:`mode_widths`), each kind's fill per
    unit ``rises`` higher (kind x probe); inf where no choice holds the layers."""
    tables = [np.min([kind_costs(shape, kind, probes, caps, rises[kind])
                      for kind in shape.kinds_of[chip]], axis=0) for chip in shape.types]
    return least_over_types(shape, tables)


def joint_root_terms(
    shape: BatchShape, probes: np.ndarray, tail: np.ndarray, fill: np.ndarray
) -> np.ndarray:
    """The root bound per probe interval ``(g_j, g_j+1]`` (``probes[:-1]``) of a one-DP shape
    with the end-of-step term at least ``tail`` (per interval), read at the first solved probe
    not below ``g_j+1``: the fill and links joint (:func:`joint_fill_links`), or the summed
    ``fill`` (per interval) and the links of the fewest stages
    (:func:`~megatron_h2.planner.length_floor.stage_links`), whichever is larger; under
    zero-bubble both fills rise with the fewest stages. MoE models (layers unlike, merged kinds
    without per-kind costs, :mod:`.merged_shape`): 0."""
    if shape.cost.model.is_moe:
        return np.zeros(len(probes) - 1)
    picks = np.unique(np.linspace(1, len(probes) - 1, PROBES).round().astype(np.int64))
    at = np.searchsorted(picks, np.arange(1, len(probes)))  # interval -> solved probe
    stages = fewest_stages(shape, probes[picks])
    rises = share_rises(shape, stages)
    caps = position_caps(shape, stages)
    joint = joint_fill_links(shape, probes[picks], caps, rises)[at]
    links = stage_links(shape, probes[picks], stages)[at]
    loose = fill + shape.layers * rises.min(axis=0)[at]
    low = probes[:-1]
    own = shape._own_work(low)
    least_links = np.maximum(shape.root_links, links)
    if shape.schedule == "zero-bubble":
        tail = np.maximum(tail, shape.tail_share * own)
        joint_terms = np.maximum(joint + tail, own + least_links)
        loose_terms = np.maximum(loose + tail, own) + least_links
    else:
        joint_terms = np.maximum(joint, own + least_links) + tail
        loose_terms = np.maximum(loose, own) + tail + least_links
    return shape.steady * low + np.maximum(joint_terms, loose_terms)


class CellBounds:
    """Lower bounds on the plans of a one-DP ``shape`` in cells of :func:`deep_root`: where the
    slowest folded steady term is in ``(probes[lo], probes[hi]]`` and the largest end-of-step
    term in ``(z_lo, z_hi]``, every stage holds at most its caps at ``probes[hi]`` (time, and
    memory in a pipeline of at least the fewest stages there; under zero-bubble also at least
    its block's, with one block ending the pipeline at its own places and holding the head,
    :mod:`.last_cells`) and at most ``r_k z_hi`` units (``r`` the kinds'
    :attr:`~megatron_h2.planner.bounds.BatchShape.sync_inverse`), so the fill and links are at
    least the knapsack's with those caps, the steady term at least ``probes[lo]`` and the
    end-of-step term at least ``z_lo``."""

    def __init__(self, shape: BatchShape, probes: np.ndarray):
        self.shape, self.probes = shape, probes
        self.stages = fewest_stages(shape, probes)
        self.links = np.maximum(shape.root_links, stage_links(shape, probes, self.stages))
        self.rates = np.asarray(shape.sync_inverse, dtype=np.float64)
        self._caps: tuple[np.ndarray, np.ndarray] | None = None

    def __call__(
        self, lo: np.ndarray, hi: np.ndarray, z_lo: np.ndarray, z_hi: np.ndarray,
        counted: bool = False,
    ) -> np.ndarray:
        """The bounds of the cells ``(lo, hi]`` (probe indices) by ``(z_lo, z_hi]``; with
        ``counted`` the knapsack with the pipeline's stage count kept too
        (:mod:`.stage_count`, tens of times the CPU)."""
        shape, probes, links = self.shape, self.probes, self.links
        with np.errstate(invalid="ignore"):  # inf x 0: no DP sync, no cap
            per_stage = np.floor(self.rates[None, :] * z_hi[:, None] * (1 + 1e-9))
        per_stage = np.where(np.isinf(self.rates)[None, :], np.inf, per_stage)
        if shape.schedule == "zero-bubble":  # places by length, the head's block (last_cells)
            joint = placed_fill_links(shape, probes[hi], per_stage, self.stages[hi], z_hi)
        else:
            if self._caps is None:  # per probe: the fill's rises and the memory caps
                self._caps = share_rises(shape, self.stages), position_caps(shape, self.stages)
            rises, caps = self._caps
            held = np.minimum(caps[hi], per_stage[:, :, None, None])
            joint = joint_fill_links(shape, probes[hi], held, rises[:, hi])
        if counted:
            joint = np.maximum(joint, counted_fill_links(shape, probes[hi], per_stage,
                                                         self.stages[hi], z_hi))
        z, own = np.maximum(z_lo, shape.tail_floor), shape._own_work(probes[lo])
        if shape.schedule == "zero-bubble":
            terms = np.maximum(joint + np.maximum(z, shape.tail_share * own), own + links[hi])
        else:
            terms = np.maximum(joint, own + links[hi]) + z
        return shape.steady * probes[lo] + terms


def deep_probes(
    shape: BatchShape, cutoff: float = np.inf
) -> tuple[np.ndarray, np.ndarray, float] | None:
    """The probe grid of :func:`deep_root` below ``cutoff`` (:func:`_probe_grid`: the probes and
    the indices it solves) and the top of its end-of-step cells (:func:`_reach`), or None where
    it has none."""
    floor = max(shape.w_floor, float(shape.head_need.min()))
    top, sync_top = _reach(shape, floor, cutoff)
    if not top > floor or shape.cost.model.is_moe or not shape.positions:
        return None  # MoE: as joint_root_terms
    return *_probe_grid(floor, top), sync_top


def deep_root(shape: BatchShape, cutoff: float, share: float = 1.0) -> float:
    """A lower bound on every plan of the one-DP ``shape`` with the end-of-step term coupled
    too, or ``cutoff`` if that is lower: on the cells (:class:`CellBounds`) of :data:`PROBES`
    probe intervals and :data:`SYNCS` intervals ``(Z_k, Z_k+1]`` of the largest end-of-step
    term, each stage of kind ``k`` holds at most ``r_k Z_k+1`` units (its term grows at least
    linearly in them), so the knapsack runs with those caps too and the term is at least
    ``Z_k``; the least over the cells whose steady term and links may be below ``cutoff`` (the
    others bound at least ``cutoff``), the lowest cells refined (:mod:`.sync_cells`, ``share``
    of its budget), and above the top probe the uncoupled terms. The probes and cells reach the
    ``cutoff`` (:func:`_reach`, :func:`_probe_grid`): above it the steady or end-of-step term
    alone is at least the cutoff, so the cells end at it (split there, each bound no lower)."""
    if (grid := deep_probes(shape, cutoff)) is None:
        return 0.0
    probes, picks, sync_top = grid
    lows = np.concatenate(([0], picks[:-1]))
    bounds = CellBounds(shape, probes)
    keep = shape.steady * probes[lows] + bounds.links[picks] < cutoff
    finite = bounds.rates[np.isfinite(bounds.rates) & (bounds.rates > 0)]
    best = shape._root_terms(probes[-1], shape.tail_floor, shape.root_links)  # above the top
    if not keep.any() or not len(finite):  # nothing below the cutoff, or no DP sync
        return float(min(best, cutoff)) if not keep.any() else 0.0
    best = min(best, cutoff) if not keep.all() else best
    picks, lows = picks[keep], lows[keep]
    edges = np.geomspace(max(shape.tail_floor, 1e-9), shape.layers / finite.min(), SYNCS)
    if sync_top < edges[-1]:  # the cells split at the cutoff (above it: at least the cutoff)
        edges = np.append(edges[edges < sync_top], sync_top)
    edges = np.concatenate(([0.0], edges, [np.inf]))
    cells = []
    for k in range(len(edges) - 1):
        z_lo, z_hi = np.full(len(picks), edges[k]), np.full(len(picks), edges[k + 1])
        values = bounds(lows, picks, z_lo, z_hi)
        cells += list(zip(values.tolist(), lows.tolist(), picks.tolist(), z_lo.tolist(),
                          z_hi.tolist()))
    count = shape.schedule == "zero-bubble"  # the stage count's share and places (stage_count)
    return float(min(best, refine(shape, cells, bounds, min(best, cutoff), share, count)))


def _probe_grid(floor: float, top: float) -> tuple[np.ndarray, np.ndarray]:
    """The probes of :func:`deep_root` and the indices of those it solves: the coupled root's
    (97 from ``floor`` to four times it, :data:`PROBES` of them solved), continued at the same
    ratios up to ``top`` when that is higher (so the intervals below four times the floor are
    those they were before the probes reached the cutoff)."""
    low_top = min(top, 4.0 * floor)
    probes = np.geomspace(floor, low_top, 97)
    picks = np.unique(np.linspace(1, len(probes) - 1, PROBES).round().astype(np.int64))
    if top > low_top * (1 + 1e-12):
        ratio = probes[1] / probes[0]
        more = int(np.ceil(np.log(top / low_top) / np.log(ratio) - 1e-9))
        probes = np.concatenate((probes, low_top * ratio ** np.arange(1, more + 1)))
        probes[-1] = max(probes[-1], top)
        step = max(int(picks[-1] - picks[-2]), 1) if len(picks) > 1 else 1
        extra = np.arange(picks[-1] + step, len(probes) - 1 + step, step)
        picks = np.unique(np.append(picks, np.minimum(extra, len(probes) - 1)))
    return probes, picks


def _reach(shape: BatchShape, floor: float, cutoff: float) -> tuple[float, float]:
    """The top probe of :func:`deep_root` and the top of its end-of-step cells: four times the
    ``floor`` probe (the coupled root's) or, with a finite ``cutoff``, the probe whose steady term
    alone is the cutoff if that is higher (the uncoupled terms above the top probe then bound at
    least the cutoff, where at four times the floor they bound the plans between far below it:
    on the 100,000-chip 70B member, micro-batch 1 zero-bubble at DP 256, 0.769 s where its best
    plan found takes 1.19 s); and the top of the end-of-step cells: the cutoff (a larger term
    alone is at least it; inf without one)."""
    top = 4.0 * floor
    if not np.isfinite(cutoff) or cutoff <= 0:
        return min(shape.w_max, top), np.inf
    if shape.steady > 0:
        top = max(top, cutoff / shape.steady)
    return min(shape.w_max, top), max(cutoff, shape.tail_floor * (1 + 1e-9))
