"""The activations a pipeline stage keeps in flight under its schedule's order.

The orders themselves (which forward ``F``, backward ``B`` and, under zero-bubble, deferred
weight-gradient ``W`` of which micro-batch and model chunk a stage runs when) are the
runtime's own, in :mod:`megatron_h2.plan.orders`. :func:`held_states` walks a stage's order and
returns the peak states of what the stage holds: per chunk, the micro-batches between forward
and backward (their activations) and, under ``zero-bubble``, between backward and
weight-gradient work (the inputs of the weight gradients). A stage's peak memory is a maximum
over these states of a positive weighted sum.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from megatron_h2.plan.orders import (  # noqa: F401 - re-exported for the planner's users
    Action,
    check_schedule,
    schedule_problem,
    stage_order,
)

State = tuple[tuple[int, ...], tuple[int, ...]]
"""Per chunk: micro-batches between F and B, and between B and W (zero-bubble)."""


@lru_cache(maxsize=8192)
def held_states(
    schedule: str,
    stages: int,
    micro_batches: int,
    chunks: int,
    stage: int,
    warmup: int | None = None,
) -> tuple[State, ...]:
    """The Pareto-maximal states of what ``stage`` holds over its order (see the module doc);
    ``warmup``: the stage's warm-up forwards when they are not the schedule's own rule (a DP
    replica of a stage with its own DP degree, :func:`~megatron_h2.plan.orders.
    routed_warmups`), ``micro_batches`` then the replica's.

    Every state the stage passes through is dominated (component-wise) by one of these, so the
    peak of any memory that grows with the held counts is reached in one of them.
    """
    if schedule == "1f1b":  # one state: the warm-up plus one micro-batch
        warm = stages - stage - 1 if warmup is None else warmup
        return (((min(warm + 1, micro_batches),), (0,)),)
    order = stage_order(schedule, stages, micro_batches, chunks, stage, warmup)
    active, deferred = [0] * chunks, [0] * chunks
    split = schedule == "zero-bubble"
    seen: set[tuple[int, ...]] = set()
    for index, (kind, chunk, _) in enumerate(order):
        if kind == "F":
            active[chunk] += 1
        elif kind == "B":
            active[chunk] -= 1
            deferred[chunk] += 1 if split else 0
        else:
            deferred[chunk] -= 1
        following = order[index + 1][0] if index + 1 < len(order) else ""
        # a forward next dominates this state; a plain backward or a weight step only lowers it
        if following != "F" and (kind == "F" or (kind == "B" and split)):
            seen.add(tuple(active) + tuple(deferred))
    flat = np.array(sorted(seen))
    covers = (flat[:, None, :] >= flat[None, :, :]).all(axis=2)
    exceeds = (flat[:, None, :] > flat[None, :, :]).any(axis=2)
    keep = ~(covers & exceeds).any(axis=0)
    return tuple(
        (tuple(int(x) for x in row[:chunks]), tuple(int(x) for x in row[chunks:]))
        for row in flat[keep]
    )


Totals = tuple[int, int, int, int, int]
"""(active, deferred, head active, head deferred, embedding deferred): the held counts summed over
a stage's chunks, and those of the head (last chunk of the last stage) and the embedding (first
chunk of the first stage); 0 on stages that do not hold them."""


@lru_cache(maxsize=16384)
def held_totals(
    schedule: str,
    stages: int,
    micro_batches: int,
    chunks: int,
    stage: int,
    warmup: int | None = None,
) -> tuple[Totals, ...]:
    """:func:`held_states` reduced to what the memory of a stage with equal chunks depends on
    (Pareto-maximal; closed forms where the walk is not needed)."""
    p, m, s = stages, micro_batches, stage
    last, first = s == p - 1, s == 0
    warm = p - s - 1 if warmup is None else warmup
    if schedule == "1f1b":
        held = min(warm + 1, m)
        return ((held, 0, held if last else 0, 0, 0),)
    if schedule == "interleaved" and not last:  # one peak: the warm-up plus one
        if warmup is None:
            warmup = 2 * (p - s - 1) + (chunks - 1) * p
        warmup = min(warmup, m * chunks)
        return ((min(warmup + 1, m * chunks), 0, 0, 0, 0),)
    if schedule != "zero-bubble":
        pairs = [(sum(a), 0, a[-1], 0) for a, _ in held_states(schedule, p, m, chunks, s, warmup)]
        return _pareto([(a, d, head, hd, 0) for a, d, head, hd in pairs])
    # the totals grow with (active, deferred) alone: their Pareto set is that of the pairs
    kept, most = [], -1
    for a, d in sorted(set(zero_bubble_peaks(warm, m, s)), reverse=True):
        if d > most:  # nothing with as many active holds as many deferred
            kept.append((a, d, a if last else 0, d if last else 0, d if first else 0))
            most = d
    return tuple(sorted(kept))


def zero_bubble_peaks(warmup: int, m: int, s: int) -> list[tuple[int, int]]:
    """Candidate peak (active, deferred) states of stage ``s`` under zero-bubble with ``warmup``
    warm-up forwards (its order in closed form: warm-up, steady forward / backward / weight,
    cool-down backward / weight)."""
    warmup = min(warmup, m)
    steady = m - warmup
    if steady == 0:  # all forwards first, then backwards (weight work from step s on)
        return [(m, 0)] + [(m - 1 - c, min(c, s) + 1) for c in range(m)]
    late = min(steady - 1, s)  # weight steps deferred at the last steady forward
    pairs = [(warmup + 1, late), (warmup, late + 1)]  # after that forward, after its backward
    pairs += [(warmup - 1 - c, min(steady + c, s) + 1) for c in range(warmup)]
    return pairs


def _pareto(items: list[Totals]) -> tuple[Totals, ...]:
    flat = np.array(sorted(set(items)))
    covers = (flat[:, None, :] >= flat[None, :, :]).all(axis=2)
    exceeds = (flat[:, None, :] > flat[None, :, :]).any(axis=2)
    keep = ~(covers & exceeds).any(axis=0)
    return tuple(tuple(int(x) for x in row) for row in flat[keep])  # type: ignore[misc]


def peak_in_flight(
    schedule: str,
    stages: int,
    micro_batches: int,
    chunks: int,
    stage: int,
    warmup: int | None = None,
) -> int:
    """Most chunk-micro-batches whose forward has run and backward has not (the warm-up count
    plus one, capped by the work there is)."""
    states = held_states(schedule, stages, micro_batches, chunks, stage, warmup)
    return max(sum(active) for active, _ in states)
