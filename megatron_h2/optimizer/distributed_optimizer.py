"""Optimizers for data-parallel training behind one interface, :class:`DataParallelOptimizer`.

* :class:`ReplicatedOptimizer`: every DP rank holds the full AdamW state and applies the full
  (all-reduced) gradient; a thin wrapper over :func:`build_optimizer`'s ``torch.optim.AdamW``.
* :class:`DistributedOptimizer` (``--use-distributed-optimizer``, ZeRO-1): each DP rank owns a
  contiguous, equally sized range of every gradient bucket, receives the summed gradient of only
  that range (reduce-scatter), keeps AdamW state for it alone, updates it on an fp32 master
  shard and all-gathers the updated parameters.

Both keep optimizer state in checkpoints as full, unsharded named tensors
(``"<param name>.exp_avg" / ".exp_avg_sq" / ".step"``, the format of
:func:`optimizer_state_to_named`), so a checkpoint loads under any DP size and either optimizer.

A training step with either::

    opt.zero_grad()
    ... micro-batches; opt.grad_buckets.start_sync() before the last backward ...
    opt.grad_buckets.finish_sync()
    grad_norm = clip_grad_norm(opt, max_norm)   # or combine opt.local_grad_sq_norm() yourself
    opt.set_lr(lr)
    opt.step()
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from megatron_h2.config import OptimizerConfig
from megatron_h2.devices.kernels import Kernels
from megatron_h2.distributed.grad_sync import Bucket, GradBuckets, all_gather_flat
from megatron_h2.errors import ConfigError
from megatron_h2.optimizer.adamw import (
    ADAM_STATES,
    adamw_kwargs,
    build_optimizer,
    load_named_optimizer_state,
    optimizer_state_to_named,
    param_groups,
)

Names = dict[nn.Parameter, str]


@runtime_checkable
class DataParallelOptimizer(Protocol):
    """What the trainer needs from an optimizer under data parallelism.

    ``grad_buckets`` holds the gradients (its ``start_sync`` / ``finish_sync`` synchronise them);
    ``param_groups`` has torch's shape, so :meth:`LRSchedule.apply` works unchanged. Methods
    marked *collective* must be called on every rank of the DP group.
    """

    grad_buckets: GradBuckets

    @property
    def param_groups(self) -> list[dict]: ...

    def step(self) -> None:
        """Apply the synchronised gradients (collective for the distributed optimizer)."""

    def zero_grad(self) -> None:
        """Zero the gradient buffers (never sets ``.grad`` to None)."""

    def set_lr(self, lr: float) -> None:
        """Learning rate for the next :meth:`step`."""

    sharded: bool
    """True when each DP rank applies only its shard of the gradient (ZeRO-1)."""

    def owned_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, gradient piece) for every gradient element this rank applies, after
        :meth:`GradBuckets.finish_sync`: whole reduced gradients when replicated, this rank's
        reduced shard pieces under ZeRO-1. Shared by norm computation and TP reductions."""

    def local_grad_sq_norm(self) -> torch.Tensor:
        """Squared L2 norm (fp32 scalar tensor) of the gradient elements this rank applies.

        Distributed optimizer: this rank's shard, to be summed over the DP group. Replicated:
        the whole gradient, identical on every DP rank (do not sum it over DP).
        """

    def grad_sq_norm(self) -> torch.Tensor:
        """Squared L2 norm of this replica's whole gradient (collective where sharded)."""

    def clip_(self, coef: float | torch.Tensor) -> None:
        """Multiply the gradient elements this rank applies by ``coef``."""

    def named_state(self, names: Names) -> dict[str, torch.Tensor]:
        """Full AdamW state as ``{"<name>.exp_avg" | ".exp_avg_sq" | ".step": tensor}``
        (collective for the distributed optimizer); empty before the first step."""

    def load_named_state(self, names: Names, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`named_state`: takes full tensors, keeps what this rank owns."""

    def finish_param_sync(self) -> None:
        """Wait for any parameter all-gather still in flight (``--overlap-param-gather``) and
        write the gathered values into the parameters; call before reading the parameters
        outside a forward pass (checkpoints, norms). A no-op when nothing is in flight."""


def clip_grad_norm(optimizer: DataParallelOptimizer, max_norm: float) -> torch.Tensor:
    """Clip the replica's gradient to ``max_norm`` (0: no clipping); return its norm.

    Same rule as ``torch.nn.utils.clip_grads_with_norm_``. Collective under the distributed
    optimizer; model-parallel groups are not included.
    """
    norm = optimizer.grad_sq_norm().sqrt()
    if max_norm > 0:
        optimizer.clip_((max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


def _check_synced(grad_buckets: GradBuckets) -> None:
    if grad_buckets.needs_sync:
        raise RuntimeError("optimizer step with unsynchronised gradients; call "
                           "grad_buckets.finish_sync() after the last backward")


def _check_named(names: Names, tensors: dict[str, torch.Tensor], param: nn.Parameter) -> str:
    name = names[param]
    missing = [k for k in (*ADAM_STATES, "step") if f"{name}.{k}" not in tensors]
    if missing:
        raise ConfigError(f"checkpoint optimizer state lacks {name}.{missing[0]}; "
                          "load with --no-load-optim to start the optimizer fresh")
    for key in ADAM_STATES:
        if tensors[f"{name}.{key}"].numel() != param.numel():
            raise ConfigError(f"checkpoint optimizer state {name}.{key} has "
                              f"{tensors[f'{name}.{key}'].numel()} elements, the parameter "
                              f"{param.numel()}; the checkpoint is for another model shape")
    return name


class ReplicatedOptimizer:
    """:class:`DataParallelOptimizer` over a full, per-rank ``torch.optim`` optimizer.

    ``optimizer`` (from :func:`build_optimizer`) must only hold parameters of ``grad_buckets``,
    which must be in all-reduce mode.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, grad_buckets: GradBuckets) -> None:
        if grad_buckets.reduce_scatter:
            raise ValueError("ReplicatedOptimizer needs all-reduce GradBuckets "
                             "(reduce_scatter=False)")
        known = {id(p) for p in grad_buckets.params}
        if any(id(p) not in known for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("the optimizer holds a parameter that GradBuckets does not")
        self.optimizer = optimizer
        self.grad_buckets = grad_buckets
        self.sharded = False

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def owned_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(p, p.grad) for p in self.grad_buckets.params if p.grad is not None]

    def step(self) -> None:
        _check_synced(self.grad_buckets)
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.grad_buckets.zero_grad()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def local_grad_sq_norm(self) -> torch.Tensor:
        return _sq_norm([b.buffer for b in self.grad_buckets.buckets])

    def grad_sq_norm(self) -> torch.Tensor:
        return self.local_grad_sq_norm()

    def clip_(self, coef: float | torch.Tensor) -> None:
        for bucket in self.grad_buckets.buckets:
            bucket.buffer.mul_(coef)

    def named_state(self, names: Names) -> dict[str, torch.Tensor]:
        return optimizer_state_to_named(self.optimizer, names)

    def load_named_state(self, names: Names, tensors: dict[str, torch.Tensor]) -> None:
        load_named_optimizer_state(self.optimizer, names, tensors)

    def finish_param_sync(self) -> None:
        """Nothing is ever in flight: every rank applies the whole update itself."""


def _sq_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack([t.float().square().sum() for t in tensors]).sum()


@dataclass(frozen=True)
class _Piece:
    """The part ``[param_start, param_end)`` of a flattened parameter that this rank owns."""

    param: nn.Parameter
    bucket: int
    param_start: int
    param_end: int
    shard_start: int  # where the piece starts in this rank's shard of the bucket
    master: torch.Tensor  # view of the fp32 master shard; a parameter of the inner AdamW

    @property
    def shard_end(self) -> int:
        return self.shard_start + self.param_end - self.param_start


def _pieces_of(bucket: Bucket, rank: int, master: torch.Tensor) -> list[_Piece]:
    lo, hi = bucket.shard_range(rank)
    pieces = []
    for slot in bucket.slots:
        start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if start < end:
            piece = _Piece(slot.param, bucket.index, start - slot.offset, end - slot.offset,
                           start - lo, master[start - lo:end - lo])
            piece.master.grad = bucket.shard_grad[start - lo:end - lo]
            pieces.append(piece)
    return pieces


class DistributedOptimizer:
    """ZeRO-1 AdamW: optimizer state and the update sharded over the data-parallel group.

    ``grad_buckets`` must be in reduce-scatter mode. Hyper-parameters and parameter groups are
    those of :func:`build_optimizer` (:func:`param_groups`: no decay for parameters with
    ``ndim < 2``, ``--decoupled-lr`` for the embedding and output layer, which needs ``names``);
    because a rank's range may cover parts of several parameters, the inner ``torch.optim.AdamW``
    runs on one view of the master shard per owned parameter piece, grouped like the parameter.

    The parameters are fp32 and are themselves the master copy: the master shard is refreshed
    from them at every step, so loading model weights needs no extra call.

    ``overlap_param_gather`` (Megatron's ``--overlap-param-gather``): :meth:`step` only issues
    the all-gathers of the updated parameters, asynchronously, in the order the next forward
    needs the buckets; :meth:`install_param_gather_hooks` makes every module wait for its
    parameters' buckets just before its forward, so later buckets arrive while earlier layers
    compute. Until then the parameters hold their previous values (:meth:`finish_param_sync`).
    """

    def __init__(self, grad_buckets: GradBuckets, config: OptimizerConfig,
                 kernels: Kernels | None = None, names: Names | None = None,
                 overlap_param_gather: bool = False) -> None:
        if not grad_buckets.reduce_scatter:
            raise ValueError("DistributedOptimizer needs GradBuckets(reduce_scatter=True)")
        self.grad_buckets = grad_buckets
        self.dp_group, self.dp_rank = grad_buckets.dp_group, grad_buckets.dp_rank
        self._masters = [torch.zeros(b.shard_numel, dtype=torch.float32, device=b.buffer.device)
                         for b in grad_buckets.buckets]
        self.pieces = [piece for bucket, master in zip(grad_buckets.buckets, self._masters)
                       for piece in _pieces_of(bucket, self.dp_rank, master)]
        if names is None and config.decoupled_lr is not None:
            raise ValueError("--decoupled-lr needs the parameter names (names=...)")
        names = names or {}
        groups = param_groups([(names.get(p.param, ""), p.param, p.master) for p in self.pieces],
                              config)
        if not self.pieces:  # this rank owns only padding; torch.optim needs a parameter
            placeholder = torch.zeros(0)
            placeholder.grad = torch.zeros(0)
            groups[1]["params"].append(placeholder)
        self.optimizer = torch.optim.AdamW(groups, **adamw_kwargs(config, kernels))
        self._has_state = False
        self.sharded = True
        self.overlap_param_gather = overlap_param_gather
        # bucket index -> (bucket, gathered buffer, collective) of gathers still in flight
        self._in_flight: dict[int, tuple[Bucket, torch.Tensor, dist.Work]] = {}

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def owned_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(piece.param, piece.master.grad) for piece in self.pieces]

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        self.grad_buckets.zero_grad()

    def local_grad_sq_norm(self) -> torch.Tensor:
        return _sq_norm([b.shard_grad for b in self.grad_buckets.buckets])

    def grad_sq_norm(self) -> torch.Tensor:
        sq = self.local_grad_sq_norm()
        if self.dp_group is not None:
            dist.all_reduce(sq, group=self.dp_group)
        return sq

    def clip_(self, coef: float | torch.Tensor) -> None:
        for bucket in self.grad_buckets.buckets:
            bucket.shard_grad.mul_(coef)

    def step(self) -> None:
        """AdamW on this rank's shard, then all-gather the parameters (collective); with
        ``overlap_param_gather`` the all-gathers are only issued (see the class doc)."""
        _check_synced(self.grad_buckets)
        self.finish_param_sync()  # parameters no forward used since the last step
        with torch.no_grad():
            for piece in self.pieces:
                piece.master.copy_(piece.param.detach().reshape(-1)[piece.param_start:
                                                                     piece.param_end])
            self.optimizer.step()
            if self.overlap_param_gather and self.dp_group is not None:
                self._issue_gathers()
            else:
                self._gather_params()
        self._has_state = True

    def _issue_gathers(self) -> None:
        """Start every bucket's all-gather; the last bucket holds the parameters a forward uses
        first (buckets follow reverse registration order), so it goes first."""
        for bucket in reversed(self.grad_buckets.buckets):
            full = torch.empty_like(bucket.buffer)
            work = all_gather_flat(full, self._masters[bucket.index], self.dp_group,
                                   async_op=True)
            self._in_flight[bucket.index] = (bucket, full, work)

    def _finish_buckets(self, indices) -> None:
        for index in indices:
            entry = self._in_flight.pop(index, None)
            if entry is not None:
                with torch.no_grad():
                    _finish_gather(*entry)

    def finish_param_sync(self) -> None:
        self._finish_buckets(list(self._in_flight))

    def install_param_gather_hooks(self, model: nn.Module) -> None:
        """Forward pre-hooks on every module of ``model`` that holds parameters of these
        buckets: each waits for its own parameters' buckets before its forward runs."""
        bucket_of = {id(slot.param): bucket.index for bucket in self.grad_buckets.buckets
                     for slot in bucket.slots}
        for module in model.modules():
            mine = sorted({bucket_of[id(p)] for p in module.parameters(recurse=False)
                           if id(p) in bucket_of}, reverse=True)
            if mine:
                module.register_forward_pre_hook(
                    lambda _module, _args, mine=mine: self._finish_buckets(mine)
                    if self._in_flight else None)

    def _gather_params(self) -> None:
        buckets = self.grad_buckets.buckets
        if self.dp_group is None:
            for bucket, master in zip(buckets, self._masters):
                _copy_into_params(bucket, master)
            return
        in_flight: deque[tuple[Bucket, torch.Tensor, dist.Work]] = deque()
        for bucket, master in zip(buckets, self._masters):  # at most two buckets in flight
            full = torch.empty_like(bucket.buffer)
            in_flight.append((bucket, full, all_gather_flat(full, master, self.dp_group,
                                                            async_op=True)))
            if len(in_flight) > 1:
                _finish_gather(*in_flight.popleft())
        while in_flight:
            _finish_gather(*in_flight.popleft())

    # ----------------------------------------------------------------- checkpoints
    def named_state(self, names: Names) -> dict[str, torch.Tensor]:
        """Full (all-gathered) AdamW state of every parameter; collective."""
        self.finish_param_sync()
        if not self._has_state:
            return {}
        out: dict[str, torch.Tensor] = {}
        steps = self._gather_steps()
        for bucket in self.grad_buckets.buckets:
            for key in ADAM_STATES:
                full = self._gather_state(bucket, key)
                for slot in bucket.slots:
                    out[f"{names[slot.param]}.{key}"] = (
                        full[slot.offset:slot.offset + slot.numel].view_as(slot.param).clone())
        for param, step in zip(self.grad_buckets.params, steps):
            out[f"{names[param]}.step"] = torch.tensor(step, dtype=torch.float32)
        return {f"{names[p]}.{k}": out[f"{names[p]}.{k}"]
                for p in self.grad_buckets.params for k in (*ADAM_STATES, "step")}

    def _gather_state(self, bucket: Bucket, key: str) -> torch.Tensor:
        local = torch.zeros_like(self._masters[bucket.index])
        for piece in self.pieces:
            if piece.bucket == bucket.index:
                local[piece.shard_start:piece.shard_end] = self.optimizer.state[piece.master][key]
        if self.dp_group is None:
            return local
        full = torch.empty_like(bucket.buffer)
        all_gather_flat(full, local, self.dp_group)
        return full

    def _gather_steps(self) -> list[float]:
        params = self.grad_buckets.params
        index = {id(p): i for i, p in enumerate(params)}
        device = self._masters[0].device if self._masters else torch.device("cpu")
        steps = torch.zeros(len(params), dtype=torch.float64, device=device)
        for piece in self.pieces:
            steps[index[id(piece.param)]] = float(self.optimizer.state[piece.master]["step"])
        if self.dp_group is not None:
            dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=self.dp_group)
        return steps.tolist()

    def load_named_state(self, names: Names, tensors: dict[str, torch.Tensor]) -> None:
        """Take full tensors (any DP layout saved them) and keep this rank's pieces."""
        self.finish_param_sync()
        for param in self.grad_buckets.params:
            _check_named(names, tensors, param)
        step_on_device = bool(self.optimizer.defaults.get("fused"))
        for piece in self.pieces:
            name = names[piece.param]
            state = self.optimizer.state[piece.master]
            for key in ADAM_STATES:
                flat = tensors[f"{name}.{key}"].reshape(-1)[piece.param_start:piece.param_end]
                state[key] = flat.to(piece.master.device, torch.float32).clone()
            step_device = piece.master.device if step_on_device else "cpu"
            state["step"] = tensors[f"{name}.step"].to(step_device, torch.float32).clone()
        self._has_state = True


def _copy_into_params(bucket: Bucket, full: torch.Tensor) -> None:
    for slot in bucket.slots:
        slot.param.detach().copy_(full[slot.offset:slot.offset + slot.numel].view_as(slot.param))


def _finish_gather(bucket: Bucket, full: torch.Tensor, work: dist.Work) -> None:
    work.wait()
    _copy_into_params(bucket, full)


def build_data_parallel_optimizer(model: nn.Module, config: OptimizerConfig,
                                  dp_group: dist.ProcessGroup | None, *,
                                  use_distributed_optimizer: bool = False,
                                  bucket_size_mb: float = 25.0, overlap: bool = True,
                                  kernels: Kernels | None = None,
                                  deferred: Sequence[nn.Parameter] = (),
                                  overlap_param_gather: bool = False) -> DataParallelOptimizer:
    """GradBuckets over ``model``'s trainable parameters plus the matching optimizer
    (``deferred``: see :class:`GradBuckets`; ``overlap_param_gather``: see
    :class:`DistributedOptimizer`, which installs its forward pre-hooks on ``model``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    buckets = GradBuckets(params, dp_group, bucket_size_mb, overlap,
                          reduce_scatter=use_distributed_optimizer, deferred=deferred)
    if use_distributed_optimizer:
        names = {p: n for n, p in model.named_parameters()}
        optimizer = DistributedOptimizer(buckets, config, kernels, names, overlap_param_gather)
        if overlap_param_gather:
            optimizer.install_param_gather_hooks(model)
        return optimizer
    if overlap_param_gather:
        raise ValueError("overlap_param_gather needs the distributed optimizer")
    return ReplicatedOptimizer(build_optimizer(model, config, kernels), buckets)
