"""The places of a pipeline's stages as shared slots, for the joint knapsack of a one-DP shape's
root cells (:class:`~megatron_h2.planner.joint_root.CellBounds`).

The knapsack (:func:`~megatron_h2.planner.joint_root.kind_costs`) lets ``n`` stages of a kind
hold its ``n`` largest memory caps over the places of a pipeline, every kind at once: under
zero-bubble on the 100,000-chip 405B family member (seed 3, 16 micro-batches per replica) a T5
stage holds 8 units at the front of a pipeline and 2 at its back, and every type's block was
counted at the front. But each place holds one stage. Under zero-bubble a stage's caps depend
on its warm-up ``q`` (the places from the end) and its index from the front ``s`` only through
``min(q, m)`` and ``min(s, m - 1)`` (:func:`~megatron_h2.planner.held_activations.
zero_bubble_peaks`), and fall as either grows. So in every pipeline of at least ``p`` stages
(the fewest, :func:`~megatron_h2.planner.length_floor.fewest_stages`) a stage is at one of:

* a *back slot* ``q < m``, at most one stage each, holding at most the caps at
  ``(q, min(max(p - 1 - q, 0), m - 1))`` (its ``s`` is at least ``p - 1 - q``);
* else a *front slot* ``s < m - 1`` (so ``q >= m``), at most one stage each, the caps at
  ``(m, s)``;
* else the *base*, any number of stages, the caps at ``(m, m - 1)``.

(Back and front slots are capped at the most stages a pipeline has.) A Lagrangian price ``mu >= 0``
per slot used keeps the knapsack per type: a kind holding ``j`` slots pays ``mu j`` and holds
its ``j`` best slots' caps and base caps on its other stages; the knapsack's least, less
``mu`` times the slots there are, is a lower bound on every plan (each plan uses each slot at
most once), for every ``mu``; the best of a few is kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_h2.planner.length_floor import zero_bubble_caps

if TYPE_CHECKING:
    from megatron_h2.planner.bounds import BatchShape


def slot_caps(shape: BatchShape, stages: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Caps of the slots (kind x mode x slot) and of the base (kind x mode) of the plans of the
    one-DP zero-bubble ``shape`` with at least ``stages`` stages (cached); None for other
    schedules (1F1B's caps fall with the warm-up alone; measured, slots there raised no root of
    the 405B member and cost half a second a shape), a one-stage pipeline and MoE models."""
    if shape.schedule != "zero-bubble" or stages < 2 or shape.cost.model.is_moe or (
            not shape.uniform):
        return None
    cache = shape.__dict__.setdefault("_slot_caps", {})
    if stages not in cache:
        m = shape.kinds[0].micro_batches  # one DP degree: every kind's
        back, front = min(m, shape.positions), min(m - 1, shape.positions)  # no more places
        places = [(q, min(max(stages - 1 - q, 0), m - 1)) for q in range(back)]
        places += [(m, s) for s in range(front)] + [(m, m - 1)]
        known = shape.__dict__.setdefault("_place_caps", {})  # place -> kind x mode
        todo = sorted(set(places) - set(known))
        if todo:
            found = zero_bubble_caps(shape, list(range(len(shape.kinds))), todo, m, False)
            known.update({place: found[:, :, i] for i, place in enumerate(todo)})
        caps = np.stack([known[place] for place in places], axis=2)
        caps = np.minimum(caps, shape.layers)
        cache[stages] = (caps[:, :, :-1], caps[:, :, -1])
    return cache[stages]


def slot_buckets(slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Slot counts the knapsack takes at once, ``(a, b]`` each (``a = -1`` for 0): a kind that
    uses up to ``b`` slots holds at most its ``b`` best, and pays for ``a + 1`` (a lower bound
    for every count in the range)."""
    edges = [0, 1, 2, 3, 4]
    while edges[-1] < slots:
        edges.append(min(slots, edges[-1] + max(1, edges[-1] // 2)))
    high = np.array([e for e in edges if e <= slots])
    return np.concatenate(([-1], high[:-1])), high


def capped_places(
    slots: np.ndarray, base: np.ndarray, used: int, depth: int, per_stage: np.ndarray
) -> np.ndarray:
    """Caps per (cell, kind, mode, place) of a kind using at most ``used`` slots: its ``used``
    best slots (the others hold nothing), then ``depth`` places at the base caps, each at most
    ``per_stage`` (cell x kind) units."""
    best = -np.sort(-slots, axis=2)
    best[:, :, used:] = 0.0
    places = np.concatenate((best, np.repeat(base[:, :, None], depth, axis=2)), axis=2)
    return np.minimum(places[None], per_stage[:, :, None, None])


PRICES = 8
"""Slot prices tried per cell (geometric, from 1% of a slot's share of the cell's fill and
links up to all of it); the largest bound is kept."""


def slot_fill_links(
    shape: BatchShape,
    probes: np.ndarray,
    per_stage: np.ndarray,
    rises: np.ndarray,
    stages: np.ndarray,
    joint: np.ndarray,
) -> np.ndarray:
    """Per cell (its probe, per-stage unit caps ``per_stage`` cell x kind, fill ``rises`` kind x
    cell, fewest ``stages``, and the knapsack's value without slots ``joint``): the summed fill
    plus links with the stages' places as slots (module docstring), the best over
    :data:`PRICES` prices; -inf where the places are not slots."""
    from megatron_h2.planner.joint_root import kind_costs  # joint_root uses this module
    from megatron_h2.planner.uniform_root import least_over_types

    out = np.full(len(probes), -np.inf)
    for count in np.unique(stages):
        if (caps := slot_caps(shape, int(count))) is None:
            continue
        slots, base = caps
        rows = np.flatnonzero(stages == count)
        low, high = slot_buckets(slots.shape[2])
        tables: list[list[np.ndarray]] = [[] for _ in shape.types]  # type x bucket
        for used in high:
            held = capped_places(slots, base, int(used), shape.positions, per_stage[rows])
            for t, chip in enumerate(shape.types):
                tables[t].append(np.min([kind_costs(shape, k, probes[rows], held, rises[k, rows])
                                         for k in shape.kinds_of[chip]], axis=0))
        charge = (low + 1).astype(np.float64)  # slots paid per bucket (its fewest)
        share = np.where(np.isfinite(joint[rows]), np.maximum(joint[rows], 0.0), 0.0)
        share = share / max(slots.shape[2], 1)
        for mu in np.geomspace(0.01, 1.0, PRICES)[:, None] * share[None, :]:
            priced = [np.min([table + mu[:, None] * c for table, c in zip(per, charge)], axis=0)
                      for per in tables]
            value = least_over_types(shape, priced) - mu * slots.shape[2]
            out[rows] = np.maximum(out[rows], value)
    return out
