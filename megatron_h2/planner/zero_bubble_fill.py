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
    with ``p`` also at least the fewest stages that hold the layers at the probe
    (read at ``g_j+1`` as the fill is); one row of zeros where nothing rises: under other
    schedules, with one micro-batch per replica (``s = 1``, ``b = 0``) and for MoE models
    (whose per-layer numbers are means over dense and MoE layers)."""
    stages = np.atleast_1d(np.asarray(stages, dtype=np.int64))
    per_layer, least = _tables(shape)
    if per_layer is None or not per_layer[min(max(least[0], stages.max()), shape.positions)]:
        return np.zeros((1, len(stages)))  # it grows with p, and least falls with the probe
    lengths = np.minimum(np.maximum(least[:, None], stages[None, :]), shape.positions)
    return shape.layers * per_layer[lengths]


def _tables(shape: BatchShape) -> tuple[np.ndarray | None, np.ndarray]:
    """Per pipeline length ``p = 0 .. positions`` the least over kinds of ``(s_k - 1 - b(p,
    m_k)) G_k`` (0 for ``p < 2``; None where it is 0 everywhere), and per probe the fewest
    stages that hold the layers (:func:`_fewest_stages`, capped at the positions):
    kept on the shape per grid (they depend on its kinds and grid only)."""
    key = ("zero_bubble_fill", shape._grid_key)
    cached = shape.__dict__.get("_zero_bubble_fill")
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    per_layer = None
    if shape.schedule == "zero-bubble" and shape.kinds and not shape.cost.model.is_moe:
        per_layer = _per_layer(shape)
        per_layer = per_layer if per_layer.any() else None
    least = np.zeros(1, dtype=np.int64)  # nothing rises: no table needed (none may exist)
    if per_layer is not None:
        least = _fewest_stages(shape)
    shape.__dict__["_zero_bubble_fill"] = (key, per_layer, least)
    return per_layer, least


def _fewest_stages(shape: BatchShape) -> np.ndarray:
    """Per probe the fewest stages that hold the layers (capped at the positions): the last
    stage (warm-up 0) at most the most any kind holds at warm-up 0, each other stage (warm-up 1
    or more: a lead of at least one) the most any kind holds at any of those. Under zero-bubble
    the last stage holds two deferred inputs and may hold less than a stage in front of it
    (where deferred inputs outweigh activations), so warm-up 0 alone is no bound."""
    stage = np.diff(shape.prefix, axis=2).max(axis=0)  # probe x warm-up
    last, other = stage[:, 0], stage[:, 1:].max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):  # whole numbers: exact quotients
        more = np.ceil(np.maximum(shape.layers - last, 0.0) / np.maximum(other, 1e-9) - 1e-9)
    return np.minimum(1 + more, shape.positions).astype(np.int64)


def _per_layer(shape: BatchShape) -> np.ndarray:
    """Per pipeline length ``p = 0 .. positions`` the least over kinds of
    ``(s_k - 1 - b(p, m_k)) G_k`` (0 for ``p < 2``)."""
    micro = [k.micro_batches for k in shape.kinds]
    weight = np.array([k.costs.layer_weight_grad for k in shape.kinds])
    shares = fill_shares(shape.schedule, micro)
    b = np.array([[zero_bubble_share(max(p, 2), m) for m in micro]
                  for p in range(shape.positions + 1)])  # rows 0 and 1 zeroed below
    rise = np.maximum((shares[None, :] - 1.0 - b) * weight[None, :], 0.0).min(axis=1)
    rise[:2] = 0.0
    return rise
