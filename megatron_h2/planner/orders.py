"""Per-stage action orders of the pipeline schedules, and the activations they keep in flight.

A stage of a ``p``-stage pipeline runs ``m`` micro-batches through its ``V`` model chunks
(virtual stages) in a fixed order of actions ``(kind, chunk, micro_batch)``:

* ``"F"``: the forward of one chunk for one micro-batch;
* ``"B"``: the backward; under ``1f1b`` and ``interleaved`` the whole backward, under
  ``zero-bubble`` only the input-gradient part (what the previous stage waits for);
* ``"W"``: ``zero-bubble`` only: the weight-gradient part of a backward, run later to fill
  the bubble.

The orders are the runtime's own (:mod:`megatron_h2.pipeline_orders`):

* ``1f1b``: Megatron's non-interleaved schedule: ``min(p - s - 1, m)`` warm-up forwards, then
  one forward one backward, then the remaining backwards.
* ``interleaved``: Megatron's interleaved schedule (``m % p == 0``, ``p >= 2``). The ``m V``
  chunk-micro-batches are numbered ``k``; forward ``k`` runs chunk ``(k mod pV) div p`` on
  micro-batch ``(k div pV) p + k mod p``, backward ``k`` the same micro-batch on chunk
  ``V - 1 - (k mod pV) div p``. Stage ``s`` runs ``min(2 (p - s - 1) + (V - 1) p, m V)`` warm-up
  forwards, then forward ``k + warm-up`` and backward ``k`` alternately, then the remaining
  backwards. It is what ``torch.distributed.pipelining.ScheduleInterleaved1F1B`` computes
  when ``m`` is a multiple of ``p``.
* ``zero-bubble``: ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023) in the order of
  ``torch.distributed.pipelining.ScheduleInterleavedZeroBubble`` with one chunk per stage:
  ``min(p - s - 1, m)`` warm-up forwards, then forward and input-backward alternately; stage
  ``s`` runs the weight-gradient work of its oldest micro-batch after each input-backward
  from its ``s + 1``-th steady step on (so it keeps up to ``s`` weight gradients deferred),
  and the deferred ones at the end. Its peak activation memory is 1F1B's on stage 0 and at
  most ``p`` micro-batches on every stage.

:func:`held_states` walks an order and returns the peak states of what the stage holds:
per chunk, the micro-batches between forward and backward (their activations) and, under
``zero-bubble``, between backward and weight-gradient work (the inputs of the weight
gradients). A stage's peak memory is a maximum over these states of a positive weighted sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from megatron_h2.errors import ConfigError
from megatron_h2.pipeline_orders import check_micro_batches, schedule_order

Action = tuple[str, int, int]
"""(kind "F" | "B" | "W", chunk, micro-batch)."""

State = tuple[tuple[int, ...], tuple[int, ...]]
"""Per chunk: micro-batches between F and B, and between B and W (zero-bubble)."""


def schedule_problem(schedule: str, stages: int, micro_batches: int, chunks: int) -> str | None:
    """Why the planner cannot use ``schedule`` for this pipeline (a sentence saying what to
    change), or None: the runtime's rules (:func:`~megatron_h2.pipeline_orders.
    check_micro_batches`), and zero-bubble modelled with one chunk per stage (ZB-H1)."""
    if schedule == "zero-bubble" and chunks != 1:
        return "the zero-bubble schedule (ZB-H1) runs one model chunk per stage"
    try:
        check_micro_batches(schedule, stages, chunks, micro_batches)
    except ConfigError as exc:
        return str(exc)
    return None


def check_schedule(schedule: str, stages: int, micro_batches: int, chunks: int) -> None:
    """Raise ConfigError when ``schedule`` cannot run this pipeline."""
    problem = schedule_problem(schedule, stages, micro_batches, chunks)
    if problem is not None:
        raise ConfigError(problem)


def stage_order(
    schedule: str,
    stages: int,
    micro_batches: int | Sequence[int],
    chunks: int,
    stage: int,
    warmup: int | None = None,
) -> list[Action]:
    """The order of actions of ``stage`` (or of one of its DP replicas, given its micro-batch
    ids and :func:`~megatron_h2.pipeline_orders.routed_warmups`): the runtime's own
    (:func:`~megatron_h2.pipeline_orders.schedule_order`), as ``(kind, chunk, micro_batch)``."""
    ids = range(micro_batches) if isinstance(micro_batches, int) else micro_batches
    check_schedule(schedule, stages, len(ids), chunks)
    order = schedule_order(schedule, stage, stages, chunks, ids, warmup)
    return [(a.kind, a.chunk, a.micro_batch) for a in order]


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
    replica of a stage with its own DP degree, :func:`~megatron_h2.pipeline_orders.
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
