"""Expert parallelism: the token dispatch of Megatron-Core's ``alltoall`` and ``allgather``
dispatchers.

Each rank of an expert-parallel (EP) group of size ``P`` holds ``E / P`` of a MoE layer's
``E`` experts (:meth:`EPContext.local_experts`, contiguous global indices) and routes its own
tokens. :func:`dispatch_to_experts` sends each routed token (with its routing probability) to the
rank that holds its expert and runs the local experts on what arrives; the results travel back
the same way and are summed per token by the caller as in one process.

The token counts per expert are exchanged first (one all-to-all of ``E`` integers), so every rank
knows how many rows it receives from each source for each of its experts: there is no padding,
and no capacity is needed. Both exchanges are ``torch.distributed.all_to_all_single`` with uneven
split sizes, which gloo (CPU) and NCCL implement; its backward is the reverse all-to-all.

Order of the rows a rank's experts see: expert by expert, inside an expert source rank by source
rank, inside a source in that rank's token order (Megatron-Core sorts the received chunks by
local expert the same way).

:func:`allgather_to_experts` (``allgather``, Megatron's default): every rank gathers the
group's tokens, probabilities and routing maps (all ranks route the same number of tokens), runs
its local experts on the rows routed to them and the partial outputs are summed back to the
tokens' ranks (a reduce-scatter, built on all-to-all: gloo has no reduce-scatter).

:func:`gather_over_expert_tp` (expert tensor parallelism, ETP > 1 on a stage of TP 1): each
rank of an expert-TP group holds a column shard of its local experts' ``linear_fc1`` and the
matching row shard of ``linear_fc2``; the rows that reached the group's ranks (after the EP
exchange) are all-gathered over it, each rank runs its shards on all of them (partial outputs)
and the partial outputs are summed back to the rows' ranks (a reduce-scatter), as Megatron-Core's
dispatchers do after their EP all-to-all. The row counts per local expert are exchanged first;
the exchanges are uneven all-to-alls, whose backward is the reverse exchange.

Shapes: h = hidden size, T = tokens a rank routes, N = rows this rank routes (tokens x top-k,
kept ones), E = experts, L = E / P local experts, R = rows this rank receives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_h2.distributed.topology import EXPERT_PARALLEL_ATTR, EPContext, TPContext

__all__ = ["EXPERT_PARALLEL_ATTR", "EPContext", "all_to_all", "allgather_to_experts",
           "dispatch_to_experts", "gather_over_expert_tp"]

Experts = Callable[[torch.Tensor, list[int], torch.Tensor], torch.Tensor]
"""``experts(rows [R, h], rows per local expert, probs [R]) -> [R, h]``."""


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with uneven splits; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, out_splits: list[int],
                in_splits: list[int]) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits,
                               group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, out_splits: list[int],
               in_splits: list[int]) -> torch.Tensor:
    """Rows ``in_splits[j]`` of ``x`` (in order) go to rank ``j`` of ``group``; returns the rows
    received, ``out_splits[j]`` from rank ``j``, in rank order. Differentiable."""
    return _AllToAll.apply(x, group, out_splits, in_splits)


def exchange_counts(counts: torch.Tensor, ep: EPContext) -> torch.Tensor:
    """[E] rows this rank routes to each expert -> [P, L]: rows each source rank sends to each
    of this rank's experts."""
    send = counts.to(torch.int64).reshape(ep.size, -1).contiguous()  # [P, L] by destination
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ep.group)
    return recv


def _reorder(x: torch.Tensor, sizes: torch.Tensor, outer_first: bool) -> torch.Tensor:
    """Rows in chunks ``sizes`` [A, B] (chunk (a, b) at a-major position) -> the same chunks in
    b-major order (``outer_first``), or back (``not outer_first``: ``x`` is b-major)."""
    a, b = sizes.shape
    if outer_first:
        pieces = torch.split(x, sizes.reshape(-1).tolist())
        return torch.cat([pieces[i * b + j] for j in range(b) for i in range(a)])
    pieces = torch.split(x, sizes.t().reshape(-1).tolist())
    return torch.cat([pieces[j * a + i] for i in range(a) for j in range(b)])


def dispatch_to_experts(permuted: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor,
                        ep: EPContext, experts: Experts) -> torch.Tensor:
    """Run the EP group's experts on this rank's routed rows.

    ``permuted`` [N, h] holds the rows sorted by global expert (``counts`` [E] rows each),
    ``probs`` [N] their routing probabilities; ``experts(rows [R, h], rows per local expert,
    probs [R])`` runs this rank's experts. Returns [N, h]: each row's expert output, in the
    order of ``permuted``.
    """
    if ep.size == 1:
        return experts(permuted, counts.tolist(), probs)
    recv = exchange_counts(counts, ep)  # [P, L]
    in_splits = counts.reshape(ep.size, -1).sum(dim=1).tolist()
    out_splits = recv.sum(dim=1).tolist()
    rows = all_to_all(permuted, ep.group, out_splits, in_splits)  # [R, h] source-major
    row_probs = all_to_all(probs.unsqueeze(-1), ep.group, out_splits, in_splits).squeeze(-1)
    rows, row_probs = _reorder(rows, recv, True), _reorder(row_probs, recv, True)
    out = experts(rows, recv.sum(dim=0).tolist(), row_probs)  # [R, h] expert-major
    out = _reorder(out, recv, False)  # source-major again
    return all_to_all(out, ep.group, in_splits, out_splits)  # [N, h]


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 (every rank the same row count); backward: each rank's rows of
    the gradient summed over the group (a reduce-scatter, built on all-to-all for gloo)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sum_rows(grad, ctx.group, ctx.size), None, None


class _SumRows(torch.autograd.Function):
    """[P x T, ...] partial sums -> [T, ...]: this rank's T rows summed over the group, in rank
    order (a reduce-scatter, built on all-to-all for gloo); backward: the all-gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _sum_rows(x, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _GatherRows.apply(grad, ctx.group, ctx.size), None, None


def _sum_rows(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    chunks = torch.empty_like(x)
    dist.all_to_all_single(chunks, x.contiguous(), group=group)  # [P, T, ...] from each rank
    parts = chunks.view(size, x.shape[0] // size, *x.shape[1:])
    out = parts[0].clone()
    for part in parts[1:]:
        out += part
    return out


def allgather_to_experts(tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                         ep: EPContext, run_local: Callable[[torch.Tensor, torch.Tensor,
                                                             torch.Tensor], torch.Tensor]
                         ) -> torch.Tensor:
    """Megatron-Core's ``allgather`` dispatch: every rank of the EP group gathers the group's
    tokens [P x T, h], probabilities and routing map [P x T, E], runs its local experts on the
    rows routed to them (``run_local(tokens, probs, routing_map)`` with the local experts'
    columns -> [P x T, h], each token's local experts' outputs summed) and the partial outputs
    are summed back to the tokens' ranks. Returns [T, h]."""
    every = _GatherRows.apply(tokens, ep.group, ep.size)  # [P x T, h]
    every_probs = _GatherRows.apply(probs, ep.group, ep.size)  # [P x T, E]
    maps = torch.empty((ep.size * routing_map.shape[0], routing_map.shape[1]),
                       dtype=routing_map.dtype, device=routing_map.device)
    dist.all_gather_into_tensor(maps, routing_map.contiguous(), group=ep.group)
    local = ep.local_experts(routing_map.shape[1])
    cols = slice(local.start, local.stop)
    partial = run_local(every, every_probs[:, cols], maps[:, cols])  # [P x T, h]
    return _SumRows.apply(partial, ep.group, ep.size)


def gather_over_expert_tp(rows: torch.Tensor, per_expert: list[int], probs: torch.Tensor,
                          etp: TPContext, partial: Experts) -> torch.Tensor:
    """Run this rank's shards of its local experts on the rows of the whole expert-TP group.

    ``rows`` [n, h] are this rank's rows sorted by local expert (``per_expert`` [L] each),
    ``probs`` [n] their routing probabilities; ``partial(rows [R, h], rows per local expert,
    probs [R])`` runs this rank's expert shards without communication (partial sums over its
    share of each expert's hidden features). Returns [n, h]: each of ``rows``' outputs, the
    partial outputs of the group's ranks summed in rank order.
    """
    size, n = etp.size, rows.shape[0]
    counts = torch.tensor(per_expert, dtype=torch.int64)
    every = torch.empty(size * len(per_expert), dtype=torch.int64)
    dist.all_gather_into_tensor(every, counts, group=etp.group)
    every = every.view(size, -1)  # [ETP, L]: rows each group rank holds per local expert
    sizes, mine = every.sum(dim=1).tolist(), [n] * size
    # every rank's rows to every rank (the repeat's backward sums the copies' gradients)
    gathered = all_to_all(rows.repeat(size, 1), etp.group, sizes, mine)  # [R, h] rank-major
    gathered_probs = all_to_all(probs.unsqueeze(-1).repeat(size, 1), etp.group, sizes,
                                mine).squeeze(-1)
    gathered = _reorder(gathered, every, True)  # expert-major
    gathered_probs = _reorder(gathered_probs, every, True)
    out = partial(gathered, every.sum(dim=0).tolist(), gathered_probs)  # [R, h] partial sums
    out = _reorder(out, every, False)  # rank-major again
    back = all_to_all(out, etp.group, mine, sizes)  # [ETP x n, h]: each rank's partial
    return back.view(size, n, *back.shape[1:]).sum(dim=0)
