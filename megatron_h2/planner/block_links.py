"""The link time of a chip type's block of stages, for the knapsack bounds of a batch shape's
root (:mod:`.uniform_root`, :mod:`.joint_root`, :mod:`.own_root`).

In every plan of a batch shape a chip type is unused or runs one block of ``n`` contiguous
stages (:class:`~megatron_h2.planner.bounds.BatchShape`), so ``n - 1`` of its links go from
the type to itself (its own inter-node bandwidth) and, unless the block ends the pipeline, one
goes to another type (the cross-type bandwidth): the links of a plan are
``sum_b ((n_b - 1) self_b) + sum_{b not last} link(t_b, t_b+1)``, at least
``sum_b ((n_b - 1) self_b + out_b) - max_t out_t`` with ``out_t`` the cheapest link from ``t``
to another type of the shape. The knapsacks took every stage at its type's cheapest link to
any type, ``min(self_t, out_t)``: a type whose own nodes are slowly linked (on the
100,000-chip 405B family member, seed 3, T5's own link is 64.6 ms a micro-batch, forward and
backward, against 27.4 ms to another type) was counted at the cross-type link on every stage.
Both forms are lower bounds; this one is never below the other (per block it adds
``(n - 1)(self - min) + (out - min)``, at least the ``max out - max min`` it subtracts more).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from megatron_h2.planner.bounds import BatchShape


def _pair_links(shape: BatchShape) -> tuple[dict[int, float], dict[int, float]]:
    """Per chip type of ``shape``: its link to itself and its cheapest link to another type of
    the shape (0 where it is the only type: no stage sends to another), each times the shape's
    link factor (forward and backward, per chunk); cached on the shape."""
    cached = shape.__dict__.get("_block_links")
    if cached is not None and cached[0] == tuple(shape.types):
        return cached[1], cached[2]
    names = {t: shape.cost.cluster.chips[t].name for t in shape.types}
    own = {t: shape.link_factor * shape.link(names[t], names[t]) for t in shape.types}
    out = {
        t: shape.link_factor * min((shape.link(names[t], names[u]) for u in shape.types if u != t),
                                   default=0.0)
        for t in shape.types
    }
    shape.__dict__["_block_links"] = (tuple(shape.types), own, out)
    return own, out


def block_links(shape: BatchShape, chip: int, stages: np.ndarray | float) -> np.ndarray | float:
    """A lower bound on the links of a block of ``stages`` stages (>= 1) of chip type ``chip``
    plus one to the next block, whatever follows: ``(n - 1) self + out``; :func:`last_link`
    takes back the one link that the block ending the pipeline does not have."""
    own, out = _pair_links(shape)
    return (np.asarray(stages, dtype=np.float64) - 1.0) * own[chip] + out[chip]


def last_link(shape: BatchShape) -> float:
    """The most :func:`block_links` counts for a block's link to the next (one block ends the
    pipeline and sends nothing): the largest cheapest cross-type link over the shape's types."""
    return max(_pair_links(shape)[1].values(), default=0.0)
