"""The word embedding tied to the output layer, across pipeline stages.

With tied embeddings (Megatron's default) and more than one pipeline stage, the first stage
holds the word embedding and the last stage a copy for its output layer. Both start equal (see
``megatron_h2.models.gpt.init_parameters``) and stay equal because every step each copy's
gradient becomes the sum of both, after each stage has summed it over its own data-parallel
replicas (Megatron's embedding group does the same).

The two stages may sit on chips of different vendors and use different tensor-parallel and
data-parallel degrees, so the sum goes through the job's gloo group with the tensors staged in
host memory, like the cross-vendor bridge. After the DP sums every replica of a stage holds the
same gradient, so each rank of replica ``a`` of one end takes the other end's gradient from
replica ``a mod DP_other`` (each replica of the other end sends to the replicas that take from
it), exchanging with the ranks there whose vocabulary rows overlap its own (one peer when both
ends have the same TP). Both ends add the same two values, so the copies stay bitwise equal.
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
    """Sums ``weight.grad`` with the other end's copy (collective over the first and the last
    stage; every rank of both calls :meth:`sum_grads` in the same step)."""

    def __init__(self, topo: Topology, weight: nn.Parameter, vocab_size: int) -> None:
        if not (topo.is_first_stage or topo.is_last_stage) or topo.pp_size == 1:
            raise ValueError("the tied embedding is exchanged between the first and the last of "
                             "two or more pipeline stages")
        self.weight, self.group = weight, topo.cpu_group
        other = topo.pp_size - 1 if topo.is_first_stage else 0
        other_dp = topo.plan.stage_dp(other)
        self.recvs = self._overlaps(topo, other, topo.dp_rank % other_dp, vocab_size)
        self.sends = [ex for b in range(topo.dp_rank, other_dp, topo.dp_size)
                      for ex in self._overlaps(topo, other, b, vocab_size)]

    @staticmethod
    def _overlaps(topo: Topology, stage: int, replica: int, vocab_size: int) -> list[_Exchange]:
        """This rank's rows that each rank of ``replica`` of ``stage`` holds too."""
        mine = vocab_rows(topo.tp_rank, topo.tp_size, vocab_size)
        peers = topo.peer_ranks(stage, replica)
        out = []
        for t, peer in enumerate(peers):
            lo, hi = vocab_rows(t, len(peers), vocab_size)
            start, end = max(lo, mine[0]), min(hi, mine[1])
            if start < end:
                out.append(_Exchange(peer, start - mine[0], end - mine[0]))
        return out

    @torch.no_grad()
    def sum_grads(self) -> None:
        """``grad += other end's grad`` on this rank's rows, through host memory; call once the
        gradient is summed over this stage's DP replicas (every rank of both ends)."""
        grad = self.weight.grad  # [V/tp, h] on the device, summed over this stage's replicas
        host = grad.to("cpu", copy=True)  # [V/tp, h] what the other end adds
        recvs = []
        for ex in self.recvs:
            theirs = torch.empty_like(host[ex.start:ex.end])
            recvs.append((ex, theirs, dist.irecv(theirs, ex.peer, group=self.group,
                                                 tag=TIED_TAG)))
        sends = [dist.isend(host[ex.start:ex.end], ex.peer, group=self.group, tag=TIED_TAG)
                 for ex in self.sends]
        for ex, theirs, work in recvs:
            work.wait()
            grad[ex.start:ex.end] += theirs.to(grad.device)
        for work in sends:
            work.wait()


def tied_embedding_sync(topo: Topology, weight: nn.Parameter | None,
                        vocab_size: int) -> TiedEmbeddingSync | None:
    """The sync for this rank's tied weight, or None when it has none to exchange."""
    if weight is None or topo.pp_size == 1:
        return None
    return TiedEmbeddingSync(topo, weight, vocab_size)
