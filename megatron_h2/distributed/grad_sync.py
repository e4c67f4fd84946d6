"""Data-parallel gradient synchronisation that overlaps with backward.

:class:`GradBuckets` packs the gradients of a model replica into a few contiguous buffers
("buckets", fp32 unless ``grad_dtype`` says otherwise); every parameter's ``main_grad`` is a view
into its bucket's buffer, so a bucket is synchronised with one collective and no copies. Buckets
follow reverse registration order, the order in which gradients become ready during backward.

Where a parameter has the buckets' dtype, its ``.grad`` is that same view and autograd
accumulates into it. Otherwise (bf16 weights with fp32 gradient accumulation, Megatron-Core's
``main_grad``) autograd leaves each backward's gradient in ``.grad``, a hook adds it to
``main_grad`` and frees it, so micro-batch gradients accumulate in the buckets' dtype.

Typical step with gradient accumulation::

    buckets.zero_grad()
    for i, micro_batch in enumerate(micro_batches):
        if i == len(micro_batches) - 1:
            buckets.start_sync()   # the last backward launches each bucket once it is complete
        loss_of(micro_batch).backward()
    buckets.finish_sync()          # launch the rest, wait for all

The loss is already divided by the token count of the *global* batch, so gradients are
**summed** over the data-parallel group, never averaged. In ``reduce_scatter`` mode (the
distributed optimizer) each rank only receives the summed gradient of its own range of every
bucket, in :attr:`Bucket.shard_grad`.

Collectives are launched strictly in bucket order on every rank, so ranks whose backward reaches
the parameters in a different order (or leaves some of them without a gradient) still issue
matching collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

# torch >= 2.13 renamed the flat collectives; older releases only have the *_tensor names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

GRAD_DTYPE = torch.float32
"""The default dtype of the gradient buckets."""


def group_size(group: ProcessGroup | None) -> int:
    """Size of ``group``; ``None`` means no data parallelism (size 1)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 when ``group`` is ``None``."""
    return 0 if group is None else dist.get_rank(group)


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup,
                    async_op: bool = False) -> dist.Work | None:
    """``output`` (size ``len(shard) * group size``) <- every rank's ``shard``, in rank order."""
    return _all_gather_flat(output, shard, group=group, async_op=async_op)


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter's gradient lives in its bucket's buffer."""

    param: nn.Parameter
    offset: int
    numel: int


class Bucket:
    """Parameters that share one flat gradient buffer, padded to a multiple of the DP size.

    Rank ``r`` of the data-parallel group owns ``buffer[r * shard_numel:(r + 1) * shard_numel]``
    (see :meth:`shard_range`); padding elements have no parameter and stay zero.
    """

    def __init__(self, index: int, params: Sequence[nn.Parameter], dp_size: int,
                 device: torch.device, dtype: torch.dtype = GRAD_DTYPE) -> None:
        self.index = index
        self.slots: list[ParamSlot] = []
        offset = 0
        for param in params:
            self.slots.append(ParamSlot(param, offset, param.numel()))
            offset += param.numel()
        self.numel = offset
        self.shard_numel = -(-offset // dp_size)
        self.buffer = torch.zeros(self.shard_numel * dp_size, dtype=dtype, device=device)
        # Set by GradBuckets in reduce-scatter mode: this rank's summed shard of the buffer.
        self.shard_grad: torch.Tensor | None = None
        self.ready: set[nn.Parameter] = set()
        self.launched = False
        self.work: dist.Work | None = None

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s range in :attr:`buffer`."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        """The part of :attr:`buffer` that is ``slot.param.main_grad``."""
        return self.buffer[slot.offset:slot.offset + slot.numel].view_as(slot.param)


def partition_params(params: Sequence[nn.Parameter],
                     bucket_size_mb: float) -> list[list[nn.Parameter]]:
    """Split ``params`` in reverse order into groups of about ``bucket_size_mb`` fp32 MiB each
    (a number of elements, as Megatron's ``--ddp-bucket-size``, whatever the buckets' dtype).

    A bucket is closed as soon as it reaches the size, so a parameter larger than the size gets
    a bucket of its own (together with any smaller ones just before it).
    """
    if bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb}")
    capacity = max(1, int(bucket_size_mb * 2**20) // GRAD_DTYPE.itemsize)
    groups: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for param in reversed(params):
        current.append(param)
        size += param.numel()
        if size >= capacity:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def _check_params(params: Sequence[nn.Parameter]) -> None:
    if len({id(p) for p in params}) != len(params):
        raise ValueError("GradBuckets: a parameter is listed twice")
    for p in params:
        if not p.requires_grad:
            raise ValueError("GradBuckets: parameters must require grad")
    if len({p.dtype for p in params}) > 1:
        raise ValueError("GradBuckets: all parameters must have one dtype (got "
                         f"{sorted(str(d) for d in {p.dtype for p in params})})")
    if len({p.device for p in params}) > 1:
        raise ValueError("GradBuckets: all parameters must be on one device")


class GradBuckets:
    """Bucketed, contiguous gradients of ``params``, summed over ``dp_group``.

    Args:
        params: the replica's trainable parameters in registration order (``model.parameters()``),
            all of one dtype.
        dp_group: the data-parallel group; ``None`` (or a group of size 1) means no communication.
        bucket_size_mb: target size of one bucket in MiB of fp32 (so many elements).
        overlap: launch a bucket's collective from the gradient hooks, during backward, once
            :meth:`start_sync` has armed them; otherwise everything is launched by
            :meth:`finish_sync`.
        reduce_scatter: reduce-scatter instead of all-reduce; each rank then gets only its
            range of each bucket, in :attr:`Bucket.shard_grad` (for the distributed optimizer).
        deferred: parameters (of ``params``) whose summed gradients are changed further before
            the optimizer uses them (the pipeline's tied embedding copies, summed across the
            first and the last stage after each stage's DP sum): they get a bucket of their own,
            the last, which only :meth:`finish_sync` launches, always as an all-reduce, and
            which its ``combine`` may change before a reduce-scatter rank takes its shard.
        grad_dtype: dtype of the buckets: where micro-batch gradients accumulate and what the
            collectives sum (fp32; bf16 for ``--grad-reduce-in-bf16``, fp16 for ``--fp16``).

    :attr:`on_synced` (None: nothing), set by the caller, is called with each bucket before the
    deferred ones, in bucket order, as soon as its collective has finished (during the last
    backward where the hooks are armed, else in :meth:`finish_sync`): the cross-pipeline
    gradient sum sends a bucket from there. With it the hooks are armed even without a DP group.

    Every ``param.main_grad`` is a view into a persistent buffer, and so is ``param.grad`` where
    the parameter has the buckets' dtype: zero gradients with :meth:`zero_grad`, never by setting
    ``.grad = None`` (that detaches it from the buffer; :meth:`zero_grad` re-attaches, and the
    hooks raise if backward meets a detached gradient). :attr:`version` changes whenever the
    buffers may have changed (a gradient arrived, a zeroing, a sync).
    """

    def __init__(self, params: Sequence[nn.Parameter], dp_group: ProcessGroup | None,
                 bucket_size_mb: float = 25.0, overlap: bool = True,
                 reduce_scatter: bool = False, deferred: Sequence[nn.Parameter] = (),
                 grad_dtype: torch.dtype = GRAD_DTYPE) -> None:
        self.params = list(params)
        _check_params(self.params)
        self.grad_dtype = grad_dtype
        self.param_dtype = self.params[0].dtype if self.params else grad_dtype
        # bf16 weights with fp32 buckets: gradients reach main_grad through the hook
        self.direct = self.param_dtype == grad_dtype
        self.version = 0
        late = {id(p) for p in deferred}
        if late - {id(p) for p in self.params}:
            raise ValueError("GradBuckets: a deferred parameter is not among the parameters")
        self.dp_group = dp_group if group_size(dp_group) > 1 else None
        self.dp_size = group_size(self.dp_group)
        self.dp_rank = group_rank(self.dp_group)
        self.overlap = overlap
        self.reduce_scatter = reduce_scatter
        device = self.params[0].device if self.params else torch.device("cpu")
        groups = partition_params([p for p in self.params if id(p) not in late], bucket_size_mb)
        if late:
            groups.append([p for p in self.params if id(p) in late])
        self.buckets = [Bucket(i, group, self.dp_size, device, grad_dtype)
                        for i, group in enumerate(groups)]
        self._first_deferred = len(groups) - 1 if late else len(groups)
        self._where: dict[nn.Parameter, tuple[Bucket, ParamSlot]] = {
            slot.param: (bucket, slot) for bucket in self.buckets for slot in bucket.slots}
        for bucket in self.buckets:
            if reduce_scatter:
                start, end = bucket.shard_range(self.dp_rank)
                bucket.shard_grad = (bucket.buffer if self.dp_size == 1
                                     else torch.zeros(end - start, dtype=grad_dtype,
                                                      device=device))
            for slot in bucket.slots:
                view = bucket.grad_view(slot)
                if slot.param.grad is not None:
                    view.copy_(slot.param.grad)
                slot.param.main_grad = view
                slot.param.grad = view if self.direct else None
        self._armed = False
        self._armed_params: set[nn.Parameter] | None = set()  # None: every parameter
        self._next_launch = 0
        self.on_synced: Callable[[Bucket], None] | None = None
        self._next_synced = 0  # the next bucket to hand to on_synced
        self._needs_sync = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for p in self.params]

    # ----------------------------------------------------------------- step protocol
    def zero_grad(self) -> None:
        """Zero every buffer (and re-attach any ``.grad`` that was replaced or set to None)."""
        self._check_idle("zero_grad")
        for bucket in self.buckets:
            bucket.buffer.zero_()
            if bucket.shard_grad is not None and bucket.shard_grad is not bucket.buffer:
                bucket.shard_grad.zero_()
            for slot in bucket.slots:
                if not self._is_attached(bucket, slot):
                    slot.param.main_grad = bucket.grad_view(slot)
                    if self.direct:
                        slot.param.grad = slot.param.main_grad
                if not self.direct:
                    slot.param.grad = None
        self._needs_sync = False
        self.version += 1

    def start_sync(self, params: Sequence[nn.Parameter] | None = None) -> None:
        """Arm the hooks: call just before the last backward of the step (no-op without overlap).

        During that backward a bucket is launched as soon as all its parameters have their
        gradient (and all earlier buckets are launched). Earlier micro-batches only accumulate.
        ``params``: arm only these (call once per model chunk, before the last backward that
        reaches that chunk's parameters); the hooks of other parameters keep accumulating.
        """
        if params is None:
            self._check_idle("start_sync")
        if self.overlap and (self.dp_size > 1 or self.on_synced is not None):
            self._armed = True
            if params is None:
                self._armed_params = None
            elif self._armed_params is not None:
                self._armed_params.update(params)

    def finish_sync(self, combine: Callable[[], None] | None = None) -> None:
        """Launch every bucket not launched yet, in order, then wait for all collectives.

        ``combine`` runs once every gradient is summed over DP, before a reduce-scatter rank
        takes its shard of the deferred bucket (whose gradients it may change)."""
        for bucket in self.buckets:
            for slot in bucket.slots:
                if not self._is_attached(bucket, slot):
                    raise RuntimeError(self._detached_message(slot))
        while self._next_launch < len(self.buckets):
            self._launch_next()
        self._report_synced(block=True)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.work = None
            bucket.launched = False
            bucket.ready.clear()
        if combine is not None:
            combine()
        for bucket in self.buckets[self._first_deferred:]:
            if bucket.shard_grad is not None and bucket.shard_grad is not bucket.buffer:
                start, end = bucket.shard_range(self.dp_rank)
                bucket.shard_grad.copy_(bucket.buffer[start:end])
        self._armed = False
        self._armed_params = set()
        self._next_launch = 0
        self._next_synced = 0
        self._needs_sync = False
        self.version += 1

    @property
    def first_deferred(self) -> int:
        """Index of the first deferred bucket (the number of buckets when there is none)."""
        return self._first_deferred

    @property
    def needs_sync(self) -> bool:
        """True when gradients arrived since the last :meth:`finish_sync` / :meth:`zero_grad`
        and there is a group to synchronise them over."""
        return self._needs_sync and self.dp_size > 1

    # ----------------------------------------------------------------- internals
    def _check_idle(self, what: str) -> None:
        if self._armed or any(b.launched for b in self.buckets):
            raise RuntimeError(f"GradBuckets.{what}() called while a sync is in progress; "
                               "call finish_sync() first")

    def _is_attached(self, bucket: Bucket, slot: ParamSlot) -> bool:
        grad = slot.param.grad if self.direct else getattr(slot.param, "main_grad", None)
        expected = bucket.buffer.data_ptr() + slot.offset * self.grad_dtype.itemsize
        return grad is not None and grad.data_ptr() == expected and grad.dtype == self.grad_dtype

    def _detached_message(self, slot: ParamSlot) -> str:
        what = ".grad" if self.direct else ".main_grad"
        return (f"the {what} of a parameter of shape {tuple(slot.param.shape)} is no longer a "
                "view into its gradient bucket (was it set to None or replaced?); zero "
                "gradients with GradBuckets.zero_grad() / optimizer.zero_grad(), not "
                "zero_grad(set_to_none=True)")

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        bucket, slot = self._where[param]
        if not self._is_attached(bucket, slot):
            raise RuntimeError(self._detached_message(slot))
        if not self.direct:  # accumulate this backward's gradient in the buckets' dtype
            param.main_grad.add_(param.grad)
            param.grad = None
        self._needs_sync = True
        self.version += 1
        if not self._armed or (self._armed_params is not None
                               and param not in self._armed_params):
            return
        if bucket.launched:
            raise RuntimeError("a gradient arrived after its bucket's sync was launched; call "
                               "start_sync() only before the last backward of the step")
        bucket.ready.add(param)
        while (self._next_launch < self._first_deferred
               and len(self.buckets[self._next_launch].ready)
               == len(self.buckets[self._next_launch].slots)):
            self._launch_next()
        self._report_synced(block=False)

    def _report_synced(self, block: bool) -> None:
        """Hand every launched bucket whose collective has finished to :attr:`on_synced`, in
        order (``block``: wait for each)."""
        if self.on_synced is None:
            return
        while self._next_synced < min(self._next_launch, self._first_deferred):
            bucket = self.buckets[self._next_synced]
            if bucket.work is not None:
                if not block and not bucket.work.is_completed():
                    return
                bucket.work.wait()
            self._next_synced += 1
            self.on_synced(bucket)

    def _launch_next(self) -> None:
        bucket = self.buckets[self._next_launch]
        self._next_launch += 1
        bucket.launched = True
        if self.dp_group is None:
            return
        if self.reduce_scatter and bucket.index < self._first_deferred:
            bucket.work = _reduce_scatter_flat(bucket.shard_grad, bucket.buffer,
                                               group=self.dp_group, async_op=True)
        else:
            bucket.work = dist.all_reduce(bucket.buffer, group=self.dp_group, async_op=True)


def broadcast_params(params: Sequence[torch.Tensor], dp_group: ProcessGroup | None) -> None:
    """Copy the values of ``params`` on DP rank 0 to every rank of ``dp_group`` (in place)."""
    if group_size(dp_group) == 1:
        return
    src = dist.get_global_rank(dp_group, 0)
    with torch.no_grad():
        for param in params:
            dist.broadcast(param.data, src=src, group=dp_group)
