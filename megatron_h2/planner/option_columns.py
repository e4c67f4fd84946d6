"""The option columns of one chip type below a pipeline suffix, for the option bounds of
:mod:`.search` (one :meth:`~megatron_h2.planner.bounds.BatchShape.bound` call per chip type).

A node's children of one chip type are its kinds, each with the stage counts that fit in the
positions left. What the bound call needs of them apart from the suffix itself (each kind's
capacity block in front of the suffix's lead, its stage counts, the lead it leaves, its sync
rate, the zero-bubble rise of the pipeline length and the front stage's embedding floor) depends
only on the chip type, the suffix's lead and the positions left, on the shape's probe grid: many
suffixes share them (under one DP degree the lead follows from the position). So they are built
once per (chip type, lead, positions left) and grid and kept on the shape; the arrays are shared
and never written to, and each bound call gets the same floats as when they were built anew.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_h2.planner.option_group import OptionGroup
from megatron_h2.planner.zero_bubble_fill import share_rise

if TYPE_CHECKING:
    from megatron_h2.planner.bounds import BatchShape

_KEY = "_chip_columns"
"""Where a shape keeps its columns: (the probe grid's prefix table they were built on, dict)."""


class ChipColumns:
    """The option columns of one chip type in front of a lead with some positions left:
    ``columns`` (kind, stage counts) of its kinds with some count; ``parts`` per kind its
    (fill per layer, capacity probe x option, stages per option) for
    :meth:`~megatron_h2.planner.bounds.BatchShape.bound` (each zero outside its kind's
    columns); ``leads`` the lead each option leaves; ``rates`` per kind its sync rate; ``rise``
    the zero-bubble rise (:func:`~megatron_h2.planner.zero_bubble_fill.share_rise`);
    ``closing`` per option its kind's front-stage floor with the embedding; the rest per option
    what :meth:`terms` reads of its kind."""

    def __init__(self, shape: BatchShape, columns: list[tuple[int, np.ndarray]], lead: int,
                 position: int) -> None:
        width = sum(len(c) for _, c in columns)
        self.columns, self.parts = columns, []
        leads, inner, lo = [], [], 0
        for kind, count in columns:
            hi = lo + len(count)
            start = shape.start(kind, lead)
            caps = np.zeros((len(shape.grid), width))  # this kind's options only
            caps[:, lo:hi] = shape.block(kind, start, start + count)
            stages = np.zeros(width)
            stages[lo:hi] = count
            self.parts.append((float(shape.fill_unit[kind]), caps, stages))
            name = shape.kinds[kind].name
            inner.append((count - 1) * shape.link(name, name))  # between its own stages
            leads.append(shape.kinds[kind].dp * (start + count))
            lo = hi
        self.leads, self.inner = np.concatenate(leads), np.concatenate(inner)
        self.leads.setflags(write=False)  # bound calls gather at them once (lead_cache.py)
        self.rates = [shape.sync_inverse[k] for k, _ in columns]
        self.parts = OptionGroup(self.parts, self.rates).parts  # taken as one (option_group.py)
        self.counts = np.concatenate([c for _, c in columns])
        self.rise = share_rise(shape, position + self.counts)
        self.kinds = np.repeat([k for k, _ in columns], [len(c) for _, c in columns])
        kinds = self.kind_list = self.kinds.tolist()  # per option its kind and stage count
        self.count_list = self.counts.tolist()
        self.closing = shape.embedding_tail[self.kinds]
        self.own = shape.unit[self.kinds, 0]
        self.own_head = np.maximum(self.own, shape.head_need[self.kinds])  # the last block
        self.edges_alone = shape.head_time[self.kinds] + shape.embedding_min
        one, inverse = shape._sync_floats
        self.sync_one = np.array([one[k] for k in kinds])
        self.sync_inverse = np.array([inverse[k] for k in kinds])
        self.head_tail = shape.head_tail[self.kinds]
        self._front: dict[int, np.ndarray] = {}

    def terms(
        self, shape: BatchShape, node: Any, need: float, others: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per option below ``node`` (a :class:`~megatron_h2.planner.suffixes.Node`) with the
        types ``others`` unused in front: its need, edges (without the rise), links and sync
        bound (:meth:`~megatron_h2.planner.bounds.BatchShape.sync_bound` of the suffix with
        its block prepended), the same floats as one kind at a time."""
        suffix = node.suffix
        if suffix:
            last = suffix[-1][0]
            needs = np.maximum(need, self.own)
            edges = np.full(len(self.own), shape.head_time[last] + shape.embedding_min)
            links = node.links + shape.link_factor * (self.inner + self._links(shape, suffix))
            head: Any = float(shape.head_tail[last])
        else:  # the block ends the pipeline: its last stage holds the head
            needs = np.maximum(need, self.own_head)
            edges, head = self.edges_alone, self.head_tail
            links = node.links + shape.link_factor * self.inner
        one, inverse_of = shape._sync_floats
        floor, first, inverse = np.maximum(self.sync_one, head), self.closing, 0.0
        for kind, count in suffix:  # pipeline order, the new block last
            floor = np.maximum(floor, one[kind])
            inverse = inverse + count * inverse_of[kind]
        inverse = inverse + self.counts * self.sync_inverse
        for t_index, chip in enumerate(shape.types):
            if others >> t_index & 1:
                first = np.minimum(first, shape.type_embedding_tail[chip])
                inverse = inverse + shape.type_sync_inverse[chip]
        floor = np.maximum(floor, first)
        return needs, edges, links, np.maximum(shape.layers / inverse, floor)

    def _links(self, shape: BatchShape, suffix: Any) -> np.ndarray:
        """Per option the link from its block to the suffix's front block."""
        front = suffix[0][0]
        if front not in self._front:
            name = shape.kinds[front].name
            self._front[front] = np.array(
                [shape.link(shape.kinds[k].name, name) for k in self.kinds.tolist()]
            )
        return self._front[front]


def chip_columns(shape: BatchShape, chip: int, lead: int, room: int) -> ChipColumns | None:
    """The option columns of chip type ``chip`` in front of lead ``lead`` with ``room``
    positions left (None: no kind of it fits), kept on the shape for its current grid."""
    cached = shape.__dict__.get(_KEY)
    if cached is None or cached[0] is not shape.prefix:  # a new grid: new blocks
        cached = (shape.prefix, {})
        shape.__dict__[_KEY] = cached
    table: dict[tuple[int, int, int], ChipColumns | None] = cached[1]
    key = (chip, lead, room)
    if key not in table:
        columns = [(k, shape.counts(k, room)) for k in shape.kinds_of[chip]]
        columns = [(k, c) for k, c in columns if len(c)]
        table[key] = ChipColumns(shape, columns, lead, shape.positions - room) if columns else None
    return table[key]


def block_links(shape: BatchShape, front: int | None, kind: int, inner: Any) -> Any:
    """Link time in the step formula added by prepending a block of ``kind`` whose own
    stages' links are ``inner`` (:attr:`ChipColumns.inner`) to a suffix whose front block is
    of kind ``front`` (None: an empty suffix)."""
    total = inner
    if front is not None:
        name = shape.kinds[kind].name
        total = total + shape.link(name, shape.kinds[front].name)
    return shape.link_factor * total
