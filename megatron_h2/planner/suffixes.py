"""Pipeline suffixes in the plan search's branch and bound (:mod:`.search`): its nodes (a
suffix, a queued option, what a search stopped at the time limit has left) and the lower bounds
of closed pipelines (every block placed, the pipeline's front known), shared by the branch and
bound's leaves and the expansion of a merged mixture-of-experts pipeline into its EP choices
(:mod:`.merged_shape`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.structure import Suffix
from megatron_h2.planner.zero_bubble_fill import share_rise

Groups = tuple[tuple[float, np.ndarray, int], ...]  # (per-layer time, capacity, stages)


@dataclass(frozen=True)
class Node:
    """A pipeline suffix: its blocks (kind, stages) from the front, their capacity groups, its
    stages, the chip types still unused (bit mask), its link time and its lead (the lead the
    stage in front of it must have, :mod:`.bounds`)."""

    suffix: Suffix
    groups: Groups
    position: int
    mask: int
    links: float
    lead: int

    def child(self, shape: BatchShape, kind: int, count: int, links: float) -> Node:
        """The suffix with ``count`` stages of ``kind`` prepended."""
        start = shape.start(kind, self.lead)
        block = shape.block(kind, start, np.array([start + count]))[:, 0]
        chip_bit = 1 << shape.types.index(shape.kinds[kind].chip)
        return Node(
            ((kind, count),) + self.suffix,
            self.groups + ((float(shape.fill_unit[kind]), block, count),),
            self.position + count,
            self.mask & ~chip_bit,
            self.links + links,
            shape.kinds[kind].dp * (start + count),
        )


Entry = tuple[float, int, BatchShape, int, int, Node]
"""A queued option: its bound, a tie-breaker, its shape, the kind and stage count of the block
it prepends (kind -1: close the pipeline) and the suffix it extends."""


@dataclass
class Left:
    """What a search stopped at the time limit has left: shapes whose roots are not bounded
    yet, shapes bounded by their roots' children (bound, shape) and queued suffixes."""

    shapes: list[BatchShape]
    roots: list[tuple[float, BatchShape]]
    queue: list[Entry]


def root_node(shape: BatchShape) -> Node:
    """The empty suffix of ``shape``: every chip type unused."""
    return Node((), (), 0, (1 << len(shape.types)) - 1, 0.0, 0)


def suffix_need(shape: BatchShape, suffix: Suffix) -> float:
    """The least folded steady term of a pipeline suffix: one layer on its slowest kind, or the
    last stage's layer and the head (:attr:`BatchShape.head_need`)."""
    if not suffix:
        return 0.0
    need = float(shape.head_need[suffix[-1][0]])
    return max(need, max(float(shape.unit[kind, 0]) for kind, _ in suffix))


def closed_bounds(shape: BatchShape, suffixes: list[Suffix], lead: int,
                  links: float) -> np.ndarray:
    """Bounds of closed pipelines with their stages' exact memory caps, in one bound call:
    ``suffixes`` (pipeline order) of the same blocks' stage counts and DP degrees (hence
    warm-ups), differing only in the kinds (EP degrees); ``lead``, ``links``: theirs."""
    first, last = [s[0][0] for s in suffixes], [s[-1][0] for s in suffixes]
    position, warmups = sum(count for _, count in suffixes[0]), shape.warmups(suffixes[0])
    edges = shape.head_time[last] + shape.embedding_time[first] + share_rise(shape, position)
    syncs = np.array([shape.sync_bound(s, 0, s[-1][0], s[0][0]) for s in suffixes])
    needs = np.maximum([suffix_need(shape, s) for s in suffixes], shape.embedding_need[first])
    parts, rates, front, width = [], [], 0, len(suffixes)
    for block, (_, count) in enumerate(suffixes[0]):
        used = [s[block][0] for s in suffixes]
        for kind in dict.fromkeys(used):  # one part per kind of this block
            caps = shape.closed_block(kind, position, front, warmups[front : front + count])
            mine = np.array([k == kind for k in used])
            stages = count if mine.all() else np.where(mine, count, 0)
            columns = caps[:, None] if width == 1 else np.where(mine, caps[:, None], 0.0)
            parts.append((float(shape.fill_unit[kind]), columns, stages))
            rates.append(float(shape.sync_inverse[kind]))
        front += count
    return shape.bound(parts, 0, np.full(width, lead), links, edges, needs, syncs, rates)
