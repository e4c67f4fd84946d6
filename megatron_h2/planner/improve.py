"""Local improvement of the plans the search finds: a better incumbent sooner (:mod:`.search`).

The branch and bound's proven gap is the best plan's step time over the lowest bound left, so
a better plan narrows it twice: directly, and by pruning more (an option is pruned when its
bound is not below the K-th best plan). The short dives find a first plan in each promising
batch shape, but the best plan of a large cluster is often a small change away from the dives'
plans. :class:`Polish` climbs from each new best plan to its best neighbour, as long as one is
faster:

* in its own batch shape: a block one stage longer or shorter, a block at another TP degree (or,
  under own DP degrees, another TP and DP degree) of its chip type, two adjacent blocks swapped,
  a block dropped, under one DP degree two blocks changed at once (one dropped or a stage
  longer or shorter, another a stage longer or shorter: a climb cannot make such moves one at a
  time when each alone is slower), a block of an unused chip type added (in front, behind, or
  between two blocks) or put in a block's place;
* in the neighbouring batch shapes (micro-batch size halved, kept or doubled, DP degree halved,
  kept or doubled, any schedule): the same blocks, each keeping its chips (stages scaled by
  the DP ratio) or its stages.

Each neighbour is a closed pipeline of the plan space, solved exactly by the search's own stage
two (the layer split, :func:`~megatron_h2.planner.structure.solve_structure`) with the K-th best
as cutoff, and counted once (a pipeline solved already is not solved again).

A climb takes a move into a neighbouring batch shape only when the moved plan alone is faster,
so it can end in a shape whose best plan is slower than a neighbouring shape's: on the
100,000-chip 405B family member it ended at a 16.908 s plan under DP 128 while under DP 256 a
climb from the same blocks with about their chips reaches 15.348 s. So where a climb ends,
:meth:`Polish._kick` moves its plan into each neighbouring shape, climbs from the fastest few
of those moved plans within their shapes even though each starts slower, and goes on from the
first end that beats the plan (up to :attr:`Polish.kicks` times). Nothing here
prunes or bounds anything: the search stays exhaustive and its proven bound means what it did;
only the plans it knows, and when it knows them, change.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.structure import Suffix, solve_structure

__all__ = ["Polish", "shape_neighbours"]

ShapeKey = tuple[int, str, int, int | None]  # micro-batch size, schedule, chunks, DP (None: own)
Point = tuple[BatchShape, Suffix, float]  # a plan: its shape, blocks and step time
KICK_REACH = 1.1  # a kick climbs from moved plans at most this much slower than where it starts
Step = Callable[[BatchShape, Suffix, float], float | None]  # a neighbour's step time, or None
Neighbours = Callable[[BatchShape, Suffix], Iterator[tuple[BatchShape, Suffix]]]


def _valid(shape: BatchShape, suffix: Suffix) -> bool:
    """Whether ``suffix`` is a closed pipeline of ``shape``'s space: every block within its
    kind's stages (under own DP exactly its kind's, every chip of its type), each chip type in
    one block, at most one stage per unit and a pipeline the schedule can run."""
    kinds = shape.kinds
    chips = [kinds[k].chip for k, _ in suffix]
    if not suffix or len(set(chips)) < len(chips):
        return False
    for kind, count in suffix:
        most = kinds[kind].max_stages
        if not 1 <= count <= most or (not shape.uniform and count != most):
            return False
    total = sum(count for _, count in suffix)
    return total <= shape.positions and shape.closes(total)


def _counts(shape: BatchShape, kind: int, chips: int) -> list[int]:
    """Stage counts for a block of ``kind`` near ``chips`` chips (under own DP its only one)."""
    k = shape.kinds[kind]
    if not shape.uniform:
        return [k.max_stages]
    per = k.tp * k.dp
    near = {chips // per, -(-chips // per)}
    return sorted({min(max(c, 1), k.max_stages) for c in near})


def _blocks_changed(shape: BatchShape, suffix: Suffix) -> Iterator[Suffix]:
    """Neighbours that change one block: a stage more or fewer, or another kind of its chip
    type with about its chips."""
    kinds = shape.kinds
    for i, (kind, count) in enumerate(suffix):
        head, tail = suffix[:i], suffix[i + 1 :]
        if shape.uniform:
            for other in (count - 1, count + 1):
                yield head + ((kind, other),) + tail
        chips = count * kinds[kind].tp * kinds[kind].dp
        for other in shape.kinds_of[kinds[kind].chip]:
            if other != kind:
                for n in _counts(shape, other, chips):
                    yield head + ((other, n),) + tail


def _blocks_moved(suffix: Suffix) -> Iterator[Suffix]:
    """Neighbours that swap two adjacent blocks or drop one."""
    for i in range(len(suffix) - 1):
        yield suffix[:i] + (suffix[i + 1], suffix[i]) + suffix[i + 2 :]
    if len(suffix) > 1:
        for i in range(len(suffix)):
            yield suffix[:i] + suffix[i + 1 :]


def _blocks_added(shape: BatchShape, suffix: Suffix) -> Iterator[Suffix]:
    """Neighbours that add a block of an unused chip type (every kind, one stage or its most,
    at every place) or put one in a block's place."""
    kinds = shape.kinds
    used = {kinds[k].chip for k, _ in suffix}
    for chip in shape.types:
        if chip in used:
            continue
        for kind in shape.kinds_of[chip]:
            most = kinds[kind].max_stages
            for n in sorted({1, most}) if shape.uniform else [most]:
                for i in range(len(suffix) + 1):
                    yield suffix[:i] + ((kind, n),) + suffix[i:]
                for i in range(len(suffix)):
                    yield suffix[:i] + ((kind, n),) + suffix[i + 1 :]


def _pairs_changed(shape: BatchShape, suffix: Suffix) -> Iterator[Suffix]:
    """Neighbours two moves away (one DP degree only): one block dropped or a stage longer or
    shorter and another block a stage longer or shorter, the moves a climb cannot make one at a
    time when each alone is slower (a block dropped and its layers taken by one more stage of
    another)."""
    if not shape.uniform:
        return
    for i, (kind, count) in enumerate(suffix):
        for first in (0, count - 1, count + 1):
            for j, (other, other_count) in enumerate(suffix):
                if j == i:
                    continue
                for second in (other_count - 1, other_count + 1):
                    blocks = list(suffix)
                    blocks[i], blocks[j] = (kind, first), (other, second)
                    yield tuple(block for block in blocks if block[1])


def shape_neighbours(shape: BatchShape, suffix: Suffix) -> list[Suffix]:
    """The closed pipelines of ``shape`` one change away from ``suffix`` (module docstring),
    each once, without ``suffix`` itself."""
    seen = {suffix}
    out = []
    moves = (_blocks_changed(shape, suffix), _blocks_moved(suffix), _pairs_changed(shape, suffix),
             _blocks_added(shape, suffix))
    for other in itertools.chain(*moves):
        if other not in seen and _valid(shape, other):
            seen.add(other)
            out.append(other)
    return out


class Polish:
    """Hill climbing from each new best plan (:meth:`improve`), over the batch shapes
    :meth:`register` was given. ``evaluate`` solves a closed pipeline exactly and returns its
    step time (None if solved already, or if it cannot beat the K-th best); ``expired`` says
    when the time limit is up; ``threshold`` is the K-th best step time. Where a climb ends,
    up to ``kicks`` times a climb from its plan moved into the neighbouring shapes
    (:meth:`_kick`, from the ``starts`` fastest moved plans). A climb from a failed dive's
    leaves (:meth:`from_dive`) gives up after ``dive_patience`` neighbours without a faster
    one."""

    def __init__(
        self,
        evaluate: Callable[[BatchShape, Suffix], float | None],
        expired: Callable[[], bool],
        threshold: Callable[[], float],
        budget: int = 200,
        rounds: int = 10,
        kicks: int = 3,
        starts: int = 2,
        dive_patience: int = 50,
    ) -> None:
        self.evaluate, self.expired, self.threshold = evaluate, expired, threshold
        self.budget, self.rounds, self.kicks, self.starts = budget, rounds, kicks, starts
        self.dive_patience = dive_patience
        self.shapes: dict[ShapeKey, BatchShape] = {}
        self._index: dict[int, dict[tuple[int, int, int, int], int]] = {}
        self.active = False
        self.solved = 0  # neighbours solved, for the statistics
        self.moves = 0  # improvements taken

    def register(self, shapes: list[BatchShape]) -> None:
        """Make ``shapes`` neighbours of each other's plans (the first of each key stays; a
        merged MoE shape is bounded by its root and its plans solved in its exact kinds)."""
        for shape in shapes:
            self.shapes.setdefault((shape.mbs, shape.schedule, shape.chunks, shape.dp), shape)

    def improve(self, shape: BatchShape, suffix: Suffix, value: float) -> Point:
        """Climb from the plan ``suffix`` of ``shape`` (step ``value``) to a faster neighbour
        while there is one, giving up after :attr:`budget` neighbours without a faster one or
        :attr:`budget` x :attr:`rounds` neighbours in all, then kick (:meth:`_kick`) and climb
        again while that finds a faster plan; the plan reached. Not re-entrant: plans found
        while climbing are not climbed from again (the climb goes on from them)."""
        if self.active:
            return shape, suffix, value
        self.active = True
        try:
            point = self._climb((shape, suffix, value), self._recorded, self._neighbours)
            for _ in range(self.kicks):
                kicked = self._kick(point)
                if kicked is None:
                    break
                point = self._climb(kicked, self._recorded, self._neighbours)
            return point
        finally:
            self.active = False

    def _recorded(self, shape: BatchShape, suffix: Suffix, _: float) -> float | None:
        return self.evaluate(shape, suffix)

    def _climb(self, point: Point, step: Step, neighbours: Neighbours, goal: float = 0.0,
               patience: int | None = None) -> Point:
        """First-improvement climb from ``point`` over ``neighbours``, each timed by ``step``
        (with the climbed plan's step time, which it must beat), giving up after ``patience``
        (default :attr:`budget`) neighbours without a faster one; it stops at the first plan
        faster than ``goal``."""
        total, patience = self.budget * self.rounds, patience or self.budget
        while point[2] >= goal:
            moved, left = False, patience
            for target, other in neighbours(point[0], point[1]):
                if left <= 0 or total <= 0 or self.expired():
                    return point
                left, total = left - 1, total - 1
                self.solved += 1
                value = step(target, other, point[2])
                if value is not None and value < point[2]:
                    point, moved = (target, other, value), True
                    self.moves += 1
                    break
            if not moved:
                return point
        return point

    def _kick(self, point: Point) -> Point | None:
        """A plan faster than ``point`` (where a climb ended) from its blocks moved into the
        neighbouring shapes of another micro-batch size or DP degree that may still win: the
        :attr:`starts` fastest moved plans at most :data:`KICK_REACH` times slower, each
        climbed within its shape although it starts slower (:meth:`_climb_within`); the first
        end faster than ``point``, recorded by ``evaluate``, or None."""
        shape, suffix, value = point
        step = self._unrecorded()
        moved = [(target, other) for target, other in self._neighbours(shape, suffix)
                 if (target.mbs, target.dp) != (shape.mbs, shape.dp)]
        return self._climb_within(moved, step, value)

    def from_dive(self, shape: BatchShape, leaves: list[Suffix], value: float) -> Point | None:
        """Where a dive into ``shape`` found no plan below the K-th best: a plan faster than
        ``value`` (the best so far) by climbing within ``shape`` from the :attr:`starts`
        fastest of the dive's closed pipelines ``leaves`` at most :data:`KICK_REACH` times
        slower (:meth:`_climb_within`), each giving up after :attr:`dive_patience` neighbours
        without a faster one and stopping at its first plan faster than ``value``, which
        ``evaluate`` records and climbs on from (every plan of that climb recorded); None if
        none. A dive's leaves can sit just above a tight K-th best while the shape's best plan
        is a few moves away (the 100,000-chip 70B family member: 1.130 s from a zero-bubble DP
        128 dive, 1.069 s after 31 neighbours, climbed on to 0.996 s, when the K-th best was
        1.11 s)."""
        if self.active or not leaves:
            return None
        plans = [(shape, leaf) for leaf in leaves]
        return self._climb_within(plans, self._unrecorded(), value, self.dive_patience, value)

    def _unrecorded(self) -> Step:
        """Exact splits with the climbed plan as cutoff, not recorded, each pipeline once."""
        seen: set[tuple[int, Suffix]] = set()

        def step(target: BatchShape, other: Suffix, cutoff: float) -> float | None:
            if (id(target), other) in seen or self.expired():
                return None
            seen.add((id(target), other))
            split = solve_structure(target, other, cutoff=cutoff)
            return None if split is None else split.step_time_s

        return step

    def _climb_within(self, plans: list[tuple[BatchShape, Suffix]], step: Step, value: float,
                      patience: int | None = None, goal: float = 0.0) -> Point | None:
        """From the :attr:`starts` fastest of ``plans`` at most :data:`KICK_REACH` times
        ``value``, each climbed within its shape (``step``: exact, not recorded; ``patience``
        and ``goal`` as in :meth:`_climb`); the first end faster than ``value``, recorded by
        ``evaluate``, or None."""
        starts = [(v, i, t, s) for i, (t, s) in enumerate(plans)
                  if (v := step(t, s, KICK_REACH * value)) is not None]
        for start, _, target, other in sorted(starts)[: self.starts]:
            end = self._climb((target, other, start), step,
                              lambda t, s: ((t, n) for n in shape_neighbours(t, s)), goal,
                              patience)
            if end[2] < value and (found := self.evaluate(target, end[1])) is not None:
                if found < value:
                    return target, end[1], found
        return None

    def _neighbours(self, shape: BatchShape, suffix: Suffix) -> Iterator[tuple[BatchShape, Suffix]]:
        """Neighbours in ``shape`` first, then the same blocks in the neighbouring shapes that
        may still win (root bound below the K-th best)."""
        for other in shape_neighbours(shape, suffix):
            yield shape, other
        for bounded in self._near_shapes(shape):
            if bounded.root_bound() >= self.threshold():
                continue
            target = getattr(bounded, "exact", bounded)  # merged MoE kinds: solve the exact
            for moved in self._moved(shape, suffix, target):
                if _valid(target, moved):
                    yield target, moved

    def _near_shapes(self, shape: BatchShape) -> list[BatchShape]:
        """Registered shapes with the micro-batch size and DP degree each halved, kept or
        doubled (own-DP shapes: the own-DP shapes of those micro-batch sizes), any schedule."""
        out = []
        for (mbs, _, _, dp), target in self.shapes.items():
            if getattr(target, "exact", target) is shape or mbs not in (
                shape.mbs // 2, shape.mbs, shape.mbs * 2
            ):  # fmt: skip
                continue
            if (dp is None) != (shape.dp is None):
                continue
            if dp is not None and shape.dp is not None and dp not in (
                shape.dp // 2, shape.dp, shape.dp * 2
            ):  # fmt: skip
                continue
            out.append(target)
        return out

    def _moved(self, shape: BatchShape, suffix: Suffix, target: BatchShape) -> list[Suffix]:
        """``suffix``'s blocks in ``target``: each block's chip type, TP and EP degree, at the
        target's DP degree (own DP: its own), each block with about its chips, or each with its
        stages; none if a kind is missing there."""
        index = self._index.get(id(target))
        if index is None:
            index = {(k.chip, k.tp, k.dp, k.ep): i for i, k in enumerate(target.kinds)}
            self._index[id(target)] = index
        chips, stages = [], []
        for kind, count in suffix:
            k = shape.kinds[kind]
            dp = k.dp if target.dp is None else target.dp
            other = index.get((k.chip, k.tp, dp, k.ep))
            if other is None:
                return []
            chips.append((other, _counts(target, other, count * k.tp * k.dp)[-1]))
            stages.append((other, count))
        return list(dict.fromkeys((tuple(chips), tuple(stages))))
