"""Point-to-point traffic between neighbouring pipeline stages of one DP replica.

Each rank talks to the rank with the same ``tp_rank`` in the previous and next stage (see
:mod:`megatron_h2.distributed.topology`). Shapes are fixed for a run (micro-batch x sequence x
hidden), so no shape is ever exchanged. Sends and receives that happen together are posted as
one batch of non-blocking operations so that neighbours cannot deadlock.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_h2.distributed.topology import Topology


class PipeComm:
    """Activation / gradient exchange for one rank; a no-op on a single stage."""

    def __init__(self, topo: Topology, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.prev = None if topo.is_first_stage else topo.peer_ranks(topo.stage - 1)[topo.tp_rank]
        self.next = None if topo.is_last_stage else topo.peer_ranks(topo.stage + 1)[topo.tp_rank]
        self.bytes_sent = 0

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def _exchange(self, send: list[tuple[torch.Tensor, int]],
                  recv: list[tuple[torch.Tensor, int]]) -> None:
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for t, peer in send]
        ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recv]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        self.bytes_sent += sum(t.numel() * t.element_size() for t, _ in send)

    def recv_forward(self) -> torch.Tensor | None:
        """Input activation from the previous stage (None on the first stage)."""
        if self.prev is None:
            return None
        buf = self._empty()
        self._exchange([], [(buf, self.prev)])
        return buf.requires_grad_()

    def send_forward(self, output: torch.Tensor) -> None:
        if self.next is not None:
            self._exchange([(output.detach(), self.next)], [])

    def recv_backward(self) -> torch.Tensor | None:
        """Gradient of this stage's output from the next stage (None on the last stage)."""
        if self.next is None:
            return None
        buf = self._empty()
        self._exchange([], [(buf, self.next)])
        return buf

    def send_backward(self, grad: torch.Tensor | None) -> None:
        if self.prev is not None:
            self._exchange([(grad, self.prev)], [])

    def send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor | None:
        if self.next is None:
            return None
        buf = self._empty()
        self._exchange([(output.detach(), self.next)], [(buf, self.next)])
        return buf

    def send_backward_recv_forward(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        if self.prev is None:
            return None
        buf = self._empty()
        self._exchange([(grad, self.prev)], [(buf, self.prev)])
        return buf.requires_grad_()
