"""Pipeline schedules as data: the order in which one rank runs its forwards and backwards.

A rank's schedule is a list of :class:`Action` s ``(kind, chunk, micro_batch)``:

* ``F``: forward of one micro-batch through one model chunk;
* ``B``: its backward. Under 1F1B and interleaved 1F1B the whole backward; under zero-bubble only
  the gradient of the chunk's input (what the previous stage waits for);
* ``W``: zero-bubble only: the weight gradients of an earlier ``B``, deferred to fill a bubble.

Every order is computed from the rank's stage ``s``, the pipeline size ``p``, its model chunks
``V`` and the list of micro-batch ids it runs, never from a count shared by the job, so a stage
whose data-parallel replicas split the micro-batches can compute its own order. Virtual stage
``c * p + s`` is chunk ``c`` of stage ``s`` (Megatron's interleaving); its input comes from virtual
stage ``c * p + s - 1`` (the last stage's chunk ``c - 1`` for ``s = 0``).

* :func:`one_f_one_b`: Megatron's non-interleaved 1F1B (``min(p - s - 1, m)`` warm-up forwards).
* :func:`interleaved`: Megatron's interleaved 1F1B: micro-batches go through the chunks in
  groups of ``p``; ``(p - s - 1) x 2 + (V - 1) x p`` warm-up forwards; needs ``m`` to be a
  multiple of ``p`` (Megatron's rule). When ``m == p`` Megatron runs every forward first on
  every stage; here the same warm-up rule applies (torch's order, what the planner simulates):
  fewer activations in flight on later stages, the same step time on balanced stages.
* :func:`zero_bubble`: ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023) for ``V = 1``
  and its interleaved form for ``V > 1``: 1F1B with the backward split into ``B`` and ``W``,
  stage ``s`` deferring its ``W`` s by ``s`` steps so that they fill the cool-down bubble, at
  1F1B's peak activation memory (``p`` micro-batches in flight on every stage, as on 1F1B's first
  stage).

Stages with their own data-parallel degrees (``DP_s``): replica ``r`` of stage ``s`` runs the
micro-batches ``j`` with ``j mod DP_s == r`` (:func:`replica_micro_batches`) in the 1F1B or
zero-bubble order of its own list, with :func:`replica_warmup` warm-up forwards (Megatron's
``p - s - 1`` per replica can hang when the DP degrees differ). Micro-batch ``j`` goes through
replica ``j mod DP_s`` of every stage; each pair of neighbouring replicas exchanges its common
micro-batches in increasing order both ways. The interleaved orders group a replica's
micro-batches by ``p``, which does not line up across stages of different DP: with differing DP
degrees they can hang, so they are for uniform DP only.

The orders are written here rather than taken from ``torch.distributed.pipelining``, whose
schedule classes compute them inside objects bound to ``PipelineStage`` s and one job-wide
micro-batch count, through private helpers. They follow the same rules:
``tests/test_pipeline_orders.py`` checks the interleaved and zero-bubble orders against torch's
``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble`` helpers, and every order against
:func:`check_orders`, which replays the orders of all stages with our point-to-point discipline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_h2.errors import ConfigError

SCHEDULES = ("1f1b", "interleaved", "zero-bubble")


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: ``kind`` (F, B or W) of ``micro_batch`` on ``chunk``."""

    kind: str
    chunk: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")


def check_micro_batches(schedule: str, stages: int, chunks: int, micro_batches: int) -> None:
    """Megatron's rules on the micro-batch count ``m`` (per DP replica); one-line ConfigError.

    Virtual stages need at least two pipeline stages; the interleaved schedules (interleaved
    1F1B, and zero-bubble with ``V > 1``) need ``m`` to be a multiple of the pipeline size.
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, got "
                          f"{schedule!r}")
    if chunks > 1 and stages < 2:
        raise ConfigError(f"{chunks} virtual pipeline stages per stage need at least 2 pipeline "
                          "stages; use --pipeline-model-parallel-size 2 or more, or no virtual "
                          "stages")
    if schedule == "1f1b" and chunks > 1:
        raise ConfigError("the 1f1b schedule runs one model chunk per stage; use "
                          "--pipeline-schedule interleaved (or zero-bubble) with virtual stages")
    if schedule == "interleaved" and chunks == 1:
        raise ConfigError("the interleaved schedule needs virtual pipeline stages: give "
                          "--virtual-pipeline-model-parallel-size or "
                          "--num-layers-per-virtual-pipeline-stage")
    if micro_batches < 1:
        raise ConfigError(f"a step needs at least one micro-batch per replica, got "
                          f"{micro_batches}")
    if chunks > 1 and micro_batches % stages:
        raise ConfigError(
            f"the {schedule} schedule with virtual stages needs the number of micro-batches per "
            f"replica (global batch / (micro-batch x DP) = {micro_batches}) to be a multiple of "
            f"the pipeline size {stages}; change the global batch size")


def replica_warmup(stage: int, stage_dps: Sequence[int]) -> int:
    """Warm-up forwards of each DP replica of ``stage`` under 1F1B and zero-bubble when the
    stages have their own DP degrees ``stage_dps`` (``p - s - 1``, Megatron's, when every stage
    has the same DP).

    Replica ``r`` of stage ``s`` runs the micro-batches ``j = r (mod DP_s)``; with ``w_s`` warm-up
    forwards it runs the forward of micro-batch ``j'`` before the backward of its ``j`` exactly
    when ``j' <= j + G_s``, ``G_s = w_s DP_s`` (its lead, in micro-batch ids). The rule gives
    each stage the smallest lead that exceeds the next stage's by one micro-batch per replica of
    the next stage: ``G_{p-1} = 0``, ``G_s = DP_s ceil((G_{s+1} + DP_{s+1}) / DP_s)``, as
    Megatron's ``G_s = (p - s - 1) DP`` does under uniform DP. Since ``G_s`` falls along the
    pipeline, every backward waits only for forwards and backwards of smaller micro-batch ids,
    so no order can hang (Megatron's ``p - s - 1`` per replica can: DP 1, 1, 2, 2, 1). With a
    smaller lead, a stage would hold back the forward that a replica of the next stage waits for
    until a backward of another replica comes back: a stage of DP 1 feeding one of DP 4 that
    leads by only one micro-batch takes twice the time in the simulator.
    """
    lead = 0
    for later in range(len(stage_dps) - 1, stage, -1):
        lead = stage_dps[later - 1] * -(-(lead + stage_dps[later]) // stage_dps[later - 1])
    return lead // stage_dps[stage]


def replica_micro_batches(total: int, data_parallel_size: int, replica: int) -> range:
    """The micro-batches of DP ``replica`` of a stage of ``data_parallel_size`` replicas, out of
    ``total`` per step: ``replica, replica + DP, ...``."""
    return range(replica, total, data_parallel_size)


def one_f_one_b(stage: int, stages: int, micro_batches: Sequence[int],
                warmup: int | None = None) -> list[Action]:
    """Megatron's non-interleaved 1F1B order of one stage (``warmup`` forwards first: by default
    ``p - s - 1``, see :func:`replica_warmup` for stages with their own DP degree)."""
    mbs = list(micro_batches)
    warmup = min(stages - stage - 1 if warmup is None else warmup, len(mbs))
    order = [Action("F", 0, j) for j in mbs[:warmup]]
    for i, j in enumerate(mbs[warmup:]):
        order += [Action("F", 0, j), Action("B", 0, mbs[i])]
    return order + [Action("B", 0, j) for j in mbs[len(mbs) - warmup:]]


def _virtual(k: int, stages: int, chunks: int, mbs: Sequence[int],
             backward: bool) -> tuple[int, int]:
    """(chunk, micro-batch) of the k-th forward (or backward) of the interleaved orders:
    groups of ``stages`` micro-batches go through chunk 0, 1, ... (backward: V - 1, ...)."""
    group, within = divmod(k, stages * chunks)
    chunk = within // stages
    return (chunks - 1 - chunk if backward else chunk), mbs[group * stages + k % stages]


def interleaved(stage: int, stages: int, chunks: int, micro_batches: Sequence[int],
                warmup: int | None = None) -> list[Action]:
    """Megatron's interleaved 1F1B order of one stage (see the module docstring)."""
    mbs = list(micro_batches)
    if len(mbs) % stages:
        raise ConfigError(f"the interleaved schedule needs a multiple of {stages} micro-batches, "
                          f"got {len(mbs)}")
    total = len(mbs) * chunks
    if warmup is None:
        warmup = (stages - stage - 1) * 2 + (chunks - 1) * stages
    warmup = min(warmup, total)

    def fwd(k: int) -> Action:
        return Action("F", *_virtual(k, stages, chunks, mbs, backward=False))

    def bwd(k: int) -> Action:
        return Action("B", *_virtual(k, stages, chunks, mbs, backward=True))

    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [fwd(warmup + k), bwd(k)]
    return order + [bwd(k) for k in range(total - warmup, total)]


def zero_bubble(stage: int, stages: int, chunks: int, micro_batches: Sequence[int],
                warmup: int | None = None) -> list[Action]:
    """ZB-H1 (``chunks == 1``) or interleaved zero-bubble order of one stage.

    ``(V - 1) x p + (p - s - 1)`` warm-up forwards, then one forward and one input-gradient
    backward per step; from step ``s`` on each step also runs the weight gradients of the oldest
    backward not yet done; the remaining ones follow the last backward.
    """
    mbs = list(micro_batches)
    if chunks > 1 and len(mbs) % stages:
        raise ConfigError(f"the interleaved zero-bubble schedule needs a multiple of {stages} "
                          f"micro-batches, got {len(mbs)}")
    total = len(mbs) * chunks
    if warmup is None:
        warmup = (chunks - 1) * stages + stages - stage - 1
    warmup = min(warmup, total)
    forwards = [Action("F", *_virtual(k, stages, chunks, mbs, backward=False))
                for k in range(total)]
    backwards = [Action("B", *_virtual(k, stages, chunks, mbs, backward=True))
                 for k in range(total)]
    order = forwards[:warmup]
    weights = 0
    for k in range(total):
        if warmup + k < total:
            order.append(forwards[warmup + k])
        order.append(backwards[k])
        if k >= stage:  # W of the oldest backward, ``stage`` steps later
            order.append(Action("W", backwards[weights].chunk, backwards[weights].micro_batch))
            weights += 1
    return order + [Action("W", b.chunk, b.micro_batch) for b in backwards[weights:]]


def forward_order(stage: int, stages: int, chunks: int,
                  micro_batches: Sequence[int]) -> list[Action]:
    """Forwards only (evaluation): the forward order of the training schedule."""
    mbs = list(micro_batches)
    if chunks == 1:
        return [Action("F", 0, j) for j in mbs]
    return [Action("F", *_virtual(k, stages, chunks, mbs, backward=False))
            for k in range(len(mbs) * chunks)]


def schedule_order(schedule: str, stage: int, stages: int, chunks: int,
                   micro_batches: Sequence[int], warmup: int | None = None) -> list[Action]:
    """The order of ``schedule`` (``1f1b``, ``interleaved`` or ``zero-bubble``) for one stage;
    ``warmup``: forwards before the first backward (default: the schedule's own rule)."""
    check_micro_batches(schedule, stages, chunks, len(micro_batches))
    if schedule == "1f1b":
        return one_f_one_b(stage, stages, micro_batches, warmup)
    if schedule == "interleaved":
        return interleaved(stage, stages, chunks, micro_batches, warmup)
    return zero_bubble(stage, stages, chunks, micro_batches, warmup)


# ------------------------------------------------------------------------------ verification
def _needs(action: Action, stage: int, stages: int, chunks: int) -> tuple | None:
    """The (kind, virtual stage, micro-batch) an action waits for, or None."""
    v = action.chunk * stages + stage
    if action.kind == "F":
        return None if v == 0 else ("F", v - 1, action.micro_batch)
    if action.kind == "W":
        return ("B", v, action.micro_batch)
    if v == stages * chunks - 1:
        return ("F", v, action.micro_batch)
    return ("B", v + 1, action.micro_batch)


def _channel(action: Action, stage: int, stages: int, chunks: int,
             sending: bool) -> tuple | None:
    """The boundary, direction and message id an action sends on (or receives from)."""
    v = action.chunk * stages + stage
    if action.kind == "W":
        return None
    forward = action.kind == "F"
    # forward sends / backward receives cross boundary v -> v + 1; the others v - 1 -> v
    downstream = forward == sending
    edge = v if downstream else v - 1
    if edge < 0 or edge >= stages * chunks - 1:
        return None
    boundary = edge % stages  # stage boundary s -> s + 1 (p - 1: the wrap-around one)
    return (boundary, action.kind, action.micro_batch, edge // stages)


def check_orders(orders: Sequence[Sequence[Action]], chunks: int) -> None:
    """Replay every stage's order as the runtime runs it and raise AssertionError on a schedule
    that could hang or mismatch messages.

    The runtime runs each rank's actions in order; an action waits only for its own input (the
    neighbour's forward / backward, or its own forward or backward), sends never wait, and each
    boundary carries its messages in order (first in, first out), so every receiver must
    consume them in the order the sender sends them. Checks: every (kind, chunk, micro-batch)
    appears exactly once where it should, the replay finishes, and sends and receives match on
    every boundary and direction.
    """
    stages = len(orders)
    work = {(a.chunk, a.micro_batch) for a in orders[0] if a.kind == "F"}
    assert {c for c, _ in work} == set(range(chunks)), "not every chunk runs"
    kinds = {a.kind for a in orders[0]}
    for s, order in enumerate(orders):
        assert len(set(order)) == len(order), f"stage {s} runs an action twice"
        for kind in "FBW":
            mine = {(a.chunk, a.micro_batch) for a in order if a.kind == kind}
            assert mine == (work if kind in kinds else set()), \
                f"stage {s} runs {kind} of other (chunk, micro-batch) pairs than its forwards"
    done: set[tuple] = set()
    pointer = [0] * stages
    progress = True
    while progress:
        progress = False
        for s in range(stages):
            while pointer[s] < len(orders[s]):
                action = orders[s][pointer[s]]
                need = _needs(action, s, stages, chunks)
                if need is not None and need not in done:
                    break
                done.add((action.kind, action.chunk * stages + s, action.micro_batch))
                pointer[s] += 1
                progress = True
    stuck = [f"stage {s} at {orders[s][pointer[s]]}" for s in range(stages)
             if pointer[s] < len(orders[s])]
    assert not stuck, f"the schedule deadlocks: {', '.join(stuck)}"
    sent: dict[tuple, list] = {}
    received: dict[tuple, list] = {}
    for s, order in enumerate(orders):
        for action in order:
            for sending, log in ((True, sent), (False, received)):
                channel = _channel(action, s, stages, chunks, sending)
                if channel is not None:
                    log.setdefault(channel[:2], []).append(channel[2:])
    assert sent == received, "a boundary's receiver consumes messages in another order than " \
                             "its sender sends them"
