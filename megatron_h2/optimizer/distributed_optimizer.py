"""Optimizers for data-parallel training behind one interface, :class:`DataParallelOptimizer`.

* :class:`ReplicatedOptimizer`: every DP rank holds the full AdamW state and applies the full
  (all-reduced) gradient; a thin wrapper over :func:`build_optimizer`'s :class:`AdamW`.
* :class:`DistributedOptimizer` (``--use-distributed-optimizer``, ZeRO-1): each DP rank owns a
  contiguous, equally sized range of every gradient bucket, receives the summed gradient of only
  that range (reduce-scatter), keeps AdamW state for it alone, updates it on an fp32 master
  shard and all-gathers the updated parameters.

With bf16 / fp16 weights (``--bf16``, ``--fp16``) both update fp32 main weights (the replicated
one a full copy, the distributed one its master shard) from fp32 gradients and round the result
into the model (:mod:`megatron_h2.optimizer.main_params`), as Megatron-Core's mixed-precision
optimizers; :meth:`DataParallelOptimizer.main_weights` gives the fp32 weights for checkpoints.

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
from megatron_h2.optimizer import flat_params
from megatron_h2.optimizer.adamw import (
    ADAM_STATES,
    AdamW,
    adamw_kwargs,
    load_named_optimizer_state,
    optimizer_state_to_named,
    param_groups,
)
from megatron_h2.optimizer.main_params import Fp32Grads, copy_main_to_model, make_main_params

Names = dict[nn.Parameter, str]


@runtime_checkable
class DataParallelOptimizer(Protocol):
    """What the trainer needs from an optimizer under data parallelism.

    ``grad_buckets`` holds the gradients (its ``start_sync`` / ``finish_sync`` synchronise them);
    ``param_groups`` has torch's shape, so :meth:`LRSchedule.apply` works unchanged. Methods
    marked *collective* must be called on every rank of the DP group.
    """

    grad_buckets: GradBuckets
    grads: Fp32Grads
    """The gradients the update reads, one tensor per bucket (its buffer, or this rank's
    reduced shard of it; fp32 copies where the buckets are not fp32): ``grads.refresh()``."""

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

    def owned_main_weights(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, weight piece) for the weights this rank updates, as :meth:`owned_grads`
        cuts them: the fp32 main weights where parameters are bf16 / fp16, else the parameters'
        own values (no collective; what ``--log-params-norm`` sums, as Megatron)."""

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

    def main_weights(self) -> dict[nn.Parameter, torch.Tensor]:
        """Every parameter's whole fp32 main weight (collective for the distributed optimizer
        with bf16 / fp16 weights): what checkpoints store. fp32 parameters are their own."""

    def load_main_weights(self, values: dict[nn.Parameter, torch.Tensor]) -> None:
        """Set the main weights of the given parameters from whole fp32 tensors and round them
        into the model (no collective)."""

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
    """:class:`DataParallelOptimizer` over a full, per-rank :class:`AdamW`.

    ``grad_buckets`` must be in all-reduce mode. fp32 parameters: ``optimizer`` (from
    :func:`build_optimizer`) holds parameters of ``grad_buckets``. bf16 / fp16 parameters:
    ``main_params`` maps each parameter of ``grad_buckets`` to its fp32 main weight (from
    :func:`~megatron_h2.optimizer.main_params.make_main_params`), which ``optimizer`` holds.
    """

    def __init__(self, optimizer: AdamW, grad_buckets: GradBuckets,
                 main_params: dict[nn.Parameter, torch.Tensor] | None = None,
                 grads: Fp32Grads | None = None,
                 runs: Sequence[flat_params.FlatRun] = ()) -> None:
        if grad_buckets.reduce_scatter:
            raise ValueError("ReplicatedOptimizer needs all-reduce GradBuckets "
                             "(reduce_scatter=False)")
        if main_params is None and grad_buckets.param_dtype != torch.float32:
            raise ValueError("bf16 / fp16 parameters need fp32 main_params")
        self.mains = main_params
        if runs and main_params is not None:
            raise ValueError("flat runs are of fp32 parameters (no main_params)")
        self.runs = list(runs)  # fp32 parameters the optimizer steps over as flat tensors
        self._flats = frozenset(id(run.flat) for run in self.runs)
        known = {id(t) for t in (grad_buckets.params if main_params is None
                                 else main_params.values())} | self._flats
        if any(id(p) not in known for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("the optimizer holds a parameter that GradBuckets does not")
        self.optimizer = optimizer
        self.grad_buckets = grad_buckets
        self.grads = grads or Fp32Grads(grad_buckets, [b.buffer for b in grad_buckets.buckets])
        self.sharded = False

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def owned_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        self.grads.refresh()
        if self.mains is not None:
            return [(p, main.grad) for p, main in self.mains.items()]
        return [(p, p.grad) for p in self.grad_buckets.params if p.grad is not None]

    def owned_main_weights(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        if self.mains is not None:
            return [(p, main.detach()) for p, main in self.mains.items()]
        return [(p, p.detach()) for p in self.grad_buckets.params]

    def step(self) -> None:
        _check_synced(self.grad_buckets)
        self.grads.refresh()
        self.optimizer.step()
        if self.mains is not None:
            copy_main_to_model(self.mains)

    def zero_grad(self) -> None:
        self.grad_buckets.zero_grad()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def local_grad_sq_norm(self) -> torch.Tensor:
        return _sq_norm(self.grads.refresh())

    def grad_sq_norm(self) -> torch.Tensor:
        return self.local_grad_sq_norm()

    def clip_(self, coef: float | torch.Tensor) -> None:
        for grad in self.grads.refresh():
            grad.mul_(coef)

    def _state_names(self, names: Names) -> Names:
        return names if self.mains is None else {m: names[p] for p, m in self.mains.items()}

    def named_state(self, names: Names) -> dict[str, torch.Tensor]:
        return {**optimizer_state_to_named(self.optimizer, self._state_names(names), self._flats),
                **flat_params.runs_state_to_named(self.optimizer, self.runs, names)}

    def load_named_state(self, names: Names, tensors: dict[str, torch.Tensor]) -> None:
        load_named_optimizer_state(self.optimizer, self._state_names(names), tensors,
                                   self._flats)
        flat_params.load_runs_state(self.optimizer, self.runs, names, tensors, _check_named)

    def main_weights(self) -> dict[nn.Parameter, torch.Tensor]:
        if self.mains is None:
            return {p: p.detach() for p in self.grad_buckets.params}
        return dict(self.mains)

    @torch.no_grad()
    def load_main_weights(self, values: dict[nn.Parameter, torch.Tensor]) -> None:
        for param, value in values.items():
            if self.mains is not None:
                self.mains[param].copy_(value)
            param.copy_(value)

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


def _pieces_of(bucket: Bucket, rank: int, master: torch.Tensor,
               grad: torch.Tensor) -> list[_Piece]:
    """This rank's pieces of ``bucket``: views of its master shard whose ``.grad`` are views of
    ``grad`` (the fp32 reduced shard of the bucket)."""
    lo, hi = bucket.shard_range(rank)
    pieces = []
    for slot in bucket.slots:
        start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if start < end:
            piece = _Piece(slot.param, bucket.index, start - slot.offset, end - slot.offset,
                           start - lo, master[start - lo:end - lo])
            piece.master.grad = grad[start - lo:end - lo]
            piece.master.copy_(slot.param.detach().reshape(-1)[piece.param_start:
                                                               piece.param_end])
            pieces.append(piece)
    return pieces


class DistributedOptimizer:
    """ZeRO-1 AdamW: optimizer state and the update sharded over the data-parallel group.

    ``grad_buckets`` must be in reduce-scatter mode. Hyper-parameters and parameter groups are
    those of :func:`build_optimizer` (:func:`param_groups`: no decay for parameters with
    ``ndim < 2``, ``--decoupled-lr`` for the embedding and output layer, which needs ``names``);
    because a rank's range may cover parts of several parameters, the inner :class:`AdamW`
    runs on one view of the master shard per owned parameter piece, grouped like the parameter.

    fp32 parameters are themselves the master copy: the master shard is refreshed from them at
    every step, so loading model weights needs no extra call. bf16 / fp16 parameters: the master
    shard starts from them and is the only fp32 copy (:meth:`load_main_weights` sets it); the
    gradient buckets may be in the parameters' dtype (reduced shards copied to fp32 each step),
    and the updated shard is rounded to the parameters' dtype before the all-gather.

    ``overlap_param_gather`` (Megatron's ``--overlap-param-gather``): :meth:`step` only issues
    the all-gathers of the updated (rounded) parameters, asynchronously, in the order the next
    forward needs the buckets; :meth:`install_param_gather_hooks` makes every module wait for
    its parameters' buckets just before its forward, so later buckets arrive while earlier
    layers compute. Until then the parameters hold their previous values
    (:meth:`finish_param_sync`).
    """

    def __init__(self, grad_buckets: GradBuckets, config: OptimizerConfig,
                 kernels: Kernels | None = None, names: Names | None = None,
                 overlap_param_gather: bool = False) -> None:
        if not grad_buckets.reduce_scatter:
            raise ValueError("DistributedOptimizer needs GradBuckets(reduce_scatter=True)")
        self.grad_buckets = grad_buckets
        self.dp_group, self.dp_rank = grad_buckets.dp_group, grad_buckets.dp_rank
        self.params_are_main = grad_buckets.param_dtype == torch.float32
        self.grads = Fp32Grads(grad_buckets, [b.shard_grad for b in grad_buckets.buckets])
        self._masters = [torch.zeros(b.shard_numel, dtype=torch.float32, device=b.buffer.device)
                         for b in grad_buckets.buckets]
        with torch.no_grad():
            self.pieces = [piece for bucket, master, grad in zip(
                grad_buckets.buckets, self._masters, self.grads.tensors)
                for piece in _pieces_of(bucket, self.dp_rank, master, grad)]
        if names is None and config.decoupled_lr is not None:
            raise ValueError("--decoupled-lr needs the parameter names (names=...)")
        names = names or {}
        groups = param_groups([(names.get(p.param, ""), p.param, p.master) for p in self.pieces],
                              config)
        self.optimizer = AdamW(groups, **adamw_kwargs(config, kernels))
        self._has_state = False
        self.sharded = True
        self.overlap_param_gather = overlap_param_gather
        # bucket index -> (bucket, gathered buffer, collective) of gathers still in flight
        self._in_flight: dict[int, tuple[Bucket, torch.Tensor, dist.Work]] = {}

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        self.grad_buckets.zero_grad()

    def local_grad_sq_norm(self) -> torch.Tensor:
        return _sq_norm(self.grads.refresh())

    def grad_sq_norm(self) -> torch.Tensor:
        sq = self.local_grad_sq_norm()
        if self.dp_group is not None:
            dist.all_reduce(sq, group=self.dp_group)
        return sq

    def clip_(self, coef: float | torch.Tensor) -> None:
        for grad in self.grads.refresh():
            grad.mul_(coef)

    def owned_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        self.grads.refresh()
        return [(piece.param, piece.master.grad) for piece in self.pieces]

    def owned_main_weights(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        # fp32 parameters are their own master (the shard is refreshed from them at each step)
        return [(piece.param, piece.param.detach().reshape(-1)[piece.param_start:piece.param_end]
                 if self.params_are_main else piece.master.detach()) for piece in self.pieces]

    def step(self) -> None:
        """AdamW on this rank's shard, then all-gather the parameters (collective); with
        ``overlap_param_gather`` the all-gathers are only issued (see the class doc)."""
        _check_synced(self.grad_buckets)
        self.finish_param_sync()  # parameters no forward used since the last step
        self.grads.refresh()
        with torch.no_grad():
            if self.params_are_main:
                for piece in self.pieces:
                    piece.master.copy_(piece.param.detach().reshape(-1)[piece.param_start:
                                                                         piece.param_end])
            self.optimizer.step()
            if self.overlap_param_gather and self.dp_group is not None:
                self._issue_gathers()
            else:
                self._gather_params()
        self._has_state = True

    def _start_gather(self, bucket: Bucket) -> tuple[Bucket, torch.Tensor, dist.Work]:
        """Issue the all-gather of ``bucket``'s updated weights, rounded to the parameters'
        dtype first (as Megatron: the gather moves bf16 / fp16, the fp32 master stays here)."""
        master = self._masters[bucket.index]
        dtype = self.grad_buckets.param_dtype
        full = torch.empty(bucket.buffer.numel(), dtype=dtype, device=master.device)
        return bucket, full, all_gather_flat(full, master.to(dtype), self.dp_group,
                                             async_op=True)

    def _issue_gathers(self) -> None:
        """Start every bucket's all-gather; the last bucket holds the parameters a forward uses
        first (buckets follow reverse registration order), so it goes first."""
        for bucket in reversed(self.grad_buckets.buckets):
            self._in_flight[bucket.index] = self._start_gather(bucket)

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
        for bucket in buckets:  # at most two buckets in flight
            in_flight.append(self._start_gather(bucket))
            if len(in_flight) > 1:
                _finish_gather(*in_flight.popleft())
        while in_flight:
            _finish_gather(*in_flight.popleft())

    # ----------------------------------------------------------------- checkpoints
    def main_weights(self) -> dict[nn.Parameter, torch.Tensor]:
        """Whole fp32 weights; all-gathers the master shards (collective) unless the parameters
        are fp32 (their own master)."""
        if self.params_are_main:
            return {p: p.detach() for p in self.grad_buckets.params}
        out: dict[nn.Parameter, torch.Tensor] = {}
        for bucket, master in zip(self.grad_buckets.buckets, self._masters):
            full = master
            if self.dp_group is not None:
                full = torch.empty(bucket.buffer.numel(), dtype=torch.float32,
                                   device=master.device)
                all_gather_flat(full, master, self.dp_group)
            for slot in bucket.slots:
                out[slot.param] = full[slot.offset:slot.offset + slot.numel].view_as(slot.param)
        return out

    @torch.no_grad()
    def load_main_weights(self, values: dict[nn.Parameter, torch.Tensor]) -> None:
        self.finish_param_sync()  # a gather still in flight must not overwrite what is loaded
        for piece in self.pieces:
            if piece.param in values:
                flat = values[piece.param].reshape(-1)[piece.param_start:piece.param_end]
                piece.master.copy_(flat)
        for param, value in values.items():
            param.copy_(value)

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
        # Adam's moments are fp32 whatever the buckets' dtype (fp16 / bf16 gradient buckets)
        full = torch.empty(bucket.buffer.numel(), dtype=local.dtype, device=local.device)
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
                                  grad_dtype: torch.dtype = torch.float32,
                                  overlap_param_gather: bool = False,
                                  params: Sequence[nn.Parameter] | None = None,
                                  flat_experts: bool = True) -> DataParallelOptimizer:
    """GradBuckets (in ``grad_dtype``) over ``model``'s trainable parameters (or ``params``,
    some of them) plus the matching optimizer (``deferred``: see :class:`GradBuckets`;
    ``overlap_param_gather``: see :class:`DistributedOptimizer`, which installs its forward
    pre-hooks on ``model``). Parameters that are not fp32 get fp32 main weights, taken from
    their current values. ``flat_experts``: under the replicated optimizer with fp32
    parameters, the routed experts' parameters that lie side by side in a bucket are stepped
    over as one flat tensor each run (:mod:`megatron_h2.optimizer.flat_params`; the same
    numbers, fewer tensors)."""
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    buckets = GradBuckets(params, dp_group, bucket_size_mb, overlap,
                          reduce_scatter=use_distributed_optimizer, deferred=deferred,
                          grad_dtype=grad_dtype)
    names = {p: n for n, p in model.named_parameters()}
    if use_distributed_optimizer:
        optimizer = DistributedOptimizer(buckets, config, kernels, names, overlap_param_gather)
        if overlap_param_gather:
            optimizer.install_param_gather_hooks(model)
        return optimizer
    if overlap_param_gather:
        raise ValueError("overlap_param_gather needs the distributed optimizer")
    if buckets.param_dtype == torch.float32:
        items, runs = flat_params.adamw_items(buckets, params, names, flat_experts)
        inner = AdamW(param_groups(items, config), **adamw_kwargs(config, kernels))
        return ReplicatedOptimizer(inner, buckets, runs=runs)
    grads = Fp32Grads(buckets, [b.buffer for b in buckets.buckets])
    mains = make_main_params(buckets, grads)
    inner = AdamW(param_groups([(names[p], p, mains[p]) for p in params], config),
                  **adamw_kwargs(config, kernels))
    return ReplicatedOptimizer(inner, buckets, mains, grads)
