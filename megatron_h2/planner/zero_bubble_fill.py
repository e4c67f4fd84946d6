"""How much of the deferred weight-gradient work zero-bubble's fill may leave out, for the
bounds of :class:`~megatron_h2.planner.bounds.BatchShape`.

Under zero-bubble a stage's fill is ``f = W - (1 + b) G`` and its end-of-step term
``z = (1 + b) G + Z`` (:mod:`~megatron_h2.planner.partition`), with
``b = min(m - 1, p - 1) / (p - 1)`` for ``p > 1`` stages and ``m`` micro-batches per replica
(:func:`~megatron_h2.planner.cost_model.zero_bubble_share`), 1 for one stage. The bounds take
the fill with a share ``s >= 1 + b`` of ``G`` and the end-of-step term with the least ``b``
(that of the longest pipeline): a lower bound on both.

``b`` falls with ``p``: ``1 + b`` is at most :func:`fill_shares` (``b`` of two stages: 0 when
``m = 1``, else 1) on every pipeline of two stages or more. A one-stage pipeline has
``f + z = W + Z`` whatever ``b``, at least the bound's ``W - s G + (1 + b_least) G + Z`` since
``s >= 1 + b_least``, so the share holds there too. Below a suffix of ``p`` stages every
pipeline has at least ``p`` stages, so ``1 + b(p)`` holds there: the fill rises by at least
``(s - 1 - b(p)) G`` per layer (:func:`share_rise`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_h2.planner.cost_model import zero_bubble_share

if TYPE_CHECKING:
    from collections.abc import Sequence

    from megatron_h2.planner.bounds import BatchShape


def fill_shares(schedule: str, micro_batches: Sequence[int]) -> np.ndarray:
    """Per kind (its replicas' micro-batches), the share of its weight-gradient work ``G``
    that a lower bound on zero-bubble's fill may leave out on every pipeline: ``1 + b`` of two
    stages (1 when ``m = 1``, else 2); 0 under other schedules (no deferred work)."""
    if schedule != "zero-bubble":
        return np.zeros(len(micro_batches))
    return np.array([1.0 + zero_bubble_share(2, m) for m in micro_batches])


def share_rise(shape: BatchShape, stages: np.ndarray | int) -> np.ndarray:
    """What the fill of ``shape`` (zero-bubble, its grid built) rises by at least below options
    whose pipelines have at least ``stages`` stages (one number per option): probe x option,
    ``L`` times the least over kinds of ``(s_k - 1 - b(p, m_k)) G_k`` (:func:`fill_shares`),
    with ``p`` also at least the layers over the largest single-stage capacity at the probe
    (read at ``g_j+1`` as the fill is); 0 under other schedules and for MoE models (whose
    per-layer numbers are means over dense and MoE layers)."""
    stages = np.atleast_1d(np.asarray(stages, dtype=np.int64))
    if shape.schedule != "zero-bubble" or not shape.kinds or shape.cost.model.is_moe:
        return np.zeros((len(shape.grid), len(stages)))
    held = shape.prefix[:, :, 1].max(axis=0)  # warm-up 0 holds the most: probe
    with np.errstate(divide="ignore"):
        least = np.ceil(shape.layers / np.maximum(held, 1e-9) - 1e-9)
    lengths = np.maximum(np.minimum(least, shape.positions)[:, None], stages[None, :])
    return shape.layers * _per_layer(shape)[np.minimum(lengths, shape.positions).astype(int)]


def _per_layer(shape: BatchShape) -> np.ndarray:
    """Per pipeline length ``p = 0 .. positions`` the least over kinds of
    ``(s_k - 1 - b(p, m_k)) G_k`` (0 for ``p < 2``)."""
    m = np.array([k.micro_batches for k in shape.kinds], dtype=np.float64)
    weight = np.array([k.costs.layer_weight_grad for k in shape.kinds])
    shares = fill_shares(shape.schedule, [k.micro_batches for k in shape.kinds])
    p = np.arange(shape.positions + 1, dtype=np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        b = np.minimum(m[None, :] - 1.0, p - 1.0) / (p - 1.0)  # zero_bubble_share, p >= 2
    rise = np.maximum((shares[None, :] - 1.0 - b) * weight[None, :], 0.0).min(axis=1)
    rise[:2] = 0.0
    return rise
