"""Transfer plans for a pipeline-stage boundary whose two sides may have different TP degrees.

Pure functions, no communication: :mod:`megatron_h2.distributed.p2p` turns a plan into messages.

Between stage ``s`` (TP = ``a``, the *senders*) and stage ``s + 1`` (TP = ``b``, the *receivers*)
of one DP replica the activation is ``[mbs, seq, h]``:

* without sequence parallelism every TP rank holds the full tensor (replicated). Receiver ``j``
  gets it from sender ``j % a``. In backward every receiver holds the same full gradient, and
  sender ``i`` gets it from receiver ``i % b`` (also a sender that had no forward partner);
* with sequence parallelism TP rank ``t`` of a stage with TP ``n`` holds sequence rows
  ``[t * seq / n, (t + 1) * seq / n)`` (``[mbs, seq / n, h]``; TP 1 holds everything). Every
  sender whose rows overlap receiver ``j``'s rows sends the overlap; backward is the mirror.

A plan lists, for one rank, :class:`Transfer` s ``(peer, local rows, peer rows)``, where rows are
slices of dimension 1 (the sequence) of the local and of the peer's tensor.

Stages with different DP degrees (per-stage data parallelism): micro-batch ``j`` runs on replica
``j mod DP_s`` of every stage ``s`` (:mod:`megatron_h2.plan.orders`), so replica ``a`` of stage
``s`` exchanges with every replica ``b`` of stage ``s + 1`` that shares micro-batches with it:
``a = b mod gcd(DP_s, DP_{s+1})`` (:func:`linked_replicas`). Each such pair of TP groups has its own
plan, built as above (:func:`rank_routes`); a message of micro-batch ``j`` uses the plan of replica
``j mod DP`` of the other stage. With the same DP on both sides the only partner is the same
replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import HeteroPlan


@dataclass(frozen=True)
class Transfer:
    """One message: rows ``local`` of this rank's tensor <-> rows ``remote`` of ``peer``'s."""

    peer: int
    local: slice
    remote: slice

    @property
    def num_rows(self) -> int:
        """Sequence rows carried (the same on both sides)."""
        return self.local.stop - self.local.start


@dataclass(frozen=True)
class BoundaryPlan:
    """This rank's traffic across one stage boundary.

    A rank of the upstream stage (a sender) has ``fwd_send`` (activations out) and ``bwd_recv``
    (gradients in); a rank of the downstream stage has ``fwd_recv`` and ``bwd_send``. The other
    two lists are empty. Lists are ordered by peer rank.
    """

    fwd_send: tuple[Transfer, ...] = ()
    fwd_recv: tuple[Transfer, ...] = ()
    bwd_send: tuple[Transfer, ...] = ()
    bwd_recv: tuple[Transfer, ...] = ()


def local_rows(seq_length: int, tp_size: int, tp_rank: int, sequence_parallel: bool) -> slice:
    """Sequence rows held by TP rank ``tp_rank`` of a stage with ``tp_size`` ranks."""
    if not sequence_parallel:
        return slice(0, seq_length)
    if seq_length % tp_size:
        raise ConfigError(f"sequence parallelism needs the sequence length {seq_length} to be "
                          f"divisible by the tensor parallel size {tp_size}")
    rows = seq_length // tp_size
    return slice(tp_rank * rows, (tp_rank + 1) * rows)


def _shift(lo: int, hi: int, base: int) -> slice:
    return slice(lo - base, hi - base)


def _overlaps(a: int, b: int, seq_length: int) -> list[tuple[int, int, int, int]]:
    """Every ``(i, j, lo, hi)``: sender ``i`` and receiver ``j`` share global rows [lo, hi)."""
    out = []
    for i in range(a):
        si = local_rows(seq_length, a, i, True)
        for j in range(b):
            rj = local_rows(seq_length, b, j, True)
            lo, hi = max(si.start, rj.start), min(si.stop, rj.stop)
            if lo < hi:
                out.append((i, j, lo, hi))
    return out


def _plan_sequence_parallel(senders: Sequence[int], receivers: Sequence[int], rank: int,
                            seq_length: int) -> BoundaryPlan:
    a, b = len(senders), len(receivers)
    send: list[Transfer] = []
    recv: list[Transfer] = []
    for i, j, lo, hi in _overlaps(a, b, seq_length):
        s_base = local_rows(seq_length, a, i, True).start
        r_base = local_rows(seq_length, b, j, True).start
        if senders[i] == rank:
            send.append(Transfer(receivers[j], _shift(lo, hi, s_base), _shift(lo, hi, r_base)))
        if receivers[j] == rank:
            recv.append(Transfer(senders[i], _shift(lo, hi, r_base), _shift(lo, hi, s_base)))
    # backward is the mirror: the same rows travel the other way
    return BoundaryPlan(fwd_send=tuple(send), fwd_recv=tuple(recv), bwd_send=tuple(recv),
                        bwd_recv=tuple(send))


def _plan_replicated(senders: Sequence[int], receivers: Sequence[int], rank: int,
                     seq_length: int) -> BoundaryPlan:
    a, b = len(senders), len(receivers)
    full = slice(0, seq_length)
    if rank in senders:
        i = senders.index(rank)
        fwd = tuple(Transfer(receivers[j], full, full) for j in range(b) if j % a == i)
        return BoundaryPlan(fwd_send=fwd, bwd_recv=(Transfer(receivers[i % b], full, full),))
    j = receivers.index(rank)
    bwd = tuple(Transfer(senders[i], full, full) for i in range(a) if i % b == j)
    return BoundaryPlan(fwd_recv=(Transfer(senders[j % a], full, full),), bwd_send=bwd)


def boundary_plan(senders: Sequence[int], receivers: Sequence[int], rank: int,
                  seq_length: int, sequence_parallel: bool) -> BoundaryPlan:
    """Plan of ``rank`` on the boundary from ``senders`` (upstream TP group, in tp order) to
    ``receivers`` (downstream TP group of the same DP replica, in tp order)."""
    senders, receivers = list(senders), list(receivers)
    if not senders or not receivers:
        raise ConfigError("a stage boundary needs at least one rank on each side")
    if set(senders) & set(receivers):
        raise ConfigError(f"ranks {sorted(set(senders) & set(receivers))} are on both sides of "
                          "a stage boundary")
    if rank not in senders and rank not in receivers:
        raise ConfigError(f"rank {rank} is on neither side of the boundary {senders} -> "
                          f"{receivers}")
    if sequence_parallel:
        for n in (len(senders), len(receivers)):
            local_rows(seq_length, n, 0, True)  # divisibility check
        return _plan_sequence_parallel(senders, receivers, rank, seq_length)
    return _plan_replicated(senders, receivers, rank, seq_length)


def replica_ranks(plan: HeteroPlan, stage: int, dp_rank: int) -> list[int]:
    """Ranks of DP replica ``dp_rank`` in ``stage`` (its TP group there), in tp order."""
    tp = plan.stages[stage].tensor_parallel_size
    start = plan.stage_ranks(stage).start + dp_rank * tp
    return list(range(start, start + tp))


def linked_replicas(plan: HeteroPlan, stage: int, dp_rank: int, other: int) -> list[int]:
    """The replicas of stage ``other`` that share micro-batches with replica ``dp_rank`` of
    ``stage`` (micro-batch ``j`` runs on replica ``j mod DP`` of every stage)."""
    common = math.gcd(plan.stage_dp(stage), plan.stage_dp(other))
    return [b for b in range(plan.stage_dp(other)) if b % common == dp_rank % common]


Routes = dict[int, BoundaryPlan]
"""A rank's plans on one boundary, keyed by the replica of the neighbouring stage."""


def rank_routes(plan: HeteroPlan, rank: int, seq_length: int, sequence_parallel: bool
                ) -> tuple[Routes | None, Routes | None]:
    """``(routes on the boundary with the previous stage, routes on the one with the next
    stage)`` of ``rank``: for every replica of the neighbouring stage that shares micro-batches
    with this rank's replica, this rank's plan with that replica's TP group; None where its
    stage is the first / last.

    With virtual stages (``plan.virtual_pipeline_size > 1``) the last stage's chunk ``c`` feeds
    the first stage's chunk ``c + 1``: the first stage's previous stage is then the last one and
    the last stage's next stage the first one (the wrap-around boundary ``p - 1 -> 0``).
    """
    stage, dp_rank, _ = plan.rank_coordinates(rank)
    p = plan.pipeline_parallel_size
    ring = plan.virtual_pipeline_size > 1
    mine = replica_ranks(plan, stage, dp_rank)
    prev = nxt = None
    if stage > 0 or ring:
        up = (stage - 1) % p
        prev = {b: boundary_plan(replica_ranks(plan, up, b), mine, rank, seq_length,
                                 sequence_parallel)
                for b in linked_replicas(plan, stage, dp_rank, up)}
    if stage < p - 1 or ring:
        down = (stage + 1) % p
        nxt = {b: boundary_plan(mine, replica_ranks(plan, down, b), rank, seq_length,
                                sequence_parallel)
               for b in linked_replicas(plan, stage, dp_rank, down)}
    return prev, nxt


def rank_boundaries(plan: HeteroPlan, rank: int, seq_length: int, sequence_parallel: bool
                    ) -> tuple[BoundaryPlan | None, BoundaryPlan | None]:
    """``(plan on the boundary with the previous stage, plan on the one with the next stage)``
    of ``rank`` where its neighbours have its stage's DP degree (one partner replica each, see
    :func:`rank_routes`); None where its stage is the first / last."""
    out = []
    for routes in rank_routes(plan, rank, seq_length, sequence_parallel):
        if routes is not None and len(routes) != 1:
            raise ConfigError(f"rank {rank} exchanges with {len(routes)} replicas of a "
                              "neighbouring stage of another DP degree; use rank_routes")
        out.append(None if routes is None else next(iter(routes.values())))
    return out[0], out[1]
