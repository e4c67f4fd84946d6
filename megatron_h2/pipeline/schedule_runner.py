"""Run a pipeline schedule: one rank's forwards, backwards and weight-gradient passes in the
order :mod:`megatron_h2.plan.orders` computes, with the traffic of
:class:`~megatron_h2.distributed.p2p.PipeComm`.

One executor runs every schedule (1F1B, interleaved 1F1B, zero-bubble); a schedule is only an
order. After each action the rank makes one exchange: it posts the receive the next action needs
(an activation from upstream or a gradient from downstream) and sends what this action produced,
then waits for that receive alone. Sends never wait, so a rank waits only for data the order
says must come first; :func:`~megatron_h2.plan.orders.check_orders` proves for every order
that this cannot hang and that every boundary's messages arrive in the order they are consumed.

Under zero-bubble a ``B`` computes only the input gradient and a ``W`` the weight gradients
(:mod:`megatron_h2.pipeline.split_backward`); elsewhere ``B`` is the whole backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_h2.distributed.p2p import PipeComm
from megatron_h2.pipeline.split_backward import PendingWeights, backward_input, backward_weight
from megatron_h2.plan.orders import Action, forward_order, one_f_one_b

# forward_step(chunk, micro_batch, input_activation_or_None) -> output activation, or on the last
# virtual stage the scalar loss of that micro-batch (already divided by the global batch's token
# count)
ForwardStep = Callable[[int, int, torch.Tensor | None], torch.Tensor]


class ComputeObserver(Protocol):
    """Wraps each compute step (timing, timelines, emulated slowdown); ``kind`` is ``forward``,
    ``backward`` (whole), ``backward_input`` (zero-bubble's B) or ``backward_weight`` (W)."""

    def compute(self, kind: str, micro_batch: int,
                chunk: int = 0) -> contextlib.AbstractContextManager: ...


class _NoObserver:
    def compute(self, kind: str, micro_batch: int,
                chunk: int = 0) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


@dataclass(frozen=True)
class StageChunks:
    """What the executor needs to know about this rank's model chunks.

    ``stage`` of ``stages``; ``params[c]`` are the parameters chunk ``c`` uses (the weight
    passes of zero-bubble compute their gradients); ``split[c]`` says whether chunk ``c``'s
    backward may be split into input and weight gradients (not for layers recomputed in full).
    """

    stage: int
    stages: int
    params: Sequence[Sequence[torch.nn.Parameter]]
    split: Sequence[bool] = ()

    @property
    def chunks(self) -> int:
        return len(self.params)

    def first(self, chunk: int) -> bool:
        """First virtual stage: takes token ids, sends no gradient."""
        return self.stage == 0 and chunk == 0

    def last(self, chunk: int) -> bool:
        """Last virtual stage: computes the loss, receives no gradient."""
        return self.stage == self.stages - 1 and chunk == self.chunks - 1


def _full_backward(inp: torch.Tensor | None, out: torch.Tensor,
                   grad: torch.Tensor | None) -> torch.Tensor | None:
    """Backward through one micro-batch; returns the gradient of the stage input."""
    if grad is None:  # last virtual stage: ``out`` is the loss
        out.backward()
    else:
        torch.autograd.backward(out, grad_tensors=grad)
    return None if inp is None else inp.grad


def _recv_of(action: Action, chunks: StageChunks) -> tuple[str, int, int] | None:
    """The receive ``action`` needs before it can run, as PipeComm.exchange takes it."""
    if action.kind == "F" and not chunks.first(action.chunk):
        return ("forward", action.chunk, action.micro_batch)
    if action.kind == "B" and not chunks.last(action.chunk):
        return ("backward", action.chunk, action.micro_batch)
    return None


def _last_grad_actions(order: Sequence[Action], chunks: StageChunks,
                       zero_bubble: bool) -> dict[int, int]:
    """Index in ``order`` of the action that accumulates chunk ``c``'s last weight gradients."""
    out: dict[int, int] = {}
    for index, action in enumerate(order):
        c = action.chunk
        deferred = zero_bubble and (chunks.first(c) or _splits(chunks, c))
        if action.kind == ("W" if deferred else "B"):
            out[c] = index
    return out


def _splits(chunks: StageChunks, chunk: int) -> bool:
    return not chunks.split or bool(chunks.split[chunk])


def run_schedule(order: Sequence[Action], forward_step: ForwardStep, comm: PipeComm,
                 chunks: StageChunks,
                 before_last_grads: Callable[[int], None] | None = None,
                 observer: ComputeObserver | None = None) -> None:
    """Run ``order`` (this rank's actions of one step).

    ``before_last_grads(c)`` is called right before the action that accumulates chunk ``c``'s
    last weight gradients of the step (to arm data-parallel gradient buckets).
    """
    obs = observer or _NoObserver()
    zero_bubble = any(a.kind == "W" for a in order)
    backward = any(a.kind == "B" for a in order)
    last_grads = _last_grad_actions(order, chunks, zero_bubble)
    inputs: dict[tuple[int, int], torch.Tensor | None] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    weights: dict[tuple[int, int], PendingWeights] = {}
    received = comm.exchange([], _recv_of(order[0], chunks)) if order else None
    for index, action in enumerate(order):
        key, c, j = (action.chunk, action.micro_batch), action.chunk, action.micro_batch
        if before_last_grads is not None and last_grads.get(c) == index:
            before_last_grads(c)
        sends: list[tuple[str, int, int, torch.Tensor | None]] = []
        if action.kind == "F":
            with obs.compute("forward", j, c):
                out = forward_step(c, j, received)
            if backward:
                inputs[key], outputs[key] = received, out
            if not chunks.last(c):
                sends.append(("forward", c, j, out))
        elif action.kind == "B":
            inp, out = inputs.pop(key), outputs.pop(key)
            if not zero_bubble:
                with obs.compute("backward", j, c):
                    grad_in = _full_backward(inp, out, received)
            elif chunks.first(c):  # nothing to send: the whole backward runs as W
                grad_in, weights[key] = backward_input(out, received, None, ())
            elif _splits(chunks, c):
                with obs.compute("backward_input", j, c):
                    grad_in, weights[key] = backward_input(out, received, inp, chunks.params[c])
            else:  # layers recomputed in full: the whole backward now, no W
                with obs.compute("backward", j, c):
                    grad_in = _full_backward(inp, out, received)
            if not chunks.first(c):
                sends.append(("backward", c, j, grad_in))
        else:
            pending = weights.pop(key, None)
            if pending is not None:
                with obs.compute("backward_weight", j, c):
                    backward_weight(pending)
        following = order[index + 1] if index + 1 < len(order) else None
        recv = None if following is None else _recv_of(following, chunks)
        received = comm.exchange(sends, recv) if sends or recv else None


def forward_backward_1f1b(forward_step: Callable[[int, torch.Tensor | None], torch.Tensor],
                          num_micro_batches: int, comm: PipeComm, stage: int, num_stages: int,
                          before_last_backward: Callable[[], None] | None = None,
                          observer: ComputeObserver | None = None) -> None:
    """Megatron's non-interleaved 1F1B over micro-batches ``0 .. num_micro_batches - 1`` of a
    one-chunk stage (``forward_step(micro_batch, input)``)."""
    order = one_f_one_b(stage, num_stages, range(num_micro_batches))
    run_schedule(order, lambda c, j, x: forward_step(j, x), comm,
                 StageChunks(stage, num_stages, [[]]),
                 None if before_last_backward is None else lambda c: before_last_backward(),
                 observer)


@torch.no_grad()
def forward_only(forward_step: ForwardStep, micro_batches: Sequence[int], comm: PipeComm,
                 chunks: StageChunks, observer: ComputeObserver | None = None) -> None:
    """Forward of every micro-batch through every chunk of the pipeline (evaluation)."""
    order = forward_order(chunks.stage, chunks.stages, chunks.chunks, micro_batches)
    run_schedule(order, forward_step, comm, chunks, observer=observer)
