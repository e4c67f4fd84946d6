"""How full (checkpoint) tensors map to tensor-parallel shards.

A :class:`TPShard` ``(dim, blocks)`` says: along ``dim`` the full tensor is ``blocks`` equal
blocks, and each block is split evenly across the TP ranks; rank r's shard is the concatenation
(along ``dim``) of the r-th piece of every block. ``blocks=1`` is a plain even split (the fused
``linear_qkv``, whose rows are grouped per query group, shards this way as long as TP divides
the number of query groups); ``blocks=2`` is the fused [gate; up] ``linear_fc1``.

Sharded parameters carry their spec as ``param.tp_shard``; replicated parameters have no such
attribute. Under sequence parallelism, replicated parameters whose grads are partial per rank
(the RMSNorm weights) carry ``param.sequence_parallel = True``, and their grads must be summed
over the TP group before the optimizer step: :func:`allreduce_sequence_parallel_grads` does it
for plain ``.grad`` tensors; the training step sums the optimizer's own gradient pieces with
:func:`allreduce_coalesced_`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_h2.parallel.mappings import TPContext, all_gather_along

TP_SHARD_ATTR = "tp_shard"
SEQUENCE_PARALLEL_ATTR = "sequence_parallel"


@dataclass(frozen=True)
class TPShard:
    """Layout of a TP-sharded tensor: ``blocks`` equal blocks along ``dim``, each split evenly
    across the TP ranks."""

    dim: int
    blocks: int = 1

    def __post_init__(self) -> None:
        if self.blocks < 1:
            raise ValueError(f"TPShard.blocks must be >= 1, got {self.blocks}")

    def resolve_dim(self, ndim: int) -> int:
        """``dim`` as a non-negative index into a tensor of ``ndim`` dimensions."""
        if not -ndim <= self.dim < ndim:
            raise ValueError(f"TPShard dim {self.dim} is out of range for {ndim} dimensions")
        return self.dim % ndim


def _piece_length(full_len: int, spec: TPShard, size: int) -> int:
    if full_len % (spec.blocks * size):
        raise ValueError(f"length {full_len} along the sharded dim is not divisible by "
                         f"{spec.blocks} block(s) x TP size {size}")
    return full_len // (spec.blocks * size)


def shard_slices(full_shape: Sequence[int], spec: TPShard, rank: int, size: int
                 ) -> list[tuple[slice, ...]]:
    """The index slices of the full tensor that make up rank ``rank``'s shard, in order.

    Concatenating ``full[sl]`` for each slice along ``spec.dim`` gives the shard; with
    safetensors, ``safe_open(...).get_slice(name)[sl]`` reads just that part of the file.
    """
    if not 0 <= rank < size:
        raise ValueError(f"invalid TP rank {rank} of size {size}")
    dim = spec.resolve_dim(len(full_shape))
    piece = _piece_length(full_shape[dim], spec, size)
    block_len = piece * size
    slices = []
    for b in range(spec.blocks):
        start = b * block_len + rank * piece
        index = [slice(None)] * len(full_shape)
        index[dim] = slice(start, start + piece)
        slices.append(tuple(index))
    return slices


def shard_tensor(full: torch.Tensor, spec: TPShard, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` (a new contiguous tensor)."""
    dim = spec.resolve_dim(full.dim())
    pieces = [full[sl] for sl in shard_slices(full.shape, spec, rank, size)]
    return torch.cat(pieces, dim=dim)


def unshard_tensors(shards: Sequence[torch.Tensor], spec: TPShard) -> torch.Tensor:
    """Rebuild the full tensor from every rank's shard (in rank order). Pure: no communication."""
    if not shards:
        raise ValueError("unshard_tensors needs at least one shard")
    dim = spec.resolve_dim(shards[0].dim())
    for shard in shards:
        _piece_length(shard.shape[dim], spec, 1)
    per_rank = [shard.chunk(spec.blocks, dim=dim) for shard in shards]  # size x blocks pieces
    blocks = [torch.cat([pieces[b] for pieces in per_rank], dim=dim) for b in range(spec.blocks)]
    return torch.cat(blocks, dim=dim)


@torch.no_grad()
def gather_tp_tensor(local: torch.Tensor, spec: TPShard, tp: TPContext) -> torch.Tensor:
    """The full tensor from every rank's ``local`` shard: all-gather, then unshard.

    Not differentiable; every rank of the group must call it. With ``tp.size == 1`` it returns a
    copy of ``local``.
    """
    if tp.size == 1:
        return local.detach().clone()
    local = local.detach()
    gathered = all_gather_along(local.unsqueeze(0), 0, tp)  # [size, *local.shape]
    return unshard_tensors(list(gathered.unbind(0)), spec)


# ---------------------------------------------------------------------------------------------
# Parameter attributes
# ---------------------------------------------------------------------------------------------

def set_tp_shard(param: torch.Tensor, spec: TPShard) -> None:
    """Mark ``param`` as TP-sharded with layout ``spec``."""
    setattr(param, TP_SHARD_ATTR, spec)


def get_tp_shard(param: torch.Tensor) -> TPShard | None:
    """The shard spec of ``param``, or None for a replicated parameter."""
    return getattr(param, TP_SHARD_ATTR, None)


def mark_sequence_parallel(param: torch.Tensor) -> None:
    """Mark a replicated ``param`` whose grad is partial per rank under sequence parallelism."""
    setattr(param, SEQUENCE_PARALLEL_ATTR, True)


def is_sequence_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` was marked by :func:`mark_sequence_parallel`."""
    return bool(getattr(param, SEQUENCE_PARALLEL_ATTR, False))


@torch.no_grad()
def load_shard_(param: torch.Tensor, full: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Copy this rank's part of the full tensor ``full`` into ``param`` (in place).

    Sharded parameters receive ``shard_tensor(full, param.tp_shard, ...)``; replicated ones the
    whole of ``full``. Returns ``param``.
    """
    spec = get_tp_shard(param)
    part = full if spec is None else shard_tensor(full, spec, tp.rank, tp.size)
    if part.shape != param.shape:
        raise ValueError(f"shard shape {tuple(part.shape)} does not match parameter shape "
                         f"{tuple(param.shape)}")
    param.copy_(part)
    return param


@torch.no_grad()
def allreduce_coalesced_(tensors: Sequence[torch.Tensor], tp: TPContext) -> None:
    """Sum ``tensors`` over the TP group in place, one collective per dtype.

    Every rank of the group must call this, with matching tensors in the same order (an empty
    list still joins the collective). A no-op for ``tp.size == 1``.
    """
    if tp.size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values() or [[]]:
        flat = torch.cat([t.reshape(-1) for t in group]) if group else torch.zeros(0)
        dist.all_reduce(flat, group=tp.group)
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def allreduce_sequence_parallel_grads(params: Iterable[torch.Tensor], tp: TPContext) -> None:
    """Sum over the TP group the grads of parameters marked ``sequence_parallel``."""
    allreduce_coalesced_([p.grad for p in params if is_sequence_parallel(p)
                          and p.grad is not None], tp)
