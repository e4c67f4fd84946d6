"""Per batch shape tables and lower bounds for the branch and bound of :mod:`.search`.

A *batch shape* is a (micro-batch size ``b``, DP degree ``d``) pair; it fixes the number of
micro-batches ``m`` and every stage kind's costs. Bounds use a grid of probe values ``g_0 <
g_1 < ...`` for the slowest stage's work ``W`` and, per stage kind and position (counted from
the end of the pipeline), an upper bound on the layers a stage can hold with work at most
``g``: ``max over recompute modes of min(g / u_mode, memory cap)``, ignoring embedding and head.

Below a node (a pipeline suffix) the *groups* of stages are the suffix's blocks (known kind,
stages and positions, at least one layer per stage) and the chip types not used yet. An unused
type contributes convex cost segments (its kinds by per-layer time, each adding the layers it can
hold beyond the faster ones), and all unused types together add at most what an exact max-plus
programme over subsets of types, orders, TP degrees and stage counts says. Any plan below the
node whose slowest stage works ``W`` in ``(g_j, g_j+1]`` needs ``W > g_j`` and, since no stage
holds more than its capacity at ``g_j+1``, at least ``F(g_j+1)`` of summed work, where ``F`` fills
the ``L`` layers into the cheapest capacity first. Adding a lower bound on the slowest DP sync
(the layers spread over every stage that may exist) and the known link times gives
``T >= (m - 1) g_j + max(F(g_j+1), g_j) + sync + links`` for some admissible ``j``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_h2.planner.cost_model import MODES, CostModel, zero_bubble_share
from megatron_h2.planner.orders import Totals, held_totals, schedule_problem
from megatron_h2.planner.partition import INF
from megatron_h2.planner.stage_costs import StageCosts

if TYPE_CHECKING:
    from collections.abc import Sequence


class Kind:
    """A stage kind: chip type (index and name), TP degree, most stages, and its costs."""

    __slots__ = ("chip", "name", "tp", "max_stages", "costs")

    def __init__(self, chip: int, name: str, tp: int, max_stages: int, costs: StageCosts) -> None:
        self.chip, self.name, self.tp, self.max_stages, self.costs = (
            chip,
            name,
            tp,
            max_stages,
            costs,
        )


class BatchShape:
    """Stage kinds, memory caps, link times and bound tables for one batch shape: micro-batch
    size, DP degree and pipeline schedule (with its number of model chunks ``V``).

    Layers are counted in *units* of one layer per chunk (``V`` layers; one layer unless the
    schedule is ``interleaved``) and work in the step formula's terms
    (:mod:`~megatron_h2.planner.partition`): ``T = factor x max w + sum f + max z + links``.
    """

    def __init__(
        self,
        cost: CostModel,
        global_batch_size: int,
        mbs: int,
        dp: int,
        schedule: str = "1f1b",
        chunks: int = 1,
        lazy: bool = False,
    ) -> None:
        self.cost, self.mbs, self.dp = cost, mbs, dp
        self.schedule, self.chunks = schedule, chunks
        self.layers = cost.model.num_layers // chunks  # units
        self.micro_batches = global_batch_size // (mbs * dp)
        m = self.micro_batches
        self.factor = m * chunks - 1 if schedule == "interleaved" else m - 1
        self.link_factor = 2.0 * chunks  # x one-way link time, for the links between stages
        model = cost.model
        kinds = []
        for index, chip in enumerate(cost.cluster.chips):
            for tp in chip.tensor_parallel_options(
                model.num_attention_heads, model.num_query_groups
            ):
                count = chip.count // (tp * dp)
                if count:
                    kinds.append(
                        Kind(index, chip.name, tp, count, cost.stage_costs(chip.name, tp, mbs, dp))
                    )
        if cost.model.num_layers % chunks:
            kinds = []  # equal chunks cannot hold the layers
        self.kinds = tuple(kinds)
        self.types = sorted({k.chip for k in kinds})
        self.kinds_of = {t: [i for i, k in enumerate(kinds) if k.chip == t] for t in self.types}
        per_type = [max(kinds[i].max_stages for i in self.kinds_of[t]) for t in self.types]
        self.positions = min(self.layers, sum(per_type)) if kinds else 0  # >= 1 unit per stage
        self._mode_caps: dict[tuple[int, int, int], tuple[int, int, int]] = {}
        self._links: dict[tuple[str, str], float] = {}
        self.grid = np.zeros(1)
        self.grid_is_max = True
        self.prepared, self.pre_bound = False, 0.0
        if not lazy:
            self.prepare()

    def prepare(self) -> None:
        """Build the bound tables (once); until then :meth:`root_bound` is :attr:`pre_bound`."""
        if self.kinds and not self.prepared:
            self._prepare()
        self.prepared = True

    def cheap_bound(self, floor_1f1b: float) -> float:
        """A lower bound on :meth:`root_bound` from the 1F1B shape of the same micro-batch size
        and DP degree, without the tables: the same time caps and no more memory capacity make
        this shape's work floor at least ``floor_1f1b`` (per chunk: ``floor_1f1b / V``)."""
        units = np.array([k.costs.layer_time(0) for k in self.kinds])
        if self.schedule == "zero-bubble":
            weight = np.array([k.costs.layer_weight_grad for k in self.kinds])
            return self.factor * floor_1f1b + max(
                self.layers * float((units - 2.0 * weight).min()), 0.0
            )
        work = floor_1f1b / self.chunks
        return self.factor * work + max(work, self.layers * float(units.min()))

    # ------------------------------------------------------------------------- exact pieces
    def link(self, sender: str, receiver: str) -> float:
        """One-way point-to-point time of one micro-batch between two chip types (cached)."""
        key = (sender, receiver)
        if key not in self._links:
            self._links[key] = self.cost.link_s(sender, receiver, self.mbs)
        return self._links[key]

    def closes(self, stages: int) -> bool:
        """Whether a pipeline of ``stages`` stages can run this shape's schedule."""
        return schedule_problem(self.schedule, stages, self.micro_batches, self.chunks) is None

    def mode_caps(self, kind: int, stages: int, stage: int) -> tuple[int, int, int]:
        """Most units that fit per recompute mode for stage ``stage`` of ``stages`` of ``kind``
        (exact, from the schedule's held states; cached)."""
        key = (kind, stages, stage)
        if key not in self._mode_caps:
            costs = self.kinds[kind].costs
            states = held_totals(self.schedule, stages, self.micro_batches, self.chunks, stage)
            first, last = stage == 0, stage == stages - 1
            caps = [
                costs.max_units(self.chunks, mode, states, first, last)
                for mode in range(len(MODES))
            ]
            self._mode_caps[key] = (caps[0], caps[1], caps[2])
        return self._mode_caps[key]

    # ------------------------------------------------------------------------------- bounds
    def _optimistic_states(self, position: int) -> tuple[Totals, ...]:
        """Held states of a stage ``position`` stages from the end in the shortest pipeline that
        can run the schedule (a longer one holds more), or () if none can have that position."""
        m, v = self.micro_batches, self.chunks
        for stages in range(max(position + 1, 1), self.positions + 1):
            if self.closes(stages):
                return held_totals(self.schedule, stages, m, v, stages - 1 - position)
        return ()

    def _memory_caps(self) -> np.ndarray:
        """Upper bound on the units per (kind, mode, position) that fit in memory (a middle
        stage of the shortest pipeline that can run the schedule: no edges, fewest held)."""
        positions = self.positions
        held = []  # per position: (A, D) pairs of the held states
        for position in range(positions):
            states = self._optimistic_states(position)
            held.append([(t[0], t[1]) for t in states] or [(-1, -1)])
        width = max(len(pairs) for pairs in held)
        pairs = np.array([pairs + [pairs[0]] * (width - len(pairs)) for pairs in held], float)
        active, deferred = pairs[:, :, 0], pairs[:, :, 1]  # position x pair
        costs = [kind.costs for kind in self.kinds]
        act = np.array([c.layer_activation for c in costs])[:, :, None, None]  # kind x mode
        keep = np.array([c.layer_weight_inputs for c in costs])[:, None, None, None]
        static = np.array([c.layer_static for c in costs])[:, None, None]
        room = np.array([c.capacity - c.working for c in costs])[:, None, None]
        held_bytes = (active * act + deferred * keep).max(axis=3)  # kind x mode x position
        caps = _most_units(room, self.chunks * static + held_bytes)
        return np.where(active[None, None, :, 0] < 0, 0.0, caps)

    def _prepare(self) -> None:
        positions, layers, v = self.positions, self.layers, self.chunks
        # max-term work per unit (w), and fill per unit (f) for the fastest mode
        self.unit = np.array(
            [[k.costs.layer_time(r) for r in range(len(MODES))] for k in self.kinds]
        )
        weight = np.array([k.costs.layer_weight_grad for k in self.kinds])
        share = 2.0 if self.schedule == "zero-bubble" else 0.0  # (1 + b) <= 2: a lower bound
        self.fill_unit = self.unit[:, 0] - share * weight
        # zero-bubble's tail (1 + b) G_k of the slowest stage k is at least this share of W_k
        self.tail_share = 0.0
        if self.schedule == "zero-bubble":
            ratios = [weight / self.unit[:, -1]]  # per-layer weight share, slowest mode
            for part in ("head", "embedding"):
                time = np.array(
                    [
                        getattr(k.costs, f"{part}_forward") + getattr(k.costs, f"{part}_backward")
                        for k in self.kinds
                    ]
                )
                grad = np.array([getattr(k.costs, f"{part}_weight_grad") for k in self.kinds])
                ratios.append(np.where(time > 0, grad / np.maximum(time, 1e-300), 1.0))
            beta = zero_bubble_share(max(self.positions, 2), self.micro_batches)
            self.tail_share = (1.0 + beta) * float(np.concatenate(ratios).min())
        self.mem_caps = self._memory_caps()  # kind x mode x position
        scale = 1.0 / v if self.schedule == "interleaved" else 1.0
        head_weight = np.array([k.costs.head_weight_grad for k in self.kinds])
        emb_weight = np.array([k.costs.embedding_weight_grad for k in self.kinds])
        head = np.array([k.costs.edge_time(False, True) for k in self.kinds])
        emb = np.array([k.costs.edge_time(True, False) for k in self.kinds])
        self.head_time = (head - share * head_weight) * scale  # the edges' fill
        self.embedding_time = (emb - share * emb_weight) * scale
        self.embedding_min = float(self.embedding_time.min())
        self.sync_one = np.array([k.costs.dp_sync(v, False, False) for k in self.kinds])
        slope = np.array([v * k.costs.layer_params * k.costs.sync_per_param for k in self.kinds])
        with np.errstate(divide="ignore"):
            self.sync_inverse = np.where(slope > 0, 1.0 / np.maximum(slope, 1e-300), INF)
        stages = np.array([k.max_stages for k in self.kinds], dtype=np.float64)
        self.type_sync_inverse = {
            t: float(max(stages[i] * self.sync_inverse[i] for i in self.kinds_of[t]))
            for t in self.types
        }
        full = [
            k.costs.edge_time(True, True) * scale + layers * k.costs.layer_time(2)
            for k in self.kinds
        ]
        self.w_max = max(full) * (1 + 1e-9)
        self.w_floor = self._root_w() if positions else self.w_max

    def capacity(self, probes: np.ndarray) -> np.ndarray:
        """Upper bound on layers per (kind, probe, position) with stage work at most the probe."""
        timed = np.floor(probes[None, :, None] / self.unit[:, None, :])  # kind x probe x mode
        caps = np.minimum(timed[:, :, :, None], self.mem_caps[:, None, :, :]).max(axis=2)
        return np.clip(caps, 0, self.layers)

    def _type_best(self, caps: np.ndarray) -> np.ndarray:
        """Per type, probe and start position: most layers its best kind can add from there."""
        positions = self.positions
        starts = np.arange(positions + 1)
        result = np.zeros((len(self.types), caps.shape[1], positions + 1))
        for t_index, chip in enumerate(self.types):
            for kind in self.kinds_of[chip]:
                prefix = np.concatenate(
                    (np.zeros((caps.shape[1], 1)), caps[kind].cumsum(axis=1)), axis=1
                )
                ends = np.minimum(starts + self.kinds[kind].max_stages, positions)
                np.maximum(
                    result[t_index], prefix[:, ends] - prefix[:, starts], out=result[t_index]
                )
        return result

    def _root_w(self) -> float:
        """Largest work bound at which even the most optimistic pipeline cannot hold all layers
        (to 0.01%; below the true one, so still a bound), by rounds of 15 probes."""
        low, high = 0.0, self.w_max
        while high - low > 1e-4 * high:
            probes = np.linspace(low, high, 17)[1:-1]
            held = self._type_best(self.capacity(probes))[:, :, 0].sum(axis=0)
            enough = np.flatnonzero(held >= self.layers)
            if len(enough):
                high = float(probes[enough[0]])
                low = float(probes[enough[0] - 1]) if enough[0] else low
            else:
                low = float(probes[-1])
        return low

    def root_bound(self) -> float:
        """Lower bound on the step time of every plan of this batch shape."""
        if not self.positions:
            return INF
        if not self.prepared:
            return self.pre_bound
        w = self.w_floor
        return self.factor * w + max(self.sum_floor(w), self.layers * float(self.fill_unit.min()))

    def sum_floor(self, work: np.ndarray | float) -> np.ndarray | float:
        """What the sum term is at least when the slowest stage works ``work``: that stage's own
        fill (the sum term's share of its work; nothing under zero-bubble, whose tail holds it)."""
        return 0.0 * work if self.schedule == "zero-bubble" else work

    def build_grid(self, w_high: float, points: int, coarse: int = 32) -> None:
        """Probe values from the root bound up to ``w_high`` (geometric) and their prefix sums.

        The exact-order bound on unused chip types (:meth:`rest`) is computed on every
        ``points // coarse``-th probe only and read at the next coarse probe above (capacity grows
        with the probe, so this stays an upper bound).
        """
        top = min(max(w_high, self.w_floor * (1 + 1e-9)), self.w_max)
        self.grid = np.geomspace(max(self.w_floor, 1e-30), top, points)
        self.grid_is_max = top >= self.w_max
        caps = self.capacity(self.grid)
        zeros = np.zeros((caps.shape[0], caps.shape[1], 1))
        self.prefix = np.concatenate((zeros, caps.cumsum(axis=2)), axis=2)  # kind x probe x start
        self._prepare_segments()
        step = max(points // coarse, 1)
        picks = np.unique(np.append(np.arange(step - 1, points, step), points - 1))
        self.coarse_of = np.searchsorted(picks, np.arange(points))  # fine probe -> coarse index
        self.coarse_prefix = self.prefix[:, picks, :]
        self._rest: dict[int, np.ndarray] = {}
        self._placed: dict[tuple[int, int, int, int], np.ndarray] = {}

    def _prepare_segments(self) -> None:
        """Per unused chip type, a convex lower bound on the cost of taking layers from it.

        Its kinds sorted by per-layer time ``u_1 <= u_2 <= ...``: the first ``C_1`` layers cost
        ``u_1`` each, the next ``C_2 - C_1`` cost ``u_2`` (``C_j``: most layers any of the first
        ``j`` kinds can hold in a block starting there), and so on. Taking ``x`` layers from a
        block of one kind costs at least that much, whichever kind it is.
        """
        starts = np.arange(self.positions + 1)
        self.segment_units: dict[int, np.ndarray] = {}
        self.segment_widths: dict[int, np.ndarray] = {}
        for chip in self.types:
            kinds = sorted(self.kinds_of[chip], key=lambda k: self.fill_unit[k])
            running = np.zeros((len(self.grid), self.positions + 1))
            widths = []
            for kind in kinds:
                ends = np.minimum(starts + self.kinds[kind].max_stages, self.positions)
                most = self.prefix[kind][:, ends] - self.prefix[kind][:, starts]
                grown = np.maximum(running, most)
                widths.append(grown - running)
                running = grown
            self.segment_units[chip] = self.fill_unit[kinds]
            self.segment_widths[chip] = np.stack(widths)  # kind x probe x start

    def block(self, kind: int, start: int, ends: np.ndarray) -> np.ndarray:
        """Capacity bound of stages ``start..end-1`` of ``kind``: probe x len(ends)."""
        prefix = self.prefix[kind]
        return prefix[:, ends] - prefix[:, [start]]

    def shortest(self, stages: int) -> int:
        """The fewest stages, at least ``stages``, that can run the schedule (0 if none)."""
        for count in range(max(stages, 1), self.positions + 1):
            if self.closes(count):
                return count
        return 0

    def placed_block(self, kind: int, start: int, count: int, stages: int) -> np.ndarray:
        """Capacity of ``count`` placed stages of ``kind`` from ``start`` stages before the end,
        in a pipeline of at least ``stages`` stages (memory grows with the pipeline's length
        under zero-bubble and interleaved): per probe."""
        shortest = self.shortest(stages)
        if not shortest:
            return np.zeros(len(self.grid))
        key = (kind, start, count, shortest)
        if key not in self._placed:
            self._placed[key] = self._placed_block(kind, start, count, shortest)
        return self._placed[key]

    def _placed_block(self, kind: int, start: int, count: int, shortest: int) -> np.ndarray:
        caps = np.array(
            [
                self._placed_caps(kind, position, shortest)
                for position in range(start, start + count)
            ]
        )
        timed = np.floor(self.grid[:, None, None] / self.unit[kind][None, None, :])
        per_stage = np.minimum(timed, caps[None, :, :]).max(axis=2)  # probe x stage
        return np.clip(per_stage, 0, self.layers).sum(axis=1)

    def _placed_caps(self, kind: int, position: int, stages: int) -> tuple[int, int, int]:
        key = (kind, -1 - position, stages)  # negative: keyed apart from mode_caps' entries
        if key not in self._mode_caps:
            costs, stage = self.kinds[kind].costs, stages - 1 - position
            states = held_totals(self.schedule, stages, self.micro_batches, self.chunks, stage)
            if stage == 0:  # not the first stage: more will be placed in front
                states = tuple((a, d, ha, hd, 0) for a, d, ha, hd, _ in states)
            caps = [
                costs.max_units(self.chunks, mode, states, False, position == 0)
                for mode in range(len(MODES))
            ]
            self._mode_caps[key] = (caps[0], caps[1], caps[2])
        return self._mode_caps[key]

    def closed_block(self, kind: int, stages: int, front: int, count: int) -> np.ndarray:
        """Capacity of stages ``front..front+count-1`` (counted from the front) of ``kind`` in a
        closed pipeline of ``stages`` stages, with their exact memory caps: per probe."""
        caps = np.array([self.mode_caps(kind, stages, i) for i in range(front, front + count)])
        timed = np.floor(self.grid[:, None, None] / self.unit[kind][None, None, :])
        per_stage = np.minimum(timed, caps[None, :, :]).max(axis=2)  # probe x stage
        return np.clip(per_stage, 0, self.layers).sum(axis=1)

    def rest(self, mask: int) -> np.ndarray:
        """Most layers the chip types in ``mask`` can add, in any order, from each start position.

        Exact over orders, TP degrees and stage counts (a max-plus programme over subsets of
        types), per probe: fine probe x start position.
        """
        return self._rest_coarse(mask)[self.coarse_of]

    def _rest_coarse(self, mask: int) -> np.ndarray:
        if mask in self._rest:
            return self._rest[mask]
        positions = self.positions
        starts = np.arange(positions + 1)
        result = np.zeros((self.coarse_prefix.shape[1], positions + 1))
        for t_index, chip in enumerate(self.types):
            if not mask >> t_index & 1:
                continue
            after = self._rest_coarse(mask & ~(1 << t_index))
            for kind in self.kinds_of[chip]:
                most = min(self.kinds[kind].max_stages, positions)
                ends = np.minimum(starts[:, None] + np.arange(1, most + 1)[None, :], positions)
                prefix = self.coarse_prefix[kind]
                value = prefix[:, ends] - prefix[:, starts][:, :, None] + after[:, ends]
                np.maximum(result, value.max(axis=2), out=result)
        self._rest[mask] = result
        return result

    def sync_bound(
        self, blocks: Sequence[tuple[int, np.ndarray | int]], unused: int
    ) -> np.ndarray | float:
        """Lower bound on the slowest DP synchronisation: the known blocks' one-layer syncs, and
        the L layers spread so that the largest sync is smallest over every stage that may exist.
        """
        if not blocks:
            return 0.0
        floor = max(float(self.sync_one[kind]) for kind, _ in blocks)
        inverse: np.ndarray | float = 0.0
        for kind, count in blocks:
            inverse = inverse + np.asarray(count) * self.sync_inverse[kind]
        for t_index, chip in enumerate(self.types):
            if unused >> t_index & 1:
                inverse = inverse + self.type_sync_inverse[chip]
        with np.errstate(divide="ignore", invalid="ignore"):
            spread = np.where(
                np.isfinite(inverse), self.layers / np.asarray(inverse, dtype=np.float64), 0.0
            )
        return np.maximum(spread, floor)

    def bound(
        self,
        fixed: Sequence[tuple[float, np.ndarray, np.ndarray | int]],
        unused: int,
        start: np.ndarray,
        links: np.ndarray | float,
        edges: np.ndarray | float,
        need: np.ndarray | float,
        sync: np.ndarray | float = 0.0,
    ) -> np.ndarray:
        """Lower bound on the step time per option column (see the module docstring).

        ``fixed``: (fastest per-layer fill, capacity probe x options, stages: one number or
        per option) of known blocks, each stage holding at least one layer; ``unused``: mask of
        chip types that may still be placed in front, from positions ``start`` (one per option);
        ``edges``: the embedding's and head's fill; ``need``: the slowest stage works at least
        this long (one layer on the slowest known block); ``sync``: a lower bound on the largest
        end-of-step sync (per option or one number, like ``links``).
        """
        widths, units = [], []
        mandatory_layers: np.ndarray | float = 0.0
        mandatory_cost: np.ndarray | float = 0.0
        short: np.ndarray | bool = False
        for unit, caps, count in fixed:
            mandatory_layers = mandatory_layers + count
            mandatory_cost = mandatory_cost + unit * count
            short = short | (caps < np.asarray(count) - 1e-9)
            widths.append(np.maximum(caps - count, 0.0))
            units.append(unit)
        rest_units, rest_widths = [], []
        for t_index, chip in enumerate(self.types):
            if unused >> t_index & 1:
                rest_units.append(self.segment_units[chip])
                rest_widths.append(self.segment_widths[chip][:, :, start])
        if rest_units:
            r_units = np.concatenate(rest_units)
            order = np.argsort(r_units, kind="stable")
            r_widths = np.concatenate(rest_widths)[order]
            cumulative = np.minimum(r_widths.cumsum(axis=0), self.rest(unused)[:, start][None])
            r_widths = np.diff(cumulative, axis=0, prepend=0.0)
            units.extend(r_units[order])
            widths.extend(r_widths)
        shape = np.broadcast_shapes(*(w.shape for w in widths))
        units_arr = np.asarray(units)
        order = np.argsort(units_arr, kind="stable")
        stacked = np.stack([np.broadcast_to(widths[i], shape) for i in order])
        remaining = self.layers - np.asarray(mandatory_layers, dtype=np.float64)
        before = stacked.cumsum(axis=0) - stacked
        take = np.clip(remaining - before, 0.0, stacked)
        fill = np.tensordot(units_arr[order], take, axes=1) + mandatory_cost + edges
        covered = take.sum(axis=0)
        grid, factor = self.grid[:, None], self.factor
        low = np.maximum(grid[:-1], need)
        sync = np.asarray(sync, dtype=np.float64)
        if self.schedule == "zero-bubble":  # the slowest stage's fill + tail is its whole work
            tail = np.maximum(sync, self.tail_share * low)
            terms = factor * low + np.maximum(fill[1:] + tail, low)
        else:
            terms = factor * low + np.maximum(fill[1:], low) + sync
        ok = (covered >= remaining - 1e-9) & ~np.asarray(short)
        first = np.where(ok.any(axis=0), ok.argmax(axis=0), len(self.grid))
        rows = np.arange(len(self.grid) - 1)[:, None]
        admissible = (rows >= np.maximum(first - 1, 0)[None, :]) & (grid[1:] >= need)
        best = np.where(admissible, terms, INF).min(axis=0)
        if not self.grid_is_max:  # W above the top probe: already worse than the K-th best
            top = np.maximum(self.grid[-1], need)
            if self.schedule == "zero-bubble":
                beyond = factor * top + np.maximum(sync, top)
            else:
                beyond = factor * top + top + sync
            best = np.minimum(best, beyond)
        return best + links


def _most_units(room: float, per: np.ndarray) -> np.ndarray:
    """Most whole units of ``per`` bytes within ``room`` bytes (exact despite rounding)."""
    units = np.maximum(np.floor(room / per), 0.0)
    units = np.where(units * per > room, np.maximum(units - 1, 0.0), units)
    return np.where((units + 1) * per <= room, units + 1, units)
