"""Two-stage plan search (HeteroAuto): structure by branch and bound, layer split exactly.

Stage one chooses the *structure* of the pipeline: the micro-batch size ``b``, DP degree ``d``
and pipeline schedule (``1f1b``, ``zero-bubble``, or ``interleaved`` with ``V`` model chunks per
stage) (a "batch shape"), which chip types are used, in which order along the pipeline, and for
each used chip type its TP degree and number of stages. Stage two (:mod:`.partition`) finds the
exact best layer split of a structure (equal chunks on every stage under ``interleaved``), with
each stage's recompute mode the fastest that fits.

Stage one is a branch and bound over pipeline *suffixes*: starting from the last stage (which
holds the head and keeps one micro-batch in flight), blocks of stages of one chip type are
prepended until the pipeline is closed. A suffix fixes its stages' positions counted from the
end, hence their in-flight micro-batches and memory caps, which keeps its bound tight
(:mod:`.bounds` explains the bound). Short depth-first dives into the most promising batch shapes
find good plans first; then suffixes of all batch shapes are expanded best bound first. An option
whose bound is not below the K-th best step time found so far is pruned, and so is a batch shape
whose root bound is not. Nothing else is pruned, so unless the time limit stops it the search is
exhaustive over the plan space (the tests check it against brute-force enumeration); at the time
limit, the lowest bound left is a proven lower bound on the optimum.

Plans with one DP degree are searched first; then the re-splits of the best one-DP plans into
plans where chip types have their own DP degrees (:meth:`_Search._derive`, any TP degree per
type: good own-DP plans early), then, under :attr:`SearchOptions.own_dp` ``all`` (the default),
every own-DP batch shape together with what the one-DP search left, best bound first. A one-DP
search that has not finished when all but :attr:`SearchOptions.own_dp_share` of the time limit
is used pauses for the re-splits and then goes on. The proven bound always covers the whole space
:meth:`SearchOptions.space_text` names (under ``derived`` the own-DP shapes are bounded by their
roots; under ``none`` the space has one DP degree).
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Any

import numpy as np

from megatron_h2.errors import ConfigError
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.cost_model import CostModel
from megatron_h2.planner.dives import dive_grids, dive_order
from megatron_h2.planner.improve import Polish
from megatron_h2.planner.last_floor import option_floors
from megatron_h2.planner.merged_shape import MergedShape
from megatron_h2.planner.option_columns import ChipColumns, block_links, chip_columns
from megatron_h2.planner.partition import INF
from megatron_h2.planner.search_options import (
    OWN_DP_SPACES,
    Candidate,
    SearchOptions,
    SearchResult,
    SearchStats,
)
from megatron_h2.planner.structure import (
    Found,
    Suffix,
    mixed_layers,
    nothing_fits,
    solve_structure,
    to_plan,
)
from megatron_h2.planner.suffixes import Entry, Left, Node, closed_bounds, root_node, suffix_need
from megatron_h2.planner.zero_bubble_fill import share_rise

__all__ = ["OWN_DP_SPACES", "Candidate", "SearchOptions", "SearchResult", "SearchStats", "search"]

_SLACK = 1e-9  # relative tolerance when comparing a bound with the K-th best


class _Search:
    """One run of the branch and bound (state lives here, not at module level)."""

    def __init__(self, cost: CostModel, options: SearchOptions) -> None:
        self.cost, self.options = cost, options
        self.stats = SearchStats()
        self.best: list[tuple[float, int, Found]] = []  # max-heap by value via negation
        self.counter = itertools.count()
        self.deadline = time.monotonic() + options.time_limit_s
        self.node_limit = options.max_prefixes if options.max_prefixes is not None else INF
        self.evaluated: set[tuple[int, str, int, tuple[tuple[int, ...], ...]]] = set()
        # MoE: kinds that differ only in their EP degree merged for the structure search
        self.make = MergedShape if options.merge_ep and cost.model.is_moe else BatchShape
        self.polish = Polish(self._evaluate, self._late, lambda: self.threshold * (1 - _SLACK))

    @property
    def threshold(self) -> float:
        """Step time to beat: the K-th best so far (until K plans are found, the cutoff: inf
        unless :attr:`SearchOptions.cutoff_s` is given)."""
        if len(self.best) < self.options.top_k:
            return self.options.cutoff_s
        return min(-self.best[0][0], self.options.cutoff_s)

    @property
    def _cell_share(self) -> float:
        """Share of :data:`~.sync_cells.CELLS` a root's refinement spends: all at a minute's
        limit or more, less at shorter ones (the quick members' proofs are a few seconds)."""
        return min(1.0, self.options.time_limit_s / 60.0)

    def _best_value(self) -> float:
        """The best step time found so far (inf before the first plan)."""
        return min((-item[0] for item in self.best), default=INF)

    def _late(self) -> bool:
        """Past the time limit (or :attr:`SearchOptions.max_prefixes`)."""
        return time.monotonic() > self.deadline or self.stats.nodes >= self.node_limit

    def _abandon(self, bound: float) -> None:
        self.stats.exhaustive = False
        self.stats.lower_bound_s = min(self.stats.lower_bound_s, bound)

    def _shapes(self, own: bool) -> list[BatchShape]:
        """Every (micro-batch size, schedule, V, DP) shape with some stage kind: with ``own``
        False one per uniform DP degree, else for 1F1B and zero-bubble the one where every chip
        type has its own (the interleaved search keeps one DP degree). The zero-bubble and
        interleaved shapes are lazy: the 1F1B shape of the same micro-batch size and DP degrees
        bounds them (:meth:`BatchShape.cheap_bound`) until they are needed."""
        shapes = []
        largest = max(c.count for c in self.cost.cluster.chips)
        variants = self.options.schedule_variants(self.cost.model.num_layers)
        if own or mixed_layers(self.cost):  # mixed layers: one chunk per stage (structure.py)
            variants = [v for v in variants if v[0] != "interleaved"]
        gbs = self.options.global_batch_size
        for mbs in self.options.micro_batch_candidates():
            per_dp = gbs // mbs
            degrees: list[int | None] = (
                [None]
                if own
                else [d for d in range(1, min(per_dp, largest) + 1) if per_dp % d == 0]
            )
            plain = {  # the 1F1B shapes, one per DP key
                dp: self.make(self.cost, gbs, mbs, "1f1b", 1, dp)
                for dp in degrees
                if ("1f1b", 1) in variants
            }
            for schedule, chunks in variants:
                for dp in degrees:
                    if (schedule, chunks) == ("1f1b", 1):
                        shape, floor = plain[dp], None
                    else:
                        shape = self.make(self.cost, gbs, mbs, schedule, chunks, dp, lazy=True)
                        floor = plain[dp].w_floor if dp in plain and plain[dp].kinds else None
                    if not shape.kinds:
                        continue
                    if floor is not None and floor < INF:
                        shape.pre_bound = shape.cheap_bound(floor)
                    elif floor is not None:
                        shape.pre_bound = INF  # no plan of the 1F1B shape fits either
                    else:
                        shape.prepare()
                    shapes.append(shape)
        self.polish.register(shapes)
        return shapes

    def run(self) -> list[Found]:
        """Uniform-DP shapes first, until all but :attr:`SearchOptions.own_dp_share` of the
        time limit is used (their plans set the threshold), then the re-splits of the best
        one-DP plans (:meth:`_derive`, good own-DP plans early), then in the time left the rest:
        under ``own_dp="all"`` every own-DP shape and what the one-DP search left, best bound
        first; under ``derived`` what the one-DP search left, the own-DP shapes bounded by their
        roots only (plans with one DP degree in an own-DP shape are left to the uniform
        shapes)."""
        shapes = self._shapes(own=False)
        self.stats.batch_shapes = len(shapes)
        if len(self.cost.cluster.chips) < 2 or self.options.own_dp == "none":
            self._stop(self._run_shapes(shapes))
            return sorted((item[2] for item in self.best), key=lambda f: f.value)
        deadline, limit = self.deadline, self.node_limit  # pause: a share left to own DP
        self.deadline -= self.options.own_dp_share * self.options.time_limit_s
        self.node_limit = int(limit * (1 - self.options.own_dp_share)) if limit < INF else INF
        paused = self._run_shapes(shapes)
        self.deadline, self.node_limit = deadline, limit
        self.stats.own_dp = self.options.own_dp
        self._derive()
        own = self._shapes(own=True)
        self.stats.batch_shapes += len(own)
        self.stats.one_dp_resumed = bool(paused.shapes or paused.roots or paused.queue)
        if self.options.own_dp == "all":
            left = self._refine(paused.shapes + own, paused.roots, paused.queue)
        else:
            left = self._refine(paused.shapes, paused.roots, paused.queue)
            self._bound_only(own)
        self._stop(left)
        return sorted((item[2] for item in self.best), key=lambda f: f.value)

    def _bound_only(self, shapes: list[BatchShape]) -> None:
        """Bound ``shapes`` by their roots without searching them: a root bound below the K-th
        best lowers the proven bound of the space (the search itself stays exhaustive)."""
        for shape in shapes:
            shape.prepare()
            if shape.root_bound() >= self.threshold * (1 - _SLACK):
                self.stats.batch_shapes_pruned += 1
            else:
                self.stats.lower_bound_s = min(self.stats.lower_bound_s, shape.root_bound())

    def _stop(self, left: Left) -> None:
        """Give up what the time limit left: the lowest bound of the suffixes not expanded and
        of the shapes bounded by their roots' children, and each shape not reached yet (or its
        pruning), bound the plans there from below. Those shapes go lowest root bound first,
        and only while that is below the lowest bound so far are they bounded by their roots'
        children (a shape whose root bound is not below it cannot lower it)."""
        for bound, _ in left.roots:
            self._abandon(bound)
        if left.queue:
            self._abandon(left.queue[0][0])
        for root, shape in sorted(((s.root_bound(), s) for s in left.shapes),
                                  key=lambda pair: pair[0]):
            if root >= self.threshold * (1 - _SLACK):
                self.stats.batch_shapes_pruned += 1
            elif root >= self.stats.lower_bound_s:  # the same proven bound
                self._abandon(root)
            else:
                self._bound_by_children(shape)

    def _bound_by_children(self, shape: BatchShape) -> None:
        """Bound a shape not reached by its prepared root and its root's children."""
        shape.prepare()  # its tables' bound, not the cheap one (a small cost)
        if shape.root_bound() < self.threshold * (1 - _SLACK):
            shape.tighten()
        bound = shape.root_bound()
        if bound < self.threshold * (1 - _SLACK):  # its root's children: tighter, cheap
            shape.build_grid(min(self.threshold, shape.w_max), self.options.grid_points)
            options = self._options(shape, root_node(shape))
            bound = max(bound, options[0][0] if options else INF)
        if bound >= self.threshold * (1 - _SLACK):
            self.stats.batch_shapes_pruned += 1
        else:
            self._abandon(bound)

    def _derive(self) -> None:
        """Own-DP re-splits of the K best one-DP plans found, best first over all of them: for
        each 1F1B or zero-bubble one of two or more chip types, its micro-batch size, schedule
        and chip types, every order of those types, each type with any TP degree and its own DP
        degree such that it has half, equal to or twice its number of stages there, using all
        its chips (:meth:`_near`; one batch shape of just those kinds, so that unused types bound
        only what they can add). The re-splits that keep each type's TP degree are searched
        first (fewer kinds: good plans sooner), then all. A heuristic: good own-DP plans early,
        which set the threshold that the own-DP shapes are then searched or bounded against."""
        seeds: dict[tuple[int, str, tuple[tuple[int, int, int], ...]], None] = {}
        for _, _, found in sorted(self.best, key=lambda item: -item[0]):
            types = tuple(
                sorted((found.kinds[k].chip, found.kinds[k].tp, found.kinds[k].dp)
                       for k, _ in found.blocks)
            )  # fmt: skip
            if len(types) > 1 and found.schedule != "interleaved":
                seeds.setdefault((found.micro_batch_size, found.schedule, types), None)
        gbs = self.options.global_batch_size
        self.stats.own_dp_seeds = len(seeds)
        for change_tp in (False, True):  # each type's TP kept first: fewer kinds, sooner found
            roots: list[tuple[float, BatchShape]] = []
            for mbs, schedule, types in seeds:
                if self._late():
                    break  # the own-DP shapes bound what is left
                near = self._near(types, change_tp)
                shape = self.make(self.cost, gbs, mbs, schedule, 1, None, only=near)
                self.stats.batch_shapes += 1
                if len(shape.types) < len(types) or shape.root_bound() >= self.threshold:
                    continue  # some type cannot use all its chips so, or no win
                roots.append((shape.root_bound(), shape))
            if self._best_first(roots, use_all=True):  # the own-DP shapes bound what is left
                self.stats.exhaustive = False
                return

    def _near(
        self, types: tuple[tuple[int, int, int], ...], change_tp: bool = True
    ) -> frozenset[tuple[int, int, int]]:
        """The (chip, TP, DP) kinds of a re-split of the one-DP plan whose types are ``types``
        (chip, TP, DP): each type any TP degree it can run (with ``change_tp``, else its TP
        there) and the DP degree that gives it half, equal to or twice its number of stages
        there (``stages = chips / (TP x DP)``)."""
        model, near = self.cost.model, set()
        for chip, tp, d in types:
            options = self.cost.cluster.chips[chip].tensor_parallel_options(
                model.num_attention_heads, model.num_query_groups
            )
            options = options if change_tp else [tp]
            for other in options:
                for factor in (0.5, 1, 2):
                    degree = d * tp * factor / other
                    if degree == int(degree) and degree >= 1:
                        near.add((chip, other, int(degree)))
        return frozenset(near)

    def _run_shapes(self, shapes: list[BatchShape]) -> Left:
        """Search ``shapes``: dives (:meth:`_dive`), then :meth:`_refine`; what the limit left."""
        self._dive(shapes)
        shapes.sort(key=lambda s: s.root_bound())
        return self._refine(shapes, [], [])

    def _dive(self, shapes: list[BatchShape]) -> None:
        """Short dives into ``shapes`` (:func:`~.dives.dive_order`) until ``dive_stale`` shapes
        in a row found no better plan; one that found none below the step to beat (the best so
        far, or the cutoff before any) climbs from its leaves (:meth:`Polish.from_dive`). Under
        a minute's limit, no dive into a shape whose sharpened root cannot win (at a minute or
        more, every dive's leaves may seed such a climb)."""
        sharpen = (None if self._cell_share >= 1 else
                   lambda s: s.sharpen(self.threshold * (1 - _SLACK), self._cell_share))
        dives = dive_order(shapes, lambda: self.threshold * (1 - _SLACK), self._late, sharpen)
        stale = 0  # short dives, good incumbents early, until so many shapes in a row fail
        for shape in itertools.islice(dives, self.options.dive_shapes):
            before, leaves = self._best_value(), []
            for top in dive_grids(shape, self._best_value):
                shape.build_grid(top, 64)
                self._explore(shape, root_node(shape), self.options.dive_nodes, leaves)
            beat = min(before, self.threshold)
            if self._best_value() >= before and self.options.polish and beat < INF:
                self.polish.from_dive(shape, leaves, beat)
            stale = 0 if self._best_value() < before else stale + 1
            if stale >= self.options.dive_stale:
                break

    def _refine(self, shapes: list[BatchShape], refined: list[tuple[float, BatchShape]],
                queue: list[Entry]) -> Left:
        """Bound ``shapes`` by their roots' children, then search those that may still win best
        first (adding ``refined``, shapes bounded so, and ``queue``, suffixes left by an earlier
        call): at the time limit, what is left (:meth:`_stop` gives it up)."""  # fmt: skip
        for index, shape in enumerate(shapes):
            if shape.root_bound() >= self.threshold * (1 - _SLACK):
                self.stats.batch_shapes_pruned += 1
                continue
            if self._late():
                return Left(shapes[index:], refined, queue)
            shape.sharpen(self.threshold * (1 - _SLACK), self._cell_share)
            if shape.root_bound() >= self.threshold * (1 - _SLACK):
                self.stats.batch_shapes_pruned += 1
                continue
            self._prepare_shape(shape)
            options = self._options(shape, root_node(shape))
            bound = options[0][0] if options else INF
            if bound >= self.threshold * (1 - _SLACK):
                self.stats.batch_shapes_pruned += 1
            else:
                refined.append((bound, shape))
        return Left([], [], self._best_first(refined, queue=queue))

    def _best_first(
        self,
        roots: list[tuple[float, BatchShape]],
        use_all: bool = False,
        queue: list[Entry] | None = None,
    ) -> list[Entry]:
        """Expand pipeline suffixes of all batch shapes in order of their bounds (with
        ``use_all`` closing a pipeline only once it uses every chip type of its shape), from
        ``roots`` and the ``queue`` an earlier call left.

        The search is over when the lowest bound left cannot beat the K-th best plan (then it is
        exhaustive; this returns []) or at the time limit: this returns the queue left, whose
        lowest bound (first) is then the proven lower bound unless a later call goes on.
        """
        queue = list(queue or [])
        for bound, shape in roots:
            self._prepare_shape(shape)
            queue.append((bound, next(self.counter), shape, 0, 0, root_node(shape)))
        heapq.heapify(queue)
        while queue:
            if queue[0][0] >= self.threshold * (1 - _SLACK):
                self.stats.nodes_pruned += len(queue)
                return []
            if self._late():
                return queue
            _, _, shape, kind, count, node = heapq.heappop(queue)
            if kind == -1 and isinstance(shape, MergedShape):  # each EP choice, exactly bounded
                for option, suffix in self._exact_leaves(shape, node):
                    leaf = Node(suffix, (), node.position, 0, node.links, node.lead)
                    heapq.heappush(queue, (option, next(self.counter), shape.exact, -2, 0, leaf))
                continue
            if kind < 0:
                self._evaluate(shape, node.suffix)
                continue
            if count:  # a child: prepend its block
                links = self._block_links(shape, node, kind, count)
                node = node.child(shape, kind, count, links)
            self.stats.nodes += 1
            for option, child, stages in self._options(shape, node, use_all):
                if option >= self.threshold * (1 - _SLACK):
                    self.stats.nodes_pruned += 1
                    continue
                heapq.heappush(queue, (option, next(self.counter), shape, child, stages, node))
        return []

    def _prepare_shape(self, shape: BatchShape) -> None:
        """Build the probe grid up to what could still beat the K-th best (a dive finds one)."""
        if self.threshold == INF:  # a short dive first, so that the probe grid can be narrow
            shape.build_grid(shape.w_max, 64)
            self._explore(shape, root_node(shape), budget=self.options.dive_nodes)
        shape.build_grid(
            self.threshold if self.threshold < INF else shape.w_max, self.options.grid_points
        )

    def _explore(self, shape: BatchShape, node: Node, budget: int,
                 leaves: list[Suffix] | None = None) -> int:
        """Depth-first dive below a suffix, best option first, visiting at most ``budget`` nodes
        (the closed pipelines it solves appended to ``leaves``)."""
        self.stats.nodes += 1
        visited = 1
        for bound, kind, count in self._options(shape, node, dive=True):
            if bound >= self.threshold * (1 - _SLACK):
                continue
            if visited >= budget or self._late():
                break
            if kind < 0 and isinstance(shape, MergedShape):  # each EP choice counts as a node
                for option, suffix in self._exact_leaves(shape, node):
                    if visited >= budget or self._late():
                        break
                    if option < self.threshold * (1 - _SLACK):
                        self._evaluate(shape.exact, suffix)
                        visited += 1
                continue
            if kind < 0:
                self._evaluate(shape, node.suffix)
                if leaves is not None:
                    leaves.append(node.suffix)
                continue
            links = self._block_links(shape, node, kind, count)
            child = node.child(shape, kind, count, links)
            visited += self._explore(shape, child, budget - visited, leaves)
        return visited

    def _exact_leaves(self, shape: MergedShape, node: Node) -> list[tuple[float, Suffix]]:
        """The closed merged pipeline ``node`` as every choice of EP degree per block
        (:meth:`MergedShape.exact_suffixes`), each with its exact closed bound, those that may
        beat the K-th best, best first."""
        exact, cutoff = shape.exact_view(), self.threshold * (1 - _SLACK)
        suffixes = [s for s in shape.exact_suffixes(node.suffix) if not self._done(exact, s)]
        if not suffixes:
            return []
        bounds = closed_bounds(exact, suffixes, node.lead, node.links).tolist()
        out = sorted((b, s) for b, s in zip(bounds, suffixes) if b < cutoff)
        self.stats.nodes_pruned += len(suffixes) - len(out)
        return out

    def _fixed(self, shape: BatchShape, node: Node) -> list[tuple[float, np.ndarray, Any]]:
        """The suffix's blocks for :meth:`BatchShape.bound` (under zero-bubble and interleaved
        with the caps of a pipeline at least one stage longer)."""
        fixed = [(u, caps[:, None], count) for u, caps, count in node.groups]
        if shape.schedule != "1f1b" and node.suffix:  # held memory grows with the length
            warmups = shape.warmups(node.suffix)
            fixed, start, position = [], 0, node.position
            for (kind, count), (unit, _, _) in zip(reversed(node.suffix), node.groups):
                first = warmups[position - start - 1]  # the block's last stage
                caps = shape.placed_block(kind, first, start, count, position + 1)
                fixed.append((unit, caps[:, None], count))
                start += count
        return fixed

    def _options(
        self, shape: BatchShape, node: Node, use_all: bool = False, dive: bool = False
    ) -> list[tuple[float, int, int]]:
        """The close-here leaf (kind -1) and every child (kind, stage count), with bounds (one
        :meth:`_bounds` call per chip type), best first; with ``use_all`` the leaf only once every
        chip type of the shape is used. A ``dive`` only orders and skips, so it leaves out the
        per-type new stages (:mod:`.stage_links`: their cost buys a proven bound, not a plan)."""
        suffix, groups, position, mask = node.suffix, node.groups, node.position, node.mask
        options: list[tuple[float, int, int]] = []
        need = _need(shape, node)
        if suffix and shape.closes(position) and not (use_all and mask):
            edges = float(shape.head_time[suffix[-1][0]] + shape.embedding_time[suffix[0][0]])
            edges = edges + share_rise(shape, position)  # probe x 1
            sync = shape.sync_bound(suffix, 0, suffix[-1][0], suffix[0][0])
            placed = [(u, caps[:, None], count) for u, caps, count in groups]
            here = np.array([node.lead])
            first = max(need, float(shape.embedding_need[suffix[0][0]]))  # with the embedding
            rates = shape.block_rates(suffix)
            cutoff = self.threshold * (1 - _SLACK)
            leaf = float(shape.bound(placed, 0, here, node.links, edges, first, sync, rates,
                                     cutoff)[0])
            if leaf < cutoff and not isinstance(shape, MergedShape):
                # tighter: the exact memory caps (merged kinds: per EP choice when expanded)
                leaf = float(closed_bounds(shape, [suffix], node.lead, node.links)[0])
            options.append((leaf, -1, 0))
        room, fixed = shape.positions - position, None
        for t_index, chip in enumerate(shape.types):  # one bound call per chip type
            if not mask >> t_index & 1:
                continue
            columns = chip_columns(shape, chip, node.lead, room)
            if columns is not None:
                if fixed is None:  # the suffix's blocks, only where a child may follow
                    fixed = self._fixed(shape, node)
                options += self._bounds(shape, node, fixed, need, columns, not dive)
        options = option_floors(shape, node, options, self.threshold * (1 - _SLACK),
                                lambda k, c: self._block_links(shape, node, k, c))
        options.sort(key=lambda item: (item[0], -item[2]))
        return options

    def _bounds(
        self,
        shape: BatchShape,
        node: Node,
        fixed: list[tuple[float, np.ndarray, Any]],
        need: float,
        chip: ChipColumns,
        new_stages: bool = True,
    ) -> list[tuple[float, int, int]]:
        """Bounds of prepending each (kind, stage count) of ``chip``'s columns (kinds of one chip
        type, each with its counts) in front of ``node``, in one bound call (``new_stages``:
        :meth:`BatchShape.bound`'s)."""
        columns = chip.columns
        others = node.mask & ~(1 << shape.types.index(shape.kinds[columns[0][0]].chip))
        needs, edges, links, syncs = chip.terms(shape, node, need, others)
        bounds = shape.bound(
            list(fixed) + chip.parts, others, chip.leads, links, edges + chip.rise, needs, syncs,
            shape.block_rates(node.suffix) + chip.rates, self.threshold * (1 - _SLACK),
            _fronts(shape, chip.closing, others), new_stages=new_stages,
        )  # fmt: skip
        return list(zip(bounds.tolist(), chip.kind_list, chip.count_list))

    def _block_links(self, shape: BatchShape, node: Node, kind: int, count: Any) -> Any:
        """Link time in the step formula added by prepending ``count`` stages of ``kind``."""
        name = shape.kinds[kind].name
        front = node.suffix[0][0] if node.suffix else None
        return block_links(shape, front, kind, (count - 1) * shape.link(name, name))

    @staticmethod
    def _key(shape: BatchShape, suffix: Suffix) -> tuple[Any, ...]:
        """A closed pipeline's identity, the same in every batch shape that holds it."""
        kinds = shape.kinds
        blocks = tuple((kinds[k].chip, kinds[k].tp, kinds[k].dp, kinds[k].ep, n)
                       for k, n in suffix)
        return (shape.mbs, shape.schedule, shape.chunks, blocks)

    def _done(self, shape: BatchShape, suffix: Suffix) -> bool:
        """Whether the closed pipeline is solved already or left to a uniform shape (its stages
        have one DP degree after all: the uniform shape of that degree has it)."""
        if not shape.uniform and len({shape.kinds[kind].dp for kind, _ in suffix}) == 1:
            return True
        return self._key(shape, suffix) in self.evaluated

    def _evaluate(self, shape: BatchShape, suffix: Suffix) -> float | None:
        """Stage two for a closed pipeline (``suffix`` is in pipeline order from the front):
        its step time, or None if solved already or not below the K-th best. A new best plan
        is climbed from (:class:`~megatron_h2.planner.improve.Polish`)."""
        if self._done(shape, suffix):
            return None
        self.evaluated.add(self._key(shape, suffix))
        self.stats.splits_solved += 1
        split = solve_structure(shape, suffix, cutoff=self.threshold)
        if split is None:
            return None
        found = Found(
            split.step_time_s, shape.mbs, shape.schedule, shape.chunks, suffix, split, shape.kinds
        )
        best = self._best_value()
        heapq.heappush(self.best, (-found.value, next(self.counter), found))
        if len(self.best) > self.options.top_k:
            heapq.heappop(self.best)
        if found.value < best and self.options.polish:
            self.polish.improve(shape, suffix, found.value)
        return found.value


def _fronts(
    shape: BatchShape, closing: np.ndarray, others: int
) -> tuple[np.ndarray, float, float] | None:
    """For :meth:`BatchShape.bound`: ``closing`` (per option the end-of-step floor of its
    block's front stage with the embedding, if the pipeline closes there), and the least floor
    and the least link of a stage of the unused types ``others`` (if one goes in front); None
    if none."""
    unused = [t for i, t in enumerate(shape.types) if others >> i & 1]
    if not unused:
        return None
    opening = min(shape.type_embedding_tail[t] for t in unused)
    return closing, opening, min(shape.type_link[t] for t in unused)


def _need(shape: BatchShape, node: Node | Suffix) -> float:
    """The least folded steady term below ``node`` (or of a suffix): :func:`suffix_need`."""
    return suffix_need(shape, node if isinstance(node, tuple) else node.suffix)


def search(cost: CostModel, options: SearchOptions) -> SearchResult:
    """Find the ``options.top_k`` fastest plans that fit in memory (best first); ConfigError
    when no plan fits at all."""
    started = time.monotonic()
    runner = _Search(cost, options)
    found = runner.run()
    stats = runner.stats
    stats.elapsed_s = time.monotonic() - started
    stats.space = options.space_text(cost.model.num_layers, len(cost.cluster.chips),
                                     mixed_layers(cost))
    if cost.model.is_moe:
        stats.space += (", each stage kind an expert-parallel degree dividing its DP degree and "
                        "the experts")
    if not found and options.cutoff_s < INF:  # none below the cutoff (proven if exhaustive)
        return SearchResult((), stats)
    if not found and not stats.exhaustive:
        raise ConfigError(
            f"no plan found within the time limit of {options.time_limit_s:g} s (the search"
            " stopped before it reached one); raise the time limit (--time-limit)"
        )
    if not found:
        raise ConfigError(nothing_fits(cost))
    candidates = []
    for item in found:
        plan = to_plan(item, cost, options.global_batch_size)
        candidates.append(Candidate(plan, cost.evaluate(plan)))
    candidates.sort(key=lambda c: c.estimate.step_time_s)
    stats.lower_bound_s = min(stats.lower_bound_s, candidates[0].estimate.step_time_s)
    return SearchResult(tuple(candidates), stats)
