"""The nodes of the branch and bound of :mod:`.search`: pipeline suffixes, and under one DP
degree *sets of blocks* whose order is chosen only once the set is closed.

An ordered node is a pipeline suffix: blocks of stages of one chip type, prepended one by one
in front of the last stage. Orders of the same blocks are different plans, but their bounds are
often equal, so an ordered search expands the same blocks in every order one by one (on a
10,000-chip six-type cluster some 4 of 5 queued suffixes are reorderings).

Under one DP degree (every stage's warm-up is its position from the end) a *set node* stands
for every order of its blocks behind a fixed last block (the one that holds the head): its
bound holds for each order and for every set of blocks it may still grow into. Each of its
middle blocks is counted as if it stood right in front of the last block, where a stage holds
the most (the capacity of a stage falls with its warm-up; :func:`envelope_prefix` makes that
exact for any table), the chip types not used yet may sit anywhere in front of the last block
(their lead is the last block's), each middle block has one link out of at least its type's
cheapest, and the first stage's embedding is not counted. A set is reached from each of its
subsets but expanded once (the search keeps the sets it has queued). Closing a set starts an
ordered search over the orders of its middle blocks (a node with ``allowed`` blocks), bounded
as usual; so every plan is still reached, and bounded from below on the way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.merged_shape import MergedShape
from megatron_h2.planner.structure import Suffix

Groups = tuple[tuple[float, np.ndarray, int], ...]  # (per-layer time, capacity, stages)


@dataclass(frozen=True)
class Node:
    """A pipeline suffix: its blocks (kind, stages) from the front, their capacity groups, its
    stages, the chip types still unused (bit mask), its link time and its lead (the lead the
    stage in front of it must have, :mod:`.bounds`).

    With ``sets``, a set node (module docstring): ``suffix`` is its middle blocks sorted, then
    the last block; ``groups`` the last block's, then the middle blocks' at their best place;
    ``lead`` the last block's. With ``allowed``, an ordered node that may only prepend those
    blocks and closes once it holds them all (the orders of a closed set)."""

    suffix: Suffix
    groups: Groups
    position: int
    mask: int
    links: float
    lead: int
    sets: bool = False
    allowed: Suffix | None = None

    def child(self, shape: BatchShape, kind: int, count: int, links: float) -> Node:
        """The suffix with ``count`` stages of ``kind`` prepended (the block in front of a set
        node, which then holds the last block)."""
        start = shape.start(kind, self.lead)
        block = shape.block(kind, start, np.array([start + count]))[:, 0]
        return Node(
            ((kind, count),) + self.suffix,
            self.groups + ((float(shape.fill_unit[kind]), block, count),),
            self.position + count,
            self.mask & ~type_bit(shape, kind),
            self.links + links,
            shape.kinds[kind].dp * (start + count),
            self.sets,
            self.allowed,
        )

    def set_child(self, shape: BatchShape, kind: int, count: int, links: float,
                  envelope: np.ndarray) -> Node:
        """The set node with the block (``kind``, ``count``) added among its middle blocks
        (``links``: :func:`free_links`; ``envelope``: :func:`envelope_prefix` of the grid)."""
        if not self.suffix:
            return self.child(shape, kind, count, links)
        start = shape.start(kind, self.lead)
        block = envelope_block(shape, envelope, kind, start, count)
        return Node(
            tuple(sorted(self.suffix[:-1] + ((kind, count),))) + self.suffix[-1:],
            self.groups + ((float(shape.fill_unit[kind]), block, count),),
            self.position + count,
            self.mask & ~type_bit(shape, kind),
            self.links + links,
            self.lead,
            True,
        )

    def orders(self, shape: BatchShape) -> Node:
        """The ordered node of a closed set's last block alone, which may prepend the set's
        middle blocks in any order."""
        kind, count = self.suffix[-1]
        mask = 0
        for middle, _ in self.suffix[:-1]:
            mask |= type_bit(shape, middle)
        name = shape.kinds[kind].name
        links = shape.link_factor * (count - 1) * shape.link(name, name)
        return Node(self.suffix[-1:], self.groups[:1], count, mask, links, self.lead,
                    allowed=self.suffix[:-1])


class BlockSets:
    """What the search by sets keeps for one search: the sets queued and, per batch shape, the
    envelope of its current grid."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._seen: set[tuple[object, ...]] = set()
        self._envelopes: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def applies(self, shape: BatchShape) -> bool:
        """Whether ``shape`` is searched by sets (one DP degree, kinds not merged)."""
        return self.enabled and shape.uniform and not isinstance(shape, MergedShape)

    def seen(self, shape: BatchShape, node: Node, kind: int, count: int) -> bool:
        """Whether the set that adding (``kind``, ``count``) to ``node`` makes was queued
        already (else it is marked so)."""
        key = (id(shape), node.suffix[-1], tuple(sorted(node.suffix[:-1] + ((kind, count),))))
        if key in self._seen:
            return True
        self._seen.add(key)
        return False

    def envelope(self, shape: BatchShape) -> np.ndarray:
        """:func:`envelope_prefix` of ``shape``'s current grid (kept until the grid changes)."""
        prefix, envelope = self._envelopes.get(id(shape), (None, None))
        if prefix is not shape.prefix or envelope is None:
            envelope = envelope_prefix(shape.prefix)
            self._envelopes[id(shape)] = (shape.prefix, envelope)
        return envelope


def set_leaf(shape: BatchShape, node: Node, need: float) -> float:
    """Bound of every order of a set node's blocks closed as they are (the first stage of any
    of its kinds; ``need``: the suffix's least folded steady term)."""
    kinds = [kind for kind, _ in node.suffix]
    last = node.suffix[-1][0]
    edges = float(shape.head_time[last] + shape.embedding_time[kinds].min())
    first = max(need, float(shape.embedding_need[kinds].min()))
    sync = shape.sync_bound(node.suffix, 0, last)
    placed = [(u, caps[:, None], count) for u, caps, count in node.groups]
    return float(shape.bound(placed, 0, np.array([node.lead]), node.links, edges, first, sync)[0])


def type_bit(shape: BatchShape, kind: int) -> int:
    """The bit of ``kind``'s chip type in a node's mask."""
    return 1 << shape.types.index(shape.kinds[kind].chip)


def free_links(shape: BatchShape, kind: int, count: int) -> float:
    """Least link time a middle block of a set adds in any order: its own stages' links and
    one link out of it, at least its type's cheapest."""
    name = shape.kinds[kind].name
    inner = shape.link_factor * (count - 1) * shape.link(name, name)
    return inner + shape.type_link[shape.kinds[kind].chip]


def envelope_prefix(prefix: np.ndarray) -> np.ndarray:
    """Prefix sums over warm-ups (like :attr:`BatchShape.prefix`) of each stage's capacity
    raised to the most of any larger warm-up: non-increasing in the warm-up, so a block's
    capacity from a warm-up bounds that of the same block from any later one."""
    caps = np.diff(prefix, axis=2)
    envelope = np.maximum.accumulate(caps[:, :, ::-1], axis=2)[:, :, ::-1]
    out = np.zeros_like(prefix)
    np.cumsum(envelope, axis=2, out=out[:, :, 1:])
    return out


def envelope_block(shape: BatchShape, envelope: np.ndarray, kind: int, start: int,
                   counts: int | np.ndarray) -> np.ndarray:
    """:meth:`BatchShape.block` read from :func:`envelope_prefix`: per probe (x counts)."""
    table = min(start, shape.depth - 1)
    prefix = envelope[kind]
    out = prefix[:, table + np.atleast_1d(counts)] - prefix[:, [table]]
    return out if np.ndim(counts) else out[:, 0]
