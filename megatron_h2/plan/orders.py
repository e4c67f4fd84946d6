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

The orders are written here rather than taken from ``torch.distributed.pipelining``, whose
schedule classes compute them inside objects bound to ``PipelineStage`` s and one job-wide
micro-batch count, through private helpers. They follow the same rules:
``tests/unit/plan/test_pipeline_orders.py`` checks the interleaved and zero-bubble orders
against torch's ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble`` helpers, and
every order against :func:`check_orders`, which replays the orders of all stages with our
point-to-point discipline.

Per-stage data parallelism (stages with different DP degrees ``DP_s``): micro-batch ``j`` of the
``M`` of a step runs on replica ``j mod DP_s`` of every stage ``s``, so its activation goes from
replica ``j mod DP_s`` of stage ``s`` to replica ``j mod DP_{s+1}`` of stage ``s + 1`` (and its
gradient back). Each replica runs the schedule over its own micro-batches
(:func:`replica_micro_batches`, in groups shared with its neighbours under interleaving) with
the warm-ups of :func:`routed_warmups`; :func:`replica_order` is one replica's order, and
:func:`check_orders` with ``data_parallel`` replays all replicas with routed messages.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

from megatron_h2.errors import ConfigError

SCHEDULES = ("1f1b", "interleaved", "zero-bubble")


class Action(NamedTuple):
    """One step of a rank's schedule: ``kind`` (F, B or W) of ``micro_batch`` on ``chunk``; a
    tuple ``(kind, chunk, micro_batch)``, so the planner's walks unpack it."""

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


def one_f_one_b(stage: int, stages: int, micro_batches: Sequence[int],
                warmup: int | None = None) -> list[Action]:
    """Megatron's non-interleaved 1F1B order of one stage (``warmup`` forwards first, by
    default ``p - s - 1``)."""
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
    """Megatron's interleaved 1F1B order of one stage (see the module docstring; ``warmup``
    overrides the number of warm-up forwards)."""
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


def schedule_problem(schedule: str, stages: int, micro_batches: int, chunks: int) -> str | None:
    """Why ``schedule`` cannot run this pipeline (a sentence saying what to change), or None:
    :func:`check_micro_batches`, and zero-bubble planned with one chunk per stage (ZB-H1)."""
    if schedule == "zero-bubble" and chunks != 1:
        return "the zero-bubble schedule (ZB-H1) runs one model chunk per stage"
    try:
        check_micro_batches(schedule, stages, chunks, micro_batches)
    except ConfigError as exc:
        return str(exc)
    return None


def check_schedule(schedule: str, stages: int, micro_batches: int, chunks: int) -> None:
    """Raise ConfigError when ``schedule`` cannot run this pipeline (:func:`schedule_problem`)."""
    problem = schedule_problem(schedule, stages, micro_batches, chunks)
    if problem is not None:
        raise ConfigError(problem)


def stage_order(schedule: str, stages: int, micro_batches: int | Sequence[int], chunks: int,
                stage: int, warmup: int | None = None) -> list[Action]:
    """:func:`schedule_order` in the planner's argument order, after :func:`check_schedule`:
    ``micro_batches`` is a count (ids ``0 .. m - 1``) or a DP replica's ids (with its
    :func:`routed_warmups` as ``warmup``)."""
    ids = range(micro_batches) if isinstance(micro_batches, int) else micro_batches
    check_schedule(schedule, stages, len(ids), chunks)
    return schedule_order(schedule, stage, stages, chunks, ids, warmup)


def schedule_order(schedule: str, stage: int, stages: int, chunks: int,
                   micro_batches: Sequence[int], warmup: int | None = None) -> list[Action]:
    """The order of ``schedule`` (``1f1b``, ``interleaved`` or ``zero-bubble``) for one stage
    (``warmup``: warm-up forwards instead of the schedule's own count)."""
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


def check_orders(orders: Sequence[Sequence[Action]], chunks: int,
                 data_parallel: Sequence[int] | None = None) -> None:
    """Replay every pipeline's order as the runtime runs it and raise AssertionError on a
    schedule that could hang or mismatch messages.

    ``orders``: one order per stage, or with ``data_parallel`` (the DP degree ``DP_s`` of every
    stage) one per DP replica, stage-major (stage 0's ``DP_0`` replicas, then stage 1's, ...).
    Replica ``r`` of stage ``s`` must run exactly the micro-batches ``j`` with
    ``j mod DP_s == r``; a message of micro-batch ``j`` goes between the replicas that run ``j``
    on the two stages (see :func:`replica_micro_batches`).

    The runtime runs each rank's actions in order; an action waits only for its own input (the
    neighbour's forward / backward, or its own forward or backward), sends never wait, and the
    messages between two replicas in one direction of one boundary travel in order (first in,
    first out), so every receiver must consume them in the order the sender sends them. Checks:
    every (kind, chunk, micro-batch) appears exactly once where it should, the replay finishes,
    and sends and receives match on every boundary, direction and pair of replicas.
    """
    dps = list(data_parallel) if data_parallel is not None else [1] * len(orders)
    stages = len(dps)
    assert len(orders) == sum(dps), f"{len(orders)} orders for {sum(dps)} replicas"
    where = [(s, r) for s in range(stages) for r in range(dps[s])]  # order index -> replica
    work = {(a.chunk, a.micro_batch) for (s, _), order in zip(where, orders) if s == 0
            for a in order if a.kind == "F"}
    assert {c for c, _ in work} == set(range(chunks)), "not every chunk runs"
    kinds = {a.kind for a in orders[0]}
    names = [f"stage {s}" + (f" replica {r}" if dps[s] > 1 else "") for s, r in where]
    for (s, r), name, order in zip(where, names, orders):
        assert len(set(order)) == len(order), f"{name} runs an action twice"
        mine_work = {(c, j) for c, j in work if j % dps[s] == r}
        for kind in "FBW":
            mine = {(a.chunk, a.micro_batch) for a in order if a.kind == kind}
            assert mine == (mine_work if kind in kinds else set()), \
                f"{name} runs {kind} of other (chunk, micro-batch) pairs than it should"
    stuck = _replay(orders, [s for s, _ in where], chunks)
    assert not stuck, "the schedule deadlocks: " + ", ".join(
        f"{names[i]} at {action}" for i, action in sorted(stuck.items()))
    sent: dict[tuple, list] = {}
    received: dict[tuple, list] = {}
    for (s, _), order in zip(where, orders):
        for action in order:
            for sending, log in ((True, sent), (False, received)):
                channel = _channel(action, s, stages, chunks, sending)
                if channel is not None:
                    boundary, kind, j, lap = channel
                    pair = (j % dps[boundary], j % dps[(boundary + 1) % stages])
                    log.setdefault((boundary, kind, pair), []).append((j, lap))
    assert sent == received, "a boundary's receiver consumes messages in another order than " \
                             "its sender sends them"


def _replay(orders: Sequence[Sequence[Action]], stage_of: Sequence[int],
            chunks: int) -> dict[int, Action]:
    """Run every order (of stage ``stage_of[i]``) as far as the data dependencies allow (an
    action runs once what it waits for has run on any replica); returns where each order that
    could not finish is stuck (empty: the orders run to their end)."""
    stages = max(stage_of) + 1
    done: set[tuple] = set()
    waiting: dict[tuple, list[int]] = {}  # what a blocked order waits for -> those orders
    pointer = [0] * len(orders)
    ready = list(range(len(orders)))
    while ready:
        index = ready.pop()
        stage, order = stage_of[index], orders[index]
        while pointer[index] < len(order):
            action = order[pointer[index]]
            need = _needs(action, stage, stages, chunks)
            if need is not None and need not in done:
                waiting.setdefault(need, []).append(index)
                break
            item = (action.kind, action.chunk * stages + stage, action.micro_batch)
            done.add(item)
            ready.extend(waiting.pop(item, ()))
            pointer[index] += 1
    return {i: orders[i][pointer[i]] for i in range(len(orders)) if pointer[i] < len(orders[i])}


# ------------------------------------------------------------------- per-stage data parallelism
def replica_micro_batches(total: int, data_parallel: Sequence[int], stage: int, replica: int,
                          chunks: int = 1) -> list[int]:
    """The global micro-batches (ids ``0 .. total - 1``) that DP replica ``replica`` of
    ``stage`` runs in one step, in the order its schedule takes them.

    ``data_parallel`` is every stage's DP degree ``DP_s``. Micro-batch ``j`` runs on replica
    ``j mod DP_s`` of every stage ``s`` (Megatron's data sampler gives DP rank ``r`` the
    micro-batches ``j`` with ``j mod DP == r`` too). With one model chunk a replica takes its
    micro-batches in ascending order. With virtual stages the interleaved schedules take them in
    groups of ``p`` (the pipeline size) through the chunks, and a boundary carries the messages
    of every chunk in the order they were sent: two replicas that share micro-batches must then
    form the same groups in the same order. So every group is ``p`` consecutive micro-batches of
    one residue class modulo ``L = lcm(DP_s)``, and every replica takes its groups in one
    job-wide order (by place within the class, then class). That needs ``total`` to be a
    multiple of ``p x L``, which is exactly Megatron's rule (every replica's count a multiple of
    ``p``) on every stage. With the same DP on every stage both orders are the ascending one.
    """
    dp, stages = data_parallel[stage], len(data_parallel)
    if not 0 <= replica < dp or total % dp:
        raise ConfigError(f"stage {stage} with data_parallel_size {dp} has no replica {replica} "
                          f"of {total} micro-batches")
    if chunks == 1:
        return list(range(replica, total, dp))
    lcm = math.lcm(*data_parallel)
    if total % (lcm * stages):
        raise ConfigError(f"{total} micro-batches do not split into groups of {stages} per "
                          f"replica with data-parallel sizes {list(data_parallel)}")
    return [k + lcm * (run * stages + i) for run in range(total // (lcm * stages))
            for k in range(replica, lcm, dp) for i in range(stages)]


def check_replica_micro_batches(schedule: str, data_parallel: Sequence[int], chunks: int,
                                total: int) -> None:
    """Megatron's micro-batch rules (:func:`check_micro_batches`) for every stage's replicas,
    which run ``total / DP_s`` micro-batches each; one-line ConfigError naming the stage."""
    dps = list(data_parallel)
    if len(set(dps)) == 1:
        check_micro_batches(schedule, len(dps), chunks, total // dps[0])
        return
    for stage, dp in enumerate(dps):
        if total % dp:
            raise ConfigError(f"{total} micro-batches per step do not split over stage {stage}'s "
                              f"{dp} data-parallel replicas; change the global batch size")
        try:
            check_micro_batches(schedule, len(dps), chunks, total // dp)
        except ConfigError as exc:
            raise ConfigError(f"stage {stage} (data_parallel_size {dp}): {exc}") from None


def routed_leads(data_parallel: Sequence[int]) -> list[int]:
    """Each stage's lead ``G_s`` in micro-batch ids under 1F1B: a replica of stage ``s`` runs the
    forward of its micro-batch ``j'`` before the backward of its ``j`` exactly when
    ``j' <= j + G_s``.

    ``G_{p-1} = 0`` and ``G_s = DP_s ceil((G_{s+1} + DP_{s+1}) / DP_s)``: the smallest multiple of
    ``DP_s`` that leads the next stage by one micro-batch per replica of the next stage. With
    the same DP everywhere it is Megatron's ``(p - s - 1) DP``. Since the leads fall along the
    pipeline, a backward only ever waits for work on smaller micro-batch ids, so the orders
    cannot hang; and every replica of the next stage gets its next forward while it is still
    busy, so a stage that feeds a wider one does not stall it: a balanced pipeline runs at its
    steady-state step (tests/test_pipeline_orders.py). The smaller lead ``sum of the later
    DP_t`` that the round trip alone suggests leaves the wide stage's replicas waiting for
    forwards.
    """
    leads = [0] * len(data_parallel)
    for s in range(len(data_parallel) - 2, -1, -1):
        dp, after = data_parallel[s], data_parallel[s + 1]
        leads[s] = dp * -(-(leads[s + 1] + after) // dp)
    return leads


def _base_warmup(schedule: str, data_parallel: Sequence[int], stage: int, chunks: int) -> int:
    """Warm-up forwards of every replica of ``stage`` before any search (see
    :func:`routed_warmups`)."""
    stages, dp = len(data_parallel), data_parallel[stage]
    own = routed_leads(data_parallel)[stage] // dp  # p - s - 1 with the same DP everywhere
    if schedule == "1f1b":
        return own
    if schedule == "zero-bubble":
        return own + (chunks - 1) * stages
    return 2 * own + (chunks - 1) * stages


@functools.lru_cache(maxsize=256)
def routed_warmups(schedule: str, data_parallel: tuple[int, ...], chunks: int,
                   total: int) -> tuple[int, ...]:
    """Warm-up forwards of each stage's replicas when the stages have different DP degrees.

    Under 1F1B a replica of stage ``s`` keeps ``G_s / DP_s`` of its own micro-batches in flight
    (:func:`routed_leads`), which is Megatron's ``p - s - 1`` when every stage has the same DP;
    zero-bubble adds ``(V - 1) x p``, interleaved takes ``2 x`` that plus ``(V - 1) x p``. With
    one model chunk these orders provably run (the leads fall along the pipeline;
    tests/unit/plan/test_pipeline_orders.py replays them for many DP degrees). With virtual
    stages every warm-up then grows by one on each stage whose replicas the replay of all orders
    (:func:`check_orders`) finds stuck waiting for a backward, until the orders provably run;
    the search is deterministic, so every rank computes the same orders. With the same DP
    everywhere these are the schedule's own warm-ups.
    """
    stages = len(data_parallel)
    warmups = [_base_warmup(schedule, data_parallel, s, chunks) for s in range(stages)]
    if len(set(data_parallel)) == 1 or chunks == 1:
        return tuple(warmups)
    stage_of = [s for s, dp in enumerate(data_parallel) for _ in range(dp)]
    limit = [total // dp * chunks for dp in data_parallel]  # every forward of a replica
    while True:
        orders = [schedule_order(schedule, s, stages, chunks,
                                 replica_micro_batches(total, data_parallel, s, r, chunks),
                                 warmups[s])
                  for s, dp in enumerate(data_parallel) for r in range(dp)]
        stuck = _replay(orders, stage_of, chunks)
        grow = {stage_of[i] for i, action in stuck.items()
                if action.kind == "B" and warmups[stage_of[i]] < limit[stage_of[i]]}
        if not stuck:
            return tuple(warmups)
        assert grow, f"no warm-up makes the routed {schedule} orders run: {stuck}"
        for s in grow:
            warmups[s] += 1


def replica_order(schedule: str, data_parallel: Sequence[int], stage: int, replica: int,
                  chunks: int, total: int) -> list[Action]:
    """The order replica ``replica`` of ``stage`` runs in a step of ``total`` micro-batches:
    :func:`schedule_order` over its :func:`replica_micro_batches` with the
    :func:`routed_warmups` of its stage (Megatron's orders when every stage has the same DP)."""
    dps = tuple(data_parallel)
    mbs = replica_micro_batches(total, dps, stage, replica, chunks)
    return schedule_order(schedule, stage, len(dps), chunks, mbs,
                          routed_warmups(schedule, dps, chunks, total)[stage])


def routed_orders(schedule: str, data_parallel: Sequence[int], chunks: int, total: int,
                  forward_only: bool = False) -> list[list[Action]]:
    """Every replica's order (stage-major, as :func:`check_orders` takes them) of one step of
    ``total`` micro-batches, or of its forward-only (evaluation) pass."""
    stages = len(data_parallel)
    if forward_only:
        return [forward_order(s, stages, chunks,
                              replica_micro_batches(total, data_parallel, s, r, chunks))
                for s, dp in enumerate(data_parallel) for r in range(dp)]
    return [replica_order(schedule, data_parallel, s, r, chunks, total)
            for s, dp in enumerate(data_parallel) for r in range(dp)]
