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

from megatron_h2.planner.cost_model import MODES, CostModel, StageCosts
from megatron_h2.planner.partition import INF

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
    """Stage kinds, memory caps, link times and bound tables for one (micro-batch, DP) pair."""

    def __init__(self, cost: CostModel, global_batch_size: int, mbs: int, dp: int) -> None:
        self.cost, self.mbs, self.dp = cost, mbs, dp
        self.layers = cost.model.num_layers
        self.micro_batches = global_batch_size // (mbs * dp)
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
        self.kinds = tuple(kinds)
        self.types = sorted({k.chip for k in kinds})
        self.kinds_of = {t: [i for i, k in enumerate(kinds) if k.chip == t] for t in self.types}
        per_type = [max(kinds[i].max_stages for i in self.kinds_of[t]) for t in self.types]
        self.positions = min(self.layers, sum(per_type)) if kinds else 0  # >= 1 layer per stage
        self._mode_caps: dict[tuple[int, int, bool, bool], tuple[int, int, int]] = {}
        self._links: dict[tuple[str, str], float] = {}
        self.grid = np.zeros(1)
        self.grid_is_max = True
        if kinds:
            self._prepare()

    # ------------------------------------------------------------------------- exact pieces
    def link(self, sender: str, receiver: str) -> float:
        """One-way point-to-point time of one micro-batch between two chip types (cached)."""
        key = (sender, receiver)
        if key not in self._links:
            self._links[key] = self.cost.link_s(sender, receiver, self.mbs)
        return self._links[key]

    def in_flight(self, position: int) -> int:
        """Micro-batches in flight at ``position`` stages from the end (0 = last stage)."""
        return min(position + 1, self.micro_batches)

    def mode_caps(self, kind: int, in_flight: int, first: bool, last: bool) -> tuple[int, int, int]:
        """Most layers that fit per recompute mode for a stage of ``kind`` (cached)."""
        key = (kind, in_flight, first, last)
        if key not in self._mode_caps:
            costs = self.kinds[kind].costs
            caps = [costs.max_layers(mode, in_flight, first, last) for mode in range(len(MODES))]
            self._mode_caps[key] = (caps[0], caps[1], caps[2])
        return self._mode_caps[key]

    # ------------------------------------------------------------------------------- bounds
    def _prepare(self) -> None:
        positions, layers = self.positions, self.layers
        self.unit = np.array(
            [[k.costs.layer_time(r) for r in range(len(MODES))] for k in self.kinds]
        )
        in_flight = np.minimum(np.arange(positions) + 1, self.micro_batches)
        self.mem_caps = np.array(
            [
                [k.costs.max_layers_many(r, in_flight, False, False) for r in range(len(MODES))]
                for k in self.kinds
            ],
            dtype=np.float64,
        )  # kind x mode x position
        self.head_time = np.array([k.costs.edge_time(False, True) for k in self.kinds])
        self.embedding_time = np.array([k.costs.edge_time(True, False) for k in self.kinds])
        self.embedding_min = float(self.embedding_time.min())
        self.sync_one = np.array([k.costs.dp_sync(1, False, False) for k in self.kinds])
        slope = np.array([k.costs.layer_params * k.costs.sync_per_param for k in self.kinds])
        with np.errstate(divide="ignore"):
            self.sync_inverse = np.where(slope > 0, 1.0 / np.maximum(slope, 1e-300), INF)
        stages = np.array([k.max_stages for k in self.kinds], dtype=np.float64)
        self.type_sync_inverse = {
            t: float(max(stages[i] * self.sync_inverse[i] for i in self.kinds_of[t]))
            for t in self.types
        }
        full = [k.costs.edge_time(True, True) + layers * k.costs.layer_time(2) for k in self.kinds]
        self.w_max = max(full) * (1 + 1e-9)
        self.w_floor = self._root_w()

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
        """Largest work bound at which even the most optimistic pipeline cannot hold all layers."""
        low, high = 0.0, self.w_max
        for _ in range(48):
            mid = 0.5 * (low + high)
            if self._type_best(self.capacity(np.array([mid])))[:, 0, 0].sum() >= self.layers:
                high = mid
            else:
                low = mid
            if high - low <= 1e-6 * high:
                break
        return low

    def root_bound(self) -> float:
        """Lower bound on the step time of every plan of this batch shape."""
        w = self.w_floor
        return (self.micro_batches - 1) * w + max(w, self.layers * float(self.unit[:, 0].min()))

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
            kinds = sorted(self.kinds_of[chip], key=lambda k: self.unit[k, 0])
            running = np.zeros((len(self.grid), self.positions + 1))
            widths = []
            for kind in kinds:
                ends = np.minimum(starts + self.kinds[kind].max_stages, self.positions)
                most = self.prefix[kind][:, ends] - self.prefix[kind][:, starts]
                grown = np.maximum(running, most)
                widths.append(grown - running)
                running = grown
            self.segment_units[chip] = self.unit[kinds, 0]
            self.segment_widths[chip] = np.stack(widths)  # kind x probe x start

    def block(self, kind: int, start: int, ends: np.ndarray) -> np.ndarray:
        """Capacity bound of stages ``start..end-1`` of ``kind``: probe x len(ends)."""
        prefix = self.prefix[kind]
        return prefix[:, ends] - prefix[:, [start]]

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
        edges: float,
        need: float,
    ) -> np.ndarray:
        """Lower bound on the step time per option column (see the module docstring).

        ``fixed``: (fastest per-layer time, capacity probe x options, stages) of known blocks,
        each stage holding at least one layer; ``unused``: mask of chip types that may still be
        placed in front, from positions ``start`` (one per option); ``need``: the slowest stage
        works at least this long (one layer on the slowest known block).
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
        grid, factor = self.grid[:, None], self.micro_batches - 1
        low = np.maximum(grid[:-1], need)
        terms = factor * low + np.maximum(fill[1:], low)
        ok = (covered >= remaining - 1e-9) & ~np.asarray(short)
        first = np.where(ok.any(axis=0), ok.argmax(axis=0), len(self.grid))
        rows = np.arange(len(self.grid) - 1)[:, None]
        admissible = (rows >= np.maximum(first - 1, 0)[None, :]) & (grid[1:] >= need)
        best = np.where(admissible, terms, INF).min(axis=0)
        if not self.grid_is_max:  # W above the top probe: already worse than the K-th best
            top = max(float(self.grid[-1]), need)
            best = np.minimum(best, factor * top + top)
        return best + links
