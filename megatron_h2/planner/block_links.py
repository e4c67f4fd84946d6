"""The link time of one chip type's block of stages, for the roots' knapsacks.

Every chip type used by a plan runs one block of contiguous stages (one kind, ``n`` stages), so
``n - 1`` of its links go from a stage of the type to another of the same type, and its last
stage sends to the first stage of the next block, of another type, unless the block ends the
pipeline. So a block of ``n`` stages of type ``t`` costs at least
``(n - 1) l_tt + o_t`` of links (``l_tt`` the type's link to itself, ``o_t`` its cheapest to any
other type of the shape), less ``o_t`` for the last block: summed over the blocks, every plan's
links are at least ``sum_t ((n_t - 1) l_tt + o_t) - max_t o_t``.

The roots' knapsacks (:mod:`.uniform_root`, :mod:`.own_root`, :mod:`.joint_root`) counted ``n``
links at the type's cheapest to any type, ``min(l_tt, o_t)``, less the largest of those. Where a
type's links to itself are slower than to the others (a slow network between its own nodes: on
the 1,024-chip 8-type family member, seed 1, T3 sends 4.97 ms to itself and 3.46 ms to any
other type), a block of many stages was counted at the faster one: a 20-stage T3 block 29 ms
short.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from megatron_h2.planner.bounds import BatchShape


def block_link_terms(shape: BatchShape) -> tuple[dict[int, float], dict[int, float]]:
    """Per chip type of ``shape``: its stages' link to a stage of the same type (``l_tt``), and
    the cheapest to a stage of another type of the shape (``o_t``; 0 with one type only), each
    in the step time (x the shape's link factor)."""
    names = {t: shape.cost.cluster.chips[t].name for t in shape.types}
    inner = {t: shape.link_factor * shape.link(names[t], names[t]) for t in shape.types}
    outer = {
        t: shape.link_factor * min((shape.link(names[t], names[u]) for u in shape.types if u != t),
                                   default=0.0)
        for t in shape.types
    }
    return inner, outer


def block_links(shape: BatchShape, chip: int, stages: np.ndarray | float) -> np.ndarray | float:
    """The least link time of a block of ``stages`` (at least 1) stages of type ``chip`` that
    does not end the pipeline: ``(n - 1) l_tt + o_t`` (:func:`block_link_terms`)."""
    return (np.asarray(stages) - 1.0) * shape.inner_link[chip] + shape.outer_link[chip]


def last_block_links(shape: BatchShape) -> float:
    """What the block that ends the pipeline does not pay of :func:`block_links`: at most the
    largest ``o_t`` of the shape's types."""
    return max(shape.outer_link.values(), default=0.0)
