"""The fewest stages a one-DP plan of a batch shape can have, from the memory its stages hold.

A stage at position ``q`` from the end of a ``p``-stage pipeline holds at most ``cap_k(q, p)``
units in any recompute mode, and, where the slowest folded steady term is at most a probe ``g``,
at most ``g / (F u_k)`` (its kind's time cap). Under 1F1B and interleaving the memory cap
depends on ``q`` alone (the bound tables' :attr:`~megatron_h2.planner.bounds.BatchShape.mem_caps`,
already optimistic over ``p``); under zero-bubble a stage also holds the deferred weight-gradient
inputs of up to ``s + 1`` micro-batches, ``s = p - 1 - q`` its index from the front, so its cap
falls as the pipeline grows (:func:`~megatron_h2.planner.held_activations.zero_bubble_peaks`).
A ``p``-stage pipeline holds at most the largest assignment of its positions to stage kinds,
each kind used at most its most stages: bounded above by the assignment's linear programme's
dual, ``sum_q max(0, max_k (c_kq - y_k)) + sum_k y_k n_k`` for any ``y >= 0`` (a few subgradient
steps pick ``y``; any ``y`` gives a valid bound). Where that is below the layers, no plan has
``p`` stages; the least ``p`` where it is not bounds every plan's stage count below.

The bound tables counted the layers over every stage that may exist at warm-ups ``0, 1, ...``
and priced the links of the fewest stages at one stage's largest capacity; a 405B model on
chips with 16-192 GB needs 30-120 stages at the probes near its plans, and zero-bubble's share
``1 + b`` of the weight-gradient work falls with them (:mod:`.zero_bubble_fill`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_h2.planner.cost_model import MODES
from megatron_h2.planner.held_activations import zero_bubble_peaks
from megatron_h2.planner.shape_memory import _most_units

if TYPE_CHECKING:
    from megatron_h2.planner.bounds import BatchShape

STEPS = 24
"""Subgradient steps of the assignment bound's dual (each gives a valid bound; the least is
kept)."""


def length_caps(shape: BatchShape, stages: int, most: bool = False) -> np.ndarray:
    """Most units per (kind, recompute mode, position from the end ``q < stages``) of a stage of
    a ``stages``-stage pipeline (no embedding or head: an upper bound; cached); with ``most``
    one mode only, the one that holds the most (kind x 1 x position)."""
    cache = shape.__dict__.setdefault("_length_caps", {})
    if (stages, most) not in cache:
        if shape.schedule != "zero-bubble":
            caps = shape.mem_caps[:, :, :stages]
            caps = caps.max(axis=1, keepdims=True) if most else caps
        else:
            caps = np.zeros((len(shape.kinds), 1 if most else len(MODES), stages))
            for m in sorted({k.micro_batches for k in shape.kinds}):
                kinds = [i for i, k in enumerate(shape.kinds) if k.micro_batches == m]
                places = [(q, stages - 1 - q) for q in range(stages)]
                caps[kinds] = zero_bubble_caps(shape, kinds, places, m, most)
        cache[stages, most] = np.minimum(caps, shape.layers)
    return cache[stages, most]


def zero_bubble_caps(
    shape: BatchShape, kinds: list[int], places: list[tuple[int, int]], m: int, most: bool
) -> np.ndarray:
    """Most units of a stage of ``kinds`` (``m`` micro-batches per replica) under zero-bubble at
    each of ``places``: (warm-up ``q``, index from the front ``s``; its deferred inputs grow
    with ``s``), no embedding or head: kind x mode (one with ``most``, :func:`length_caps`) x
    place."""
    pairs = [_most_active(zero_bubble_peaks(q, m, s)) for q, s in places]
    width = max(len(p) for p in pairs)
    padded = np.array([p + [p[0]] * (width - len(p)) for p in pairs], dtype=np.float64)
    costs = [shape.kinds[i].costs for i in kinds]
    act = np.array([c.layer_activation for c in costs])[:, :, None, None]  # kind x mode
    act = act.min(axis=1, keepdims=True) if most else act  # the least held holds the most
    keep = np.array([c.layer_weight_inputs for c in costs])[:, None, None, None]
    held = (padded[None, None, :, :, 0] * act + padded[None, None, :, :, 1] * keep).max(axis=3)
    static = np.array([shape.chunks * c.layer_static for c in costs])[:, None, None]
    room = np.array([c.capacity - c.working for c in costs])[:, None, None]
    return _most_units(room, static + held)


def _most_active(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (active, deferred) peak states that can hold the most bytes, ``A act + D keep`` with
    ``act, keep >= 0``: the vertices of the states' upper hull towards larger ``A`` and ``D``
    (every other state holds no more than one of them), so that a stage of thousands of
    micro-batches costs a few states (exact integers)."""
    if len(pairs) <= 8:
        return pairs
    hull: list[tuple[int, int]] = []  # (D, A), D rising, A falling
    for deferred, active in sorted((d, a) for a, d in pairs):
        while hull and hull[-1][1] <= active:  # fewer deferred and no more active
            hull.pop()
        while len(hull) >= 2 and (hull[-1][0] - hull[-2][0]) * (active - hull[-2][1]) - (
                hull[-1][1] - hull[-2][1]) * (deferred - hull[-2][0]) >= 0:
            hull.pop()  # on or below the chord of its neighbours
        hull.append((deferred, active))
    return [(active, deferred) for deferred, active in hull]


def assignment_bound(values: np.ndarray, most: np.ndarray) -> float:
    """An upper bound on ``sum_q values[k_q, q]`` over assignments of a kind ``k_q`` (or none) to
    each position, kind ``k`` used at most ``most[k]`` times (``values`` >= 0, kind x position):
    the least dual value over :data:`STEPS` subgradient steps."""
    price = np.zeros(len(most))
    best = float(np.maximum(values.max(axis=0), 0.0).sum())  # y = 0: counts ignored
    top = float(values.max(initial=0.0))
    for step in range(STEPS):
        reduced = values - price[:, None]
        gain = reduced.max(axis=0)
        best = min(best, float(np.maximum(gain, 0.0).sum() + price @ most))
        picked = reduced.argmax(axis=0)[gain > 0]
        used = np.bincount(picked, minlength=len(most))
        price = np.maximum(price + (used - most) * top / (2.0 + step), 0.0)
    return best


def fewest_stages(shape: BatchShape, probes: np.ndarray) -> np.ndarray:
    """Per probe (ascending), the fewest stages of any plan of the one-DP ``shape`` whose slowest
    folded steady term is at most the probe (``positions + 1`` where none holds the layers)."""
    first = max(shape.shortest(1), 1)  # the fewest stages the schedule can run
    most = np.array([k.max_stages for k in shape.kinds], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        timed = np.where(shape.unit[:, None, :] > 0,
                         np.floor(probes[None, :, None] / shape.unit[:, None, :]), np.inf)
    out = np.full(len(probes), shape.positions + 1, dtype=np.int64)
    single = np.minimum(shape.mem_caps.max(axis=2), timed[:, -1, :]).max()  # any warm-up's most
    stages = max(first, int(np.ceil(shape.layers / max(single, 1e-9) - 1e-9)))
    for index in range(len(probes) - 1, -1, -1):  # fewer stages fit at larger probes
        while stages <= shape.positions:
            if shape.schedule == "zero-bubble":  # the time caps' most, then the memory's
                caps = np.minimum(length_caps(shape, stages, True)[:, 0],
                                  timed[:, index, :].max(axis=1)[:, None])
            else:
                caps = np.minimum(length_caps(shape, stages), timed[:, index, :, None]).max(axis=1)
            caps = np.clip(caps, 0.0, shape.layers)  # kind x position
            if caps.max(axis=0).sum() >= shape.layers and assignment_bound(
                    caps, most) >= shape.layers - 1e-9:
                break
            stages += 1
        out[index] = stages
    return out


def position_caps(shape: BatchShape, stages: np.ndarray) -> np.ndarray:
    """Memory caps per (probe, kind, mode, warm-up ``0 .. depth - 1``) of every plan with at least
    ``stages`` stages (per probe): :func:`length_caps` of that many stages in front of the table's
    (caps fall as the pipeline grows, so they bound every longer one)."""
    out = np.repeat(shape.mem_caps[None], len(stages), axis=0)
    for index, count in enumerate(stages):
        if shape.schedule == "zero-bubble" and count <= shape.positions:
            out[index, :, :, :count] = np.minimum(out[index, :, :, :count],
                                                  length_caps(shape, int(count)))
    return out


def stage_links(shape: BatchShape, probes: np.ndarray, stages: np.ndarray) -> np.ndarray:
    """Per probe, a lower bound on the link time of every plan of the one-DP ``shape`` whose
    slowest folded steady term is at most the probe and that has at least ``stages`` stages
    (per probe, :func:`fewest_stages`): all but one with a link of at least the cheapest of the
    chip types that can hold a unit there (inf: more stages than positions)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        held = np.where(shape.unit[:, None, :] > 0,
                        np.floor(probes[None, :, None] / shape.unit[:, None, :]), np.inf)
    held = np.minimum(held, shape.mem_caps.max(axis=2)[:, None, :]).max(axis=2)  # kind x probe
    price = np.full(len(probes), np.inf)
    for chip in shape.types:
        holds = held[shape.kinds_of[chip]].max(axis=0) >= 1
        price = np.where(holds, np.minimum(price, shape.type_link[chip]), price)
    links = np.maximum(stages - 1, 0) * np.where(np.isfinite(price), price, 0.0)
    return np.where(stages > shape.positions, np.inf, links)
