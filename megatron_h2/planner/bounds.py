"""Per batch shape tables and lower bounds for the branch and bound of :mod:`.search`.

A *batch shape* is a micro-batch size ``b`` and a pipeline schedule (with ``V`` model chunks); it
fixes the number of micro-batches ``M = global batch / b``. Its *stage kinds* are (chip type, TP
degree ``t``, DP degree ``d``). *Uniform* shapes give every stage one DP degree ``d`` (a
divisor of ``M``), as Megatron does; in the other shapes every chip type picks its own DP
degree and then uses all of its chips (its ``n`` stages with ``n t d`` = its chip count, so no
type is forced into extra stages or left partly idle; interleaved shapes are uniform only). A
kind's replicas run ``m = M / d`` micro-batches each. The step time of every schedule has the form
``T = max_i F_i w_i + sum_i f_i + max_i z_i + links`` (:mod:`~megatron_h2.planner.partition`);
bounds work with the *folded* steady term ``g = F_i w_i`` (``F_i = m_i - 1``, or ``m V - 1``
under interleaving), so that kinds of different DP degrees compare on one scale.

Memory caps depend on how many micro-batches a stage holds, which its warm-up ``q`` sets
(:func:`~megatron_h2.plan.orders.routed_leads`: ``q = 0`` on the last stage; under uniform
DP ``q`` is the number of stages after it). The warm-up of a stage of kind ``k`` placed in front of
a pipeline suffix follows from the suffix's *lead* ``L`` (the micro-batch lead its front stage
needs from the next stage in front: ``G + d`` of the front stage, 0 for an empty suffix):
``q = ceil(L / d_k)``, and ``n`` stages of kind ``k`` leave the lead ``d_k (q + n)``. Tables per
kind are indexed by ``q`` up to the number of positions; a larger warm-up reads the last entry,
which holds at least as much (caps fall with ``q``), so every table entry stays an upper bound.

Bounds use a grid of probe values ``g_0 < g_1 < ...`` for the largest folded steady term and,
per stage kind and warm-up, an upper bound on the layers a stage can hold with ``F w <= g``:
``max over recompute modes of min(g / (F u_mode), memory cap)``, ignoring embedding and head.
Below a node (a pipeline suffix) the *groups* of stages are the suffix's blocks (known kind,
stages and warm-ups, at least one layer per stage) and the chip types not used yet. An unused
type contributes convex cost segments (its kinds by per-layer time, each adding the layers it
can hold beyond the faster ones), and all unused types together add at most what a max-plus
programme over subsets of types, kinds and stage counts on a grid of leads says (leads rounded
down, which only adds capacity). Any plan below the node whose largest steady term is in
``(g_j, g_j+1]`` needs that term ``> g_j`` and, since no stage holds more than its capacity at
``g_j+1``, at least ``Fill(g_j+1)`` of summed work, where ``Fill`` fills the ``L`` layers into
the cheapest capacity first; the slowest stage's own work is at least ``g_j / max F``. Adding a
lower bound on the slowest DP sync (the layers spread over every stage that may exist, and at
least the last stage's with the head and the first stage's with the embedding, and at least
the least sync at which the layers fit at ``g_j+1``, :mod:`.sync_coupling`), the known link
times and the links of the stages still to come (the layers the known blocks cannot hold need
new stages, each type's with its own capacities and link, :mod:`.stage_links`) gives
``T >= g_j + max(Fill(g_j+1), g_j / max F) + sync + links`` for some admissible ``j``. A shape's
root bound uses the least probe with the fill of the cheapest memory capacity (no time caps),
the links of the fewest stages that hold every layer and the first and last stages' syncs,
or, if larger, its terms with the sync and the links coupled with the probe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_h2.planner.bound_columns import (
    FLOOR_SIZE,
    ColumnFloor,
    ColumnTerms,
    admissible_rows,
    fill_floor,
    live_columns,
    take_columns,
)
from megatron_h2.planner.cost_model import MODES, CostModel, zero_bubble_share
from megatron_h2.planner.coupled_root import coupled_root
from megatron_h2.planner.head_block import block_link_terms
from megatron_h2.planner.joint_root import deep_root
from megatron_h2.planner.lead_cache import at_leads
from megatron_h2.planner.option_group import known_blocks
from megatron_h2.planner.partition import INF
from megatron_h2.planner.rest_bound import RestBound, greedy_take
from megatron_h2.planner.shape_memory import ShapeMemory
from megatron_h2.planner.stage_costs import StageCosts
from megatron_h2.planner.stage_links import raise_new_stages
from megatron_h2.planner.sync_coupling import SyncCoupling
from megatron_h2.planner.zero_bubble_fill import fill_shares

if TYPE_CHECKING:
    from collections.abc import Sequence


class Kind:
    """A stage kind: chip type (index and name), TP and DP degree, most stages, its costs, the
    micro-batches of each of its DP replicas and the step formula's factor ``F``."""

    __slots__ = ("chip", "name", "tp", "dp", "max_stages", "costs", "micro_batches", "factor",
                 "ep")

    def __init__(
        self,
        chip: int,
        name: str,
        tp: int,
        dp: int,
        max_stages: int,
        costs: StageCosts,
        micro_batches: int,
        factor: int,
        ep: int = 1,
    ) -> None:
        self.chip, self.name, self.tp, self.dp, self.ep = chip, name, tp, dp, ep
        self.max_stages, self.costs = max_stages, costs
        self.micro_batches, self.factor = micro_batches, factor


class BatchShape(ShapeMemory, RestBound, SyncCoupling, ColumnFloor):
    """Stage kinds, memory caps, link times and bound tables for one batch shape: micro-batch
    size and pipeline schedule (with its number of model chunks ``V``), and for ``interleaved``
    the one DP degree ``dp`` of every stage. ``only`` keeps just the kinds with those (chip
    index, TP, DP) triples (a restricted space: its bounds hold for the plans of those kinds).

    Layers are counted in *units* of one layer per chunk (``V`` layers; one layer unless the
    schedule is ``interleaved``).
    """

    def __init__(
        self,
        cost: CostModel,
        global_batch_size: int,
        mbs: int,
        schedule: str = "1f1b",
        chunks: int = 1,
        dp: int | None = None,
        lazy: bool = False,
        only: frozenset[tuple[int, int, int]] | None = None,
    ) -> None:
        self.cost, self.mbs, self.dp = cost, mbs, dp
        self.schedule, self.chunks = schedule, chunks
        self.layers = cost.model.num_layers // chunks  # units
        self.total = global_batch_size // mbs
        self.link_factor = 2.0 * chunks  # x one-way link time, for the links between stages
        model = cost.model
        largest = max(c.count for c in cost.cluster.chips)
        degrees = (
            [dp]
            if dp is not None
            else [d for d in range(1, min(self.total, largest) + 1) if self.total % d == 0]
        )
        kinds = []
        for index, chip in enumerate(cost.cluster.chips):
            for tp in chip.tensor_parallel_options(
                model.num_attention_heads, model.num_query_groups
            ):
                for d in degrees:
                    count = chip.count // (tp * d)
                    if not count or (
                        dp is None and (count * tp * d != chip.count or count > self.layers)
                    ):
                        continue  # own-DP kinds use all of their type's chips
                    if only is not None and (index, tp, d) not in only:
                        continue
                    m = self.total // d
                    factor = m * chunks - 1 if schedule == "interleaved" else m - 1
                    for ep in cost.expert_parallel_options(tp, d):  # [1] if dense
                        costs = cost.stage_costs(chip.name, tp, mbs, d, ep)
                        kinds.append(Kind(index, chip.name, tp, d, count, costs, m, factor, ep))
        if cost.model.num_layers % chunks:
            kinds = []  # equal chunks cannot hold the layers
        self._set_kinds(kinds)
        self._mode_caps: dict[tuple[int, int, int, int | None], tuple[int, int, int]] = {}
        self._placed_caps: dict[tuple[int, int, int, int], tuple[int, int, int]] = {}
        self._links: dict[tuple[str, str], float] = {}
        self.range_rows: dict[tuple[object, ...], tuple[np.ndarray, ...]] = {}
        """Per-stage rows of the range split (:mod:`.partition_ranges`), kept across splits."""
        self.grid = np.zeros(1)
        self._grid_key: tuple[float, int, int] | None = None
        self.grid_is_max = True
        self.prepared, self.pre_bound, self.tightened = False, 0.0, False
        if not lazy:
            self.prepare()

    def _set_kinds(self, kinds: Sequence[Kind]) -> None:
        """The stage kinds and what follows from them alone (chip types, positions)."""
        self.kinds = tuple(kinds)
        self.types = sorted({k.chip for k in kinds})
        self.kinds_of = {t: [i for i, k in enumerate(kinds) if k.chip == t] for t in self.types}
        per_type = [max(kinds[i].max_stages for i in self.kinds_of[t]) for t in self.types]
        self.positions = min(self.layers, sum(per_type)) if kinds else 0  # >= 1 unit per stage
        self.depth = self.positions + 1  # warm-ups with their own memory caps
        self.factor_max = max((k.factor for k in kinds), default=0)

    def counts(self, kind: int, room: int) -> np.ndarray:
        """Stage counts of a block of ``kind`` that fit in ``room`` free stage positions: 1 to
        its most, or under own DP degrees only its ``max_stages`` (every chip of its type)."""
        most = self.kinds[kind].max_stages
        if not self.uniform:
            return np.array([most] if most <= room else [], dtype=np.int64)
        return np.arange(1, min(most, room) + 1)

    @property
    def uniform(self) -> bool:
        """Whether every stage of this shape has the same DP degree (interleaved shapes)."""
        return self.dp is not None

    def prepare(self) -> None:
        """Build the bound tables (once); until then :meth:`root_bound` is :attr:`pre_bound`."""
        if self.kinds and not self.prepared:
            self._prepare()
        self.prepared = True

    def tighten(self) -> None:
        """Raise the root bound (once, prepared) with the end-of-step term's levels
        (:func:`~megatron_h2.planner.uniform_root.sync_levels`; it costs more than the rest of
        the root, so only for the shapes the search bounds beyond their roots)."""
        if self.prepared and self.positions and not self.tightened:
            self.tightened = True
            self.root_coupled = max(self.root_coupled, self._coupled_root(True))

    def cheap_bound(self, floor: float) -> float:
        """A lower bound on :meth:`root_bound` from the 1F1B shape of the same micro-batch size,
        without the tables: the same time caps and no more memory capacity. ``floor``: that
        shape's folded floor (:attr:`w_floor` of the 1F1B shape with the same DP degrees)."""
        units = np.array([k.costs.layer_time(0) for k in self.kinds])
        m = self.kinds[0].micro_batches
        if self.schedule == "zero-bubble":
            weight = np.array([k.costs.layer_weight_grad for k in self.kinds])
            weight *= fill_shares(self.schedule, [k.micro_batches for k in self.kinds])
            steady = floor if m > 1 else 0.0  # one micro-batch: no steady term
            return steady + max(self.layers * float((units - weight).min()), 0.0)
        work = floor / max(m - 1, 1) / self.chunks  # W of the slowest stage / V
        return (m * self.chunks - 1) * work + max(work, self.layers * float(units.min()))

    # ------------------------------------------------------------------------- exact pieces
    def link(self, sender: str, receiver: str) -> float:
        """One-way point-to-point time of one micro-batch between two chip types (cached)."""
        key = (sender, receiver)
        if key not in self._links:
            self._links[key] = self.cost.link_s(sender, receiver, self.mbs)
        return self._links[key]

    # ------------------------------------------------------------------------------- bounds
    def _prepare(self) -> None:
        self._tables()
        self.leads = self._lead_grid()
        self.type_link = self._type_links()
        self.inner_link, self.outer_link = block_link_terms(self)
        self.w_floor = self._root_w(range(len(self.kinds))) if self.positions else self.w_max
        self.root_fill, self.root_links = self._root_extras() if self.positions else (0.0, 0.0)
        self.root_coupled = self._coupled_root() if self.positions else 0.0

    def _type_links(self) -> dict[int, float]:
        """Per chip type, a lower bound on its stages' link to any stage (the cheapest)."""
        return {
            t: self.link_factor * min(
                self.link(self.cost.cluster.chips[t].name, self.cost.cluster.chips[u].name)
                for u in self.types
            )
            for t in self.types
        }

    def _tables(self) -> None:
        """The per-kind bound tables (times, fills, memory caps, edges, syncs) and ``w_max``."""
        layers, v, kinds = self.layers, self.chunks, self.kinds
        factors = np.array([k.factor for k in self.kinds], dtype=np.float64)
        times = np.array([[k.costs.layer_time(r) for r in range(len(MODES))] for k in self.kinds])
        scale = 1.0 / v if self.schedule == "interleaved" else 1.0
        # With one micro-batch per replica everywhere (F = 0) there is no steady term: probes
        # then bound the slowest stage's own work w (fold 1) and count once, not twice.
        self.steady = 1.0 if self.factor_max > 0 else 0.0
        folds = factors if self.factor_max > 0 else np.ones(len(self.kinds))
        self.unit = folds[:, None] * times  # folded steady term per unit (w = W / V per unit)
        weight = np.array([k.costs.layer_weight_grad for k in self.kinds])
        share = fill_shares(self.schedule, [k.micro_batches for k in self.kinds])  # 1 + b <= it
        self.fill_unit = times[:, 0] - share * weight
        # zero-bubble's tail (1 + b) G_k of the slowest stage k is at least this share of W_k
        self.tail_share = 0.0
        if self.schedule == "zero-bubble":
            ratios = [weight / times[:, -1]]  # per-layer weight share, slowest mode
            for part in ("head", "embedding"):
                time = np.array(
                    [
                        getattr(k.costs, f"{part}_forward") + getattr(k.costs, f"{part}_backward")
                        for k in self.kinds
                    ]
                )
                grad = np.array([getattr(k.costs, f"{part}_weight_grad") for k in self.kinds])
                ratios.append(np.where(time > 0, grad / np.maximum(time, 1e-300), 1.0))
            beta = min(
                zero_bubble_share(max(self.positions, 2), k.micro_batches) for k in self.kinds
            )
            self.tail_share = (1.0 + beta) * float(np.concatenate(ratios).min())
        self.mem_caps = self._memory_caps()  # kind x mode x warm-up
        head_weight = np.array([k.costs.head_weight_grad for k in self.kinds])
        emb_weight = np.array([k.costs.embedding_weight_grad for k in self.kinds])
        head = np.array([k.costs.edge_time(False, True) for k in self.kinds])
        emb = np.array([k.costs.edge_time(True, False) for k in self.kinds])
        # The last stage holds the head and the first the embedding, each with at least one
        # layer: their folded steady terms are at least these (the fastest mode's layer).
        self.head_need = folds * (head * scale + times[:, 0])
        self.embedding_need = folds * (emb * scale + times[:, 0])
        self.head_time = (head - share * head_weight) * scale  # the edges' fill
        self.embedding_time = (emb - share * emb_weight) * scale
        self.embedding_min = float(self.embedding_time.min())
        # The end-of-step term z: the DP sync, under zero-bubble plus the deferred weight
        # gradients (1 + b) G, b at least its value on the longest pipeline (it falls with p).
        grads = np.zeros(len(self.kinds))
        if self.schedule == "zero-bubble":
            longest = max(self.positions, 2)
            grads = 1.0 + np.array([zero_bubble_share(longest, k.micro_batches) for k in kinds])
        self.sync_one = np.array([k.costs.dp_sync(v, False, False) for k in self.kinds])
        self.sync_one += grads * weight
        self.head_tail = np.array([k.costs.dp_sync(v, False, True) for k in self.kinds])
        self.head_tail += grads * (weight + head_weight)  # the last stage: a layer and the head
        self.embedding_tail = np.array([k.costs.dp_sync(v, True, False) for k in self.kinds])
        self.embedding_tail += grads * (weight + emb_weight)  # the first: a layer, the embedding
        self.type_embedding_tail = {
            t: float(self.embedding_tail[self.kinds_of[t]].min()) for t in self.types
        }
        # every plan has a last stage (head) and a first stage (embedding)
        self.tail_floor = max(float(self.head_tail.min()), float(self.embedding_tail.min()))
        slope = np.array([v * k.costs.sync_per_layer for k in self.kinds])
        slope += grads * weight
        with np.errstate(divide="ignore"):
            self.sync_inverse = np.where(slope > 0, 1.0 / np.maximum(slope, 1e-300), INF)
        stages = np.array([k.max_stages for k in self.kinds], dtype=np.float64)
        self._sync_floats = (self.sync_one.tolist(), self.sync_inverse.tolist())
        self.type_sync_inverse = {
            t: float(max(stages[i] * self.sync_inverse[i] for i in self.kinds_of[t]))
            for t in self.types
        }
        full = [
            max(k.factor, 1 - self.steady)
            * (k.costs.edge_time(True, True) * scale + layers * k.costs.layer_time(2))
            for k in self.kinds
        ]
        self.w_max = max(max(full) * (1 + 1e-9), 1e-30)

    def _root_extras(self) -> tuple[float, float]:
        """Lower bounds on the summed fill (edges included) and on the link time of every
        plan of this shape, whatever its slowest stage: the layers filled into the cheapest
        memory capacity (:meth:`_segment_fill` with no time caps), and the fewest stages that
        hold them, each but one with a link of at least the cheapest of its type's."""
        caps = self.capacity(np.array([self.w_max]))  # memory-bound: every kind's time cap is L
        fill = float(self._segment_fill(self._most_layers(caps))[0])
        per_stage = float(caps[:, 0, :].max())  # any warm-up (zero-bubble: not always 0)
        stages = -(-self.layers // max(int(per_stage), 1))
        return fill, (stages - 1) * min(self.type_link.values())

    def _own_work(self, work: np.ndarray | float) -> np.ndarray | float:
        """The slowest stage's own work at the largest folded steady term ``work`` (F = 0: it)."""
        return work / max(self.factor_max, 1)

    def capacity(self, probes: np.ndarray) -> np.ndarray:
        """Upper bound on units per (kind, probe, warm-up) with folded work at most the probe."""
        with np.errstate(divide="ignore", invalid="ignore"):
            timed = np.floor(probes[None, :, None] / self.unit[:, None, :])  # kind x probe x mode
        timed = np.where(self.unit[:, None, :] > 0, timed, INF)[:, :, :, None]
        caps = np.minimum(timed[:, :, 0], self.mem_caps[:, None, 0])
        for mode in range(1, timed.shape[2]):  # the most over modes, one at a time (no 4-D temp)
            np.maximum(caps, np.minimum(timed[:, :, mode], self.mem_caps[:, None, mode]), out=caps)
        return np.clip(caps, 0, self.layers)

    def _prefix(self, caps: np.ndarray) -> np.ndarray:
        """Prefix sums over warm-ups ``0 .. depth + positions`` (warm-ups beyond the table read
        its last entry): kind x probe x (warm-up + 1)."""
        tail = np.repeat(caps[:, :, -1:], self.positions, axis=2)
        extended = np.concatenate((caps, tail), axis=2)
        zeros = np.zeros((caps.shape[0], caps.shape[1], 1))
        return np.concatenate((zeros, extended.cumsum(axis=2)), axis=2)

    def start(self, kind: int, lead: int) -> int:
        """Warm-up of the last stage of a block of ``kind`` placed in front of lead ``lead``."""
        return -(-lead // self.kinds[kind].dp)

    def _table_start(self, kind: int, lead: int | np.ndarray) -> np.ndarray:
        """:meth:`start` clamped to the table (warm-ups beyond it share the last entry)."""
        return np.minimum(-(-np.asarray(lead) // self.kinds[kind].dp), self.depth - 1)

    def _most_layers(self, caps: np.ndarray) -> np.ndarray:
        """Per kind and probe: most units the kind holds in a block ending the pipeline, of
        up to its most stages (``caps`` from :meth:`capacity`; such a block's warm-ups are all
        in the table). Sums of whole numbers, so the running sum is exact."""
        most = np.minimum([k.max_stages for k in self.kinds], self.positions)
        running = caps.cumsum(axis=2)  # kind x probe x warm-up
        return np.take_along_axis(running, (most - 1)[:, None, None], axis=2)[:, :, 0]

    def _root_w(self, kinds: Sequence[int]) -> float:
        """Largest folded work bound at which even the most optimistic pipeline of ``kinds``
        cannot hold all layers (to 0.01%; below the true one, so still a bound), by rounds of
        15 probes. Every chip type counts as if its block ended the pipeline."""
        chosen = set(kinds)
        groups = [[k for k in self.kinds_of[t] if k in chosen] for t in self.types]
        groups = [g for g in groups if g]
        if not groups:
            return INF
        low, high = 0.0, self.w_max
        while high - low > 1e-4 * high:
            probes = np.linspace(low, high, 17)[1:-1]
            most = self._most_layers(self.capacity(probes))
            held = sum(most[group].max(axis=0) for group in groups)
            enough = np.flatnonzero(held >= self.layers)
            if len(enough):
                high = float(probes[enough[0]])
                low = float(probes[enough[0] - 1]) if enough[0] else low
            else:
                low = float(probes[-1])
        return low

    def root_bound(self) -> float:
        """Lower bound on the step time of every plan of this batch shape."""
        if not self.positions or not self.prepared:
            return self.pre_bound if self.positions else INF
        w = max(self.w_floor, float(self.head_need.min()))  # some kind holds the head
        return max(float(self._root_terms(w, self.tail_floor, self.root_links)), self.root_coupled)

    def _root_terms(self, w: Any, tail: Any, links: Any, fill: Any = None) -> Any:
        """The root bound where the largest folded steady term is at least ``w``, the
        end-of-step term at least ``tail``, the links at least ``links`` and the summed fill at
        least ``fill`` (default :attr:`root_fill`): the slowest stage's own work counts under
        every schedule (zero-bubble: in its tail), and the fill."""
        own = self._own_work(w)
        fill = self.root_fill if fill is None else fill
        if self.schedule == "zero-bubble":
            tail = np.maximum(tail, self.tail_share * own)
            return self.steady * w + np.maximum(fill + tail, own) + links
        return self.steady * w + np.maximum(own, fill) + tail + links

    def _coupled_root(self, levels: bool = False, joint: bool = False) -> float:
        """The root bound with the end-of-step term and the links coupled with the steady term
        (:func:`~megatron_h2.planner.coupled_root.coupled_root`)."""
        return coupled_root(self, levels, joint)

    def refine_root(self, cutoff: float, share: float = 1.0) -> None:
        """Raise a one-DP shape's root bound once: its ``joint`` terms and :func:`.deep_root`
        (its cells refined with ``share`` of :data:`~.sync_cells.CELLS`)."""
        if self.uniform and self.prepared and self.positions and "_deep" not in self.__dict__:
            self._deep = max(self._coupled_root(joint=True), deep_root(self, cutoff, share))
            self.root_coupled = max(self.root_coupled, self._deep)

    def sharpen(self, cutoff: float, share: float) -> None:
        """Prepare and raise the root against ``cutoff`` (the search does so before searching
        a shape): :meth:`refine_root`, then, while still below ``cutoff``, :meth:`tighten`."""
        self.prepare()
        self.refine_root(cutoff, share)
        if self.root_bound() < cutoff:
            self.tighten()

    def build_grid(self, w_high: float, points: int, coarse: int = 32) -> None:
        """Probe values from the root bound up to ``w_high`` (geometric) and their prefix sums.

        The programme bounding unused chip types (:meth:`rest`) is computed on every
        ``points // coarse``-th probe only and read at the next coarse probe above (capacity grows
        with the probe, so this stays an upper bound).
        """
        top = min(max(w_high, self.w_floor * (1 + 1e-9)), self.w_max)
        if self._grid_key == (top, points, coarse):
            return  # the same grid: keep its tables
        self._grid_key = (top, points, coarse)
        self.grid = np.geomspace(max(self.w_floor, 1e-30), top, points)
        self.grid_is_max = top >= self.w_max
        self.prefix = self._prefix(self.capacity(self.grid))  # kind x probe x warm-up
        self._segment_units: dict[int, np.ndarray] = {}
        step = max(points // coarse, 1)
        picks = np.unique(np.append(np.arange(step - 1, points, step), points - 1))
        self.coarse_of = np.searchsorted(picks, np.arange(points))  # fine probe -> coarse index
        self.coarse_prefix = self.prefix[:, picks, :]
        self._rest: dict[int, np.ndarray] = {}
        self._from_leads: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._segment_tables: dict[int, np.ndarray] = {}
        self._unused: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._unused_widths: dict[int, np.ndarray] = {}
        self._stage_caps: dict[int, np.ndarray] = {}
        self._type_caps: dict[int, np.ndarray] = {}
        self._coupled_type_caps: np.ndarray | None = None
        self._placed: dict[tuple[int, int, int, int, int], np.ndarray] = {}
        self._timed: dict[int, np.ndarray] = {}
        self._closed: dict[tuple[int, int, int, tuple[int, ...]], np.ndarray] = {}

    def block(self, kind: int, start: int, ends: np.ndarray) -> np.ndarray:
        """Capacity bound of stages of ``kind`` with warm-ups ``start .. end - 1``: probe x
        len(ends) (``start`` from :meth:`start`; warm-ups beyond the table share its last
        entry)."""
        table = min(start, self.depth - 1)
        prefix = self.prefix[kind]
        return prefix[:, np.asarray(ends) - start + table] - prefix[:, [table]]

    def sync_bound(
        self,
        blocks: Sequence[tuple[int, np.ndarray | int]],
        unused: int,
        last: int,
        front: int | None = None,
    ) -> np.ndarray | float:
        """Lower bound on the largest end-of-step term ``z`` (the DP sync, under zero-bubble with
        the deferred weight gradients): the known blocks' one-layer terms, the last stage's (of
        kind ``last``) with the head, the first stage's with the embedding (of kind ``front``,
        the front block's, or of a type in ``unused`` placed in front of it), and the L layers
        spread so that the largest is smallest over every stage that may exist (``z`` grows at
        least linearly in the layers).
        """
        if not blocks:
            return 0.0
        one, inverse_of = self._sync_floats
        floor = max(max(one[kind] for kind, _ in blocks), float(self.head_tail[last]))
        if front is not None:
            first = float(self.embedding_tail[front])
            for t_index, chip in enumerate(self.types):
                if unused >> t_index & 1:
                    first = min(first, self.type_embedding_tail[chip])
            floor = max(floor, first)
        inverse: np.ndarray | float = 0.0
        for kind, count in blocks:
            inverse = inverse + count * inverse_of[kind]
        for t_index, chip in enumerate(self.types):
            if unused >> t_index & 1:
                inverse = inverse + self.type_sync_inverse[chip]
        # inverse > 0 (every block has a stage); inf (no DP sync anywhere) spreads to 0
        return np.maximum(self.layers / np.asarray(inverse, dtype=np.float64), floor)

    def bound(
        self,
        fixed: Sequence[tuple[float, np.ndarray, np.ndarray | int]],
        unused: int,
        leads: np.ndarray,
        links: np.ndarray | float,
        edges: np.ndarray | float,
        need: np.ndarray | float,
        sync: np.ndarray | float = 0.0,
        rates: Sequence[np.ndarray | float] | None = None,
        cutoff: float = INF,
        fronts: tuple[np.ndarray, float, float] | None = None,
        floors: bool = True,
        new_stages: bool = True,
    ) -> np.ndarray:
        """Lower bound on the step time per option column (see the module docstring).

        ``fixed``: (fastest per-layer fill, capacity probe x options, stages: one number or
        per option) of known blocks, each stage holding at least one layer; ``unused``: mask of
        chip types that may still be placed in front, of the pipelines' ``leads`` (one per
        option); ``edges``: the embedding's and head's fill; ``need``: the largest folded
        steady term is at least this (one layer on the slowest known block); ``sync``: a lower
        bound on the largest end-of-step sync (per option or one number, like ``links``);
        ``rates``: per known block its kind's :attr:`sync_inverse` (None: blocks uncapped by the
        sync), which with the unused types' couples the sync with the probe
        (:func:`~megatron_h2.planner.sync_coupling.least_sync`). A column whose bound is at
        least ``cutoff`` without it and the new stages' link floor (:mod:`.stage_links`) keeps it.
        ``fronts``: (per option its front stage's end-of-step floor with the embedding, the
        unused types' least, their least stage link): the lesser of closing with the option's
        block in front and of an unused type's block in front (one more stage and link).
        With ``floors`` a column is first bounded with a floor of its fill (:mod:`.bound_columns`);
        with ``new_stages`` the unused types' new stages are counted per type (:mod:`.stage_links`).
        """
        widths, units, mandatory_layers, mandatory_cost, short, placed_free = known_blocks(
            list(fixed))
        shape = np.broadcast_shapes(*(w.shape for w in widths))
        r_widths = None
        if unused:
            r_units, table = self._unused_segments(unused)
            units.extend(r_units)
            shape = np.broadcast_shapes(shape, (len(self.grid), len(leads)))
        units_arr = np.asarray(units)
        remaining = self.layers - np.asarray(mandatory_layers, dtype=np.float64)
        stage_links: np.ndarray | float = 0.0
        if unused:  # units the placed blocks cannot take need new stages, each with a link
            stage_links = self.new_stage_links(unused, leads, remaining - placed_free)
        sync = np.asarray(sync, dtype=np.float64)
        terms = ColumnTerms(self, need, sync, links, stage_links[1:] if unused else 0.0, fronts)
        index = at_leads(self, leads, "index", lambda: self.lead_index(leads)) if unused else None
        if floors and cutoff < INF and len(units) * len(leads) >= FLOOR_SIZE:  # the exact fill
            # only in the columns whose floor may be below the cutoff
            total = placed_free + (self.unused_widths(unused)[:, index] if unused else 0.0)
            least = fill_floor(units_arr, remaining, mandatory_cost, edges, shape)
            floor = terms.settle(sync, least, admissible_rows(self.grid, total, remaining, short,
                                                              need))
            live = live_columns(floor, cutoff)
            if len(live) < len(floor):  # bound_columns.py: the columns kept, exactly
                if len(live):
                    kept = take_columns(live, len(floor), fixed, unused, leads, links, edges, need,
                                        sync, rates, cutoff, fronts)
                    floor[live] = self.bound(*kept, floors=False, new_stages=new_stages)
                return floor
        if unused:
            r_widths = at_leads(self, leads, ("segments", unused), lambda: table[:, :, index])
        order = np.argsort(units_arr, kind="stable")
        place = np.empty(len(units), dtype=np.int64)
        place[order] = np.arange(len(units))  # where each segment goes, cheapest first
        stacked = np.empty((len(units),) + shape)
        for at, width in enumerate(widths):
            stacked[place[at]] = width
        if r_widths is not None:
            stacked[place[len(widths) :]] = r_widths
        take = greedy_take(stacked, remaining)
        flat = take.reshape(len(units), -1)
        fill = (units_arr[order] @ flat).reshape(shape) + mandatory_cost + edges
        covered = flat.sum(axis=0).reshape(shape)
        admissible = admissible_rows(self.grid, covered, remaining, short, need)
        keep = live = None  # the coupled sync and new stages (never lower) where they may win
        if cutoff < INF and (rates is not None or unused):
            rows = terms.rows(sync, fill, admissible)
            loose = terms.least(rows)
            keep = loose < cutoff
            if not keep.any():
                return loose
            live = rows + terms.links < cutoff  # the rows of a column whose term may win
            keep = None if keep.all() else keep
        if new_stages:
            fill = raise_new_stages(self, terms, fill, unused, leads, remaining - placed_free,
                                    mandatory_layers, live)
        coupled = self.coupled_sync(fixed, rates, unused, leads, keep)
        probed = sync if coupled is None else np.maximum(sync, coupled[1:])  # at g_j+1
        return terms.settle(probed, fill, admissible)
