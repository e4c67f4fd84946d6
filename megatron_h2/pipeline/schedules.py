"""Megatron's non-interleaved 1F1B pipeline schedule (and the plain path for one stage).

Stage ``s`` of ``p`` runs ``min(p - s - 1, m)`` warm-up forwards, then alternates one forward
and one backward (steady state), then drains the remaining backwards (cool-down). With one
stage this degenerates to forward/backward per micro-batch, the single-process loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch

from megatron_h2.distributed.p2p import PipeComm

# forward_step(micro_batch_index, input_activation_or_None) -> output activation, or on the last
# stage the scalar loss of that micro-batch (already divided by the global batch's token count)
ForwardStep = Callable[[int, torch.Tensor | None], torch.Tensor]


class ComputeObserver(Protocol):
    """Wraps each micro-batch's forward or backward (timing, timelines, emulated slowdown)."""

    def compute(self, kind: str, micro_batch: int) -> contextlib.AbstractContextManager: ...


class _NoObserver:
    def compute(self, kind: str, micro_batch: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def _backward(inp: torch.Tensor | None, out: torch.Tensor,
              grad: torch.Tensor | None) -> torch.Tensor | None:
    """Backward through one micro-batch; returns the gradient of the stage input."""
    if grad is None:  # last stage: ``out`` is the loss
        out.backward()
    else:
        torch.autograd.backward(out, grad_tensors=grad)
    return None if inp is None else inp.grad


def forward_backward_1f1b(forward_step: ForwardStep, num_micro_batches: int, comm: PipeComm,
                          stage: int, num_stages: int,
                          before_last_backward: Callable[[], None] | None = None,
                          observer: ComputeObserver | None = None) -> None:
    """Run forward and backward of every micro-batch of one step on this stage."""
    obs = observer or _NoObserver()
    warmup = min(num_stages - stage - 1, num_micro_batches)
    steady = num_micro_batches - warmup
    inputs: list[torch.Tensor | None] = []
    outputs: list[torch.Tensor] = []
    done_backward = 0

    def forward_one(i: int, inp: torch.Tensor | None) -> torch.Tensor:
        with obs.compute("forward", i):
            return forward_step(i, inp)

    def backward_one(grad: torch.Tensor | None) -> torch.Tensor | None:
        nonlocal done_backward
        if done_backward == num_micro_batches - 1 and before_last_backward is not None:
            before_last_backward()
        with obs.compute("backward", done_backward):
            grad_in = _backward(inputs.pop(0), outputs.pop(0), grad)
        done_backward += 1
        return grad_in

    for i in range(warmup):
        inp = comm.recv_forward()
        out = forward_one(i, inp)
        comm.send_forward(out)
        inputs.append(inp)
        outputs.append(out)
    inp = comm.recv_forward() if steady > 0 else None
    for i in range(steady):
        out = forward_one(warmup + i, inp)
        grad_out = comm.send_forward_recv_backward(out)
        inputs.append(inp)
        outputs.append(out)
        grad_in = backward_one(grad_out)
        if i == steady - 1:
            comm.send_backward(grad_in)
        else:
            inp = comm.send_backward_recv_forward(grad_in)
    for _ in range(warmup):
        grad_in = backward_one(comm.recv_backward())
        comm.send_backward(grad_in)


@torch.no_grad()
def forward_only(forward_step: ForwardStep, num_micro_batches: int, comm: PipeComm,
                 observer: ComputeObserver | None = None) -> None:
    """Forward of every micro-batch through the pipeline (evaluation)."""
    obs = observer or _NoObserver()
    for i in range(num_micro_batches):
        inp = comm.recv_forward()
        with obs.compute("forward", i):
            out = forward_step(i, inp)
        comm.send_forward(out)
