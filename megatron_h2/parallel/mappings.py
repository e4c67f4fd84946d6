"""Tensor-parallel context and the autograd communication functions between TP regions.

Every function takes the :class:`TPContext` explicitly (there is no global process group) and is
the identity, with no autograd node and no communication, when ``tp.size == 1``.

Shapes are batch-first: activations are [b, s, h]. The "last dim" functions split or gather the
hidden/feature dimension; the sequence-parallel functions split or gather dim 1 (the sequence).
Each forward op is paired with its adjoint in backward, as in Megatron-LM:

======================================  =====================  =======================
function                                forward                backward
======================================  =====================  =======================
copy_to_tp_region                       identity               all-reduce
reduce_from_tp_region                   all-reduce             identity
scatter_to_tp_region                    split last dim         all-gather last dim
gather_from_tp_region                   all-gather last dim    split last dim
scatter_to_sequence_parallel_region     split seq              all-gather seq
gather_from_sequence_parallel_region    all-gather seq         reduce-scatter seq
reduce_scatter_to_sequence_parallel...  reduce-scatter seq     all-gather seq
======================================  =====================  =======================
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_h2.distributed.topology import TPContext

SEQ_DIM = 1  # sequence dimension of [b, s, h] activations


# ---------------------------------------------------------------------------------------------
# Raw collectives (no autograd). All return new, contiguous tensors.
# ---------------------------------------------------------------------------------------------

def _check_divisible(x: torch.Tensor, dim: int, tp: TPContext) -> None:
    if x.shape[dim] % tp.size:
        raise ValueError(f"dimension {dim} of shape {tuple(x.shape)} is not divisible by the "
                         f"tensor-parallel size {tp.size}")


def all_reduce(x: torch.Tensor, tp: TPContext, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
               ) -> torch.Tensor:
    """Reduce ``x`` over the TP group into a new tensor (``x`` itself is left untouched)."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=tp.group)
    return out


def split_along(x: torch.Tensor, dim: int, tp: TPContext) -> torch.Tensor:
    """This rank's contiguous 1/size piece of ``x`` along ``dim``."""
    _check_divisible(x, dim, tp)
    return x.chunk(tp.size, dim=dim)[tp.rank].contiguous()


# torch 2.13 renamed these (the old names warn); keep working on releases before the rename
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_along(x: torch.Tensor, dim: int, tp: TPContext) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (in rank order)."""
    x = x.contiguous()
    out = torch.empty((tp.size * x.numel(),), dtype=x.dtype, device=x.device)
    _all_gather_flat(out, x.view(-1), group=tp.group)
    pieces = out.view(tp.size, *x.shape).unbind(0)  # size x [..., n, ...]
    return torch.cat(pieces, dim=dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, tp: TPContext) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's 1/size piece along ``dim``."""
    _check_divisible(x, dim, tp)
    stacked = torch.stack(x.chunk(tp.size, dim=dim))  # [size, ..., n/size, ...], contiguous
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    _reduce_scatter_flat(out.view(-1), stacked.view(-1), group=tp.group)
    return out


# ---------------------------------------------------------------------------------------------
# Autograd functions
# ---------------------------------------------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad, ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        return all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Split(torch.autograd.Function):
    """Forward: keep this rank's piece along ``dim``; backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, tp: TPContext) -> torch.Tensor:
        ctx.dim, ctx.tp = dim, tp
        return split_along(x, dim, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_along(grad, ctx.dim, ctx.tp), None, None


class _Gather(torch.autograd.Function):
    """Forward: all-gather along ``dim``; backward: reduce-scatter (grads are partial sums per
    rank) or plain split (grads are already complete on every rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, tp: TPContext, reduce_grads: bool
                ) -> torch.Tensor:
        ctx.dim, ctx.tp, ctx.reduce_grads = dim, tp, reduce_grads
        return all_gather_along(x, dim, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.reduce_grads:
            return reduce_scatter_along(grad, ctx.dim, ctx.tp), None, None, None
        return split_along(grad, ctx.dim, ctx.tp), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Forward: reduce-scatter along ``dim``; backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, tp: TPContext) -> torch.Tensor:
        ctx.dim, ctx.tp = dim, tp
        return reduce_scatter_along(x, dim, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_along(grad, ctx.dim, ctx.tp), None, None


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------

def copy_to_tp_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduce of the grad."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Leave a TP region by summing partial results: all-reduce forward, identity backward."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def scatter_to_tp_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """[..., n] -> [..., n/tp]: keep this rank's slice of the last dim; all-gather in backward."""
    return x if tp.size == 1 else _Split.apply(x, x.dim() - 1, tp)


def gather_from_tp_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """[..., n/tp] -> [..., n]: all-gather the last dim; backward keeps this rank's slice."""
    return x if tp.size == 1 else _Gather.apply(x, x.dim() - 1, tp, False)


def scatter_to_sequence_parallel_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """[b, s, h] -> [b, s/tp, h]: keep this rank's sequence chunk; all-gather in backward."""
    return x if tp.size == 1 else _Split.apply(x, SEQ_DIM, tp)


def gather_from_sequence_parallel_region(x: torch.Tensor, tp: TPContext,
                                         reduce_grads: bool = True) -> torch.Tensor:
    """[b, s/tp, h] -> [b, s, h]: all-gather the sequence.

    Backward reduce-scatters the grad (``reduce_grads=True``: the gathered tensor feeds a
    tensor-parallel op, so each rank holds a partial grad) or just splits it
    (``reduce_grads=False``: the grad is already complete and identical on every rank).
    """
    return x if tp.size == 1 else _Gather.apply(x, SEQ_DIM, tp, reduce_grads)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """[b, s, h] partial sums -> [b, s/tp, h] reduced; all-gather in backward."""
    return x if tp.size == 1 else _ReduceScatter.apply(x, SEQ_DIM, tp)
