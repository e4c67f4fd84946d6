"""The word embedding tied to the output layer, across pipeline stages.

With tied embeddings (Megatron's default) and more than one pipeline stage, the first stage
holds the word embedding and the last stage a copy for its output layer. Both start equal (see
``megatron_h2.models.gpt.init_parameters``) and stay equal because every step each copy's
gradient becomes the sum of both, before the data-parallel reduction (Megatron's embedding
group does the same sum after it; sums commute).

The two stages may sit on chips of different vendors and use different tensor-parallel degrees,
so the sum goes through the job's gloo group with the tensors staged in host memory, like the
cross-vendor bridge: each rank exchanges with the ranks of its own data-parallel replica at the
other end whose vocabulary rows overlap its own (one peer when both ends have the same TP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron_h2.distributed.topology import Topology

TIED_TAG = 7411
"""Message tag of the exchange, distinct from the pipeline traffic on the same group."""


@dataclass(frozen=True)
class _Exchange:
    peer: int  # global rank at the other end
    start: int  # rows [start, end) of this rank's shard that the peer holds too
    end: int


def vocab_rows(tp_rank: int, tp_size: int, vocab_size: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of the vocabulary that TP rank ``tp_rank`` of ``tp_size`` holds."""
    per = vocab_size // tp_size
    return tp_rank * per, (tp_rank + 1) * per


class TiedEmbeddingSync:
    """Sums the weight's accumulated gradient (``main_grad`` where the gradient buckets keep one,
    else ``.grad``) with the other end's copy (collective over the first and the last stage;
    every rank of both calls :meth:`sum_grads` in the same step)."""

    def __init__(self, topo: Topology, weight: nn.Parameter, vocab_size: int) -> None:
        if not (topo.is_first_stage or topo.is_last_stage) or topo.pp_size == 1:
            raise ValueError("the tied embedding is exchanged between the first and the last of "
                             "two or more pipeline stages")
        self.weight, self.group = weight, topo.cpu_group
        mine = vocab_rows(topo.tp_rank, topo.tp_size, vocab_size)
        peers = topo.peer_ranks(topo.pp_size - 1 if topo.is_first_stage else 0)
        self.exchanges: list[_Exchange] = []
        for t, peer in enumerate(peers):
            lo, hi = vocab_rows(t, len(peers), vocab_size)
            start, end = max(lo, mine[0]), min(hi, mine[1])
            if start < end:
                self.exchanges.append(_Exchange(peer, start - mine[0], end - mine[0]))

    @torch.no_grad()
    def sum_grads(self) -> None:
        """``grad += other end's grad`` on this rank's rows, through host memory (both ends add
        the same two values, so the copies stay bitwise equal)."""
        grad = getattr(self.weight, "main_grad", None)  # [V/tp, h] on the device
        if grad is None:
            grad = self.weight.grad
        posted = []
        for ex in self.exchanges:
            mine = grad[ex.start:ex.end].to("cpu", copy=True)  # [rows, h] host copy
            theirs = torch.empty_like(mine)
            recv = dist.irecv(theirs, ex.peer, group=self.group, tag=TIED_TAG)
            send = dist.isend(mine, ex.peer, group=self.group, tag=TIED_TAG)
            posted.append((ex, recv, send, mine, theirs))
        for ex, recv, send, _, theirs in posted:
            recv.wait()
            grad[ex.start:ex.end] += theirs.to(grad.device)
            send.wait()


def tied_embedding_sync(topo: Topology, weight: nn.Parameter | None,
                        vocab_size: int) -> TiedEmbeddingSync | None:
    """The sync for this rank's tied weight, or None when it has none to exchange."""
    if weight is None or topo.pp_size == 1:
        return None
    return TiedEmbeddingSync(topo, weight, vocab_size)
