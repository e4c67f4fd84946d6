"""Runs of parameters the optimizer steps over as one flat tensor.

A MoE layer keeps one weight per expert (Megatron-Core's names, ``local_experts.{e}``), so an
AdamW over the parameters as they are runs every one of its element-wise operations once per
expert matrix. Their gradients already lie side by side in a gradient bucket's buffer
(:class:`~megatron_h2.distributed.grad_sync.Bucket`), as Megatron's DDP keeps them; a
:class:`FlatRun` puts their weights side by side as well, in the same order: the weights
become views of one contiguous tensor (:attr:`FlatRun.flat`) whose ``.grad`` is their range of
the bucket's buffer, and the optimizer updates that one tensor. AdamW is element-wise, so each
element gets the very same arithmetic as per parameter (bit for bit); the parameters, their
names, the checkpoints and the optimizer state by name stay what they are (the state of a run
is cut into each parameter's part when it is read, and put together when it is loaded).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch import nn

from megatron_h2.distributed.grad_sync import Bucket, GradBuckets
from megatron_h2.distributed.topology import EXPERT_PARALLEL_ATTR
from megatron_h2.optimizer.adamw import ADAM_STATES, AdamW


def is_routed_expert(param: nn.Parameter) -> bool:
    """A MoE layer's routed expert's parameter (the runs flattened by default)."""
    return bool(getattr(param, EXPERT_PARALLEL_ATTR, False))


@dataclass(frozen=True)
class FlatRun:
    """``params``, consecutive in one bucket, as views of ``flat`` (at ``offsets``)."""

    flat: torch.Tensor
    params: tuple[nn.Parameter, ...]
    offsets: tuple[int, ...]

    def views(self, tensor: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Each parameter's part of a tensor shaped like :attr:`flat`, in its shape."""
        return [(p, tensor[o:o + p.numel()].view_as(p)) for p, o in zip(self.params, self.offsets)]


def _runs_of(bucket: Bucket, select: Callable[[nn.Parameter], bool],
             key: Callable[[nn.Parameter], Hashable]) -> list[list[int]]:
    """Slot indices of ``bucket`` in runs of two or more selected parameters of one key."""
    runs: list[list[int]] = []
    current: list[int] = []
    for index, slot in enumerate(bucket.slots):
        chosen = select(slot.param)
        if chosen and current and key(slot.param) == key(bucket.slots[current[0]].param):
            current.append(index)
            continue
        if len(current) > 1:
            runs.append(current)
        current = [index] if chosen else []
    if len(current) > 1:
        runs.append(current)
    return runs


@torch.no_grad()
def flatten_runs(buckets: GradBuckets, select: Callable[[nn.Parameter], bool],
                 key: Callable[[nn.Parameter], Hashable]) -> list[FlatRun]:
    """Make every run of two or more ``select`` ed fp32 parameters that lie next to each other
    in a bucket and share ``key`` (their optimizer parameter group) views of one flat tensor,
    whose ``.grad`` is their range of the bucket's buffer (all-reduce buckets whose buffers are
    the parameters' ``.grad``)."""
    out = []
    for bucket in buckets.buckets:
        for indices in _runs_of(bucket, select, key):
            slots = [bucket.slots[i] for i in indices]
            start = slots[0].offset
            total = slots[-1].offset + slots[-1].numel - start
            first = slots[0].param
            flat = torch.empty(total, dtype=first.dtype, device=first.device)
            offsets = []
            for slot in slots:
                at = slot.offset - start
                flat[at:at + slot.numel].copy_(slot.param.reshape(-1))
                slot.param.data = flat[at:at + slot.numel].view_as(slot.param)
                offsets.append(at)
            flat.grad = bucket.buffer[start:start + total]
            out.append(FlatRun(flat, tuple(s.param for s in slots), tuple(offsets)))
    return out


def adamw_items(buckets: GradBuckets, params: list[nn.Parameter],
                names: dict[nn.Parameter, str], flat_experts: bool
                ) -> tuple[list[tuple[str, nn.Parameter, torch.Tensor]], list[FlatRun]]:
    """``(name, parameter, tensor the optimizer updates)`` for ``params`` (fp32, in all-reduce
    ``buckets``), each run of routed experts as one flat tensor (named by its first parameter,
    grouped like it) where ``flat_experts`` is set and the buckets' buffers are the ``.grad``;
    and the runs."""
    runs = (flatten_runs(buckets, is_routed_expert, lambda p: p.ndim < 2)
            if flat_experts and buckets.direct else [])
    in_runs = {id(p) for run in runs for p in run.params}
    items = [(names[p], p, p) for p in params if id(p) not in in_runs]
    items += [(names[run.params[0]], run.params[0], run.flat) for run in runs]
    return items, runs


def runs_state_to_named(optimizer: AdamW, runs: list[FlatRun],
                        names: dict[nn.Parameter, str]) -> dict[str, torch.Tensor]:
    """The Adam moments and step of every run's parameters, by name, as per parameter."""
    out: dict[str, torch.Tensor] = {}
    for run in runs:
        state = optimizer.state.get(run.flat, {})
        for key in ADAM_STATES:
            if key in state:
                out.update({f"{names[p]}.{key}": v.detach().clone()
                            for p, v in run.views(state[key])})
        if "step" in state:
            out.update({f"{names[p]}.step": torch.as_tensor(state["step"]).detach().clone()
                        for p in run.params})
    return out


def load_runs_state(optimizer: AdamW, runs: list[FlatRun],
                    names: dict[nn.Parameter, str], tensors: dict[str, torch.Tensor],
                    check: Callable[[dict[nn.Parameter, str], dict[str, torch.Tensor],
                                     nn.Parameter], str]) -> None:
    """Inverse of :func:`runs_state_to_named` (``check`` names a parameter whose state is
    missing or of another size, as for the others)."""
    for run in runs:
        for param in run.params:
            check(names, tensors, param)
        state = optimizer.state[run.flat]
        for key in ADAM_STATES:
            state[key] = torch.cat([tensors[f"{names[p]}.{key}"].reshape(-1) for p in run.params]
                                   ).to(run.flat.device, run.flat.dtype)
        step_device = run.flat.device if optimizer.defaults.get("fused") else "cpu"
        state["step"] = tensors[f"{names[run.params[0]]}.step"].to(step_device,
                                                                   torch.float32).clone()
