"""Lower bounds of closed pipelines (every block placed, the pipeline's front known), shared by
the branch and bound's leaves (:mod:`megatron_h2.planner.search`) and the expansion of a merged
mixture-of-experts pipeline into its EP choices (:mod:`megatron_h2.planner.merged_shape`)."""

from __future__ import annotations

import numpy as np

from megatron_h2.planner.bounds import BatchShape

Suffix = tuple[tuple[int, int], ...]


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
    edges = shape.head_time[last] + shape.embedding_time[first]
    syncs = np.array([shape.sync_bound(s, 0, s[-1][0], s[0][0]) for s in suffixes])
    needs = np.maximum([suffix_need(shape, s) for s in suffixes], shape.embedding_need[first])
    position, warmups = sum(count for _, count in suffixes[0]), shape.warmups(suffixes[0])
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
