"""The places of a pipeline's stages as slots, for the joint knapsack of a one-DP shape's root
cells (:class:`~megatron_h2.planner.joint_root.CellBounds`, :mod:`.last_cells`).

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

(Back and front slots are capped at the most stages a pipeline has.) So a block of ``n`` stages
holds at most its ``n`` best slots' caps (each once, then the base's): :mod:`.last_cells`
takes them at the length of a pipeline at least as long as the block.

A Lagrangian price per slot used (each kind its ``j`` best slots, the knapsack's least less the
price of every slot) bounded the cells from 2026-12-03 until the blocks' places by their own
length, the block that ends the pipeline and the stage count kept (:mod:`.last_cells`,
:mod:`.stage_count`) took its place: on the 100,000-chip 70B and 405B family members and on the
random clusters of the cells' tests it raised no cell above them.
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
