"""fp32 main gradients and weights for models whose weights are bf16 / fp16 (Megatron-Core's
mixed-precision optimizer, ``Float16OptimizerWithFloat16Params`` and the distributed optimizer).

The optimizer never updates low-precision weights directly: it applies fp32 gradients to fp32
*main* weights and then copies (rounds) them into the model. Its gradients are the gradient
buckets themselves when those are fp32, otherwise an fp32 copy of them made once per step
(Megatron's ``main_grad.float()``), held here in persistent buffers (:class:`Fp32Grads`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from megatron_h2.distributed.grad_sync import GradBuckets


class Fp32Grads:
    """fp32 views of ``sources`` (tensors of ``buckets``: its buffers, or this rank's reduced
    shards of them): the sources themselves when they are fp32, else fp32 copies refreshed by
    :meth:`refresh` whenever the buckets changed since the last copy (``GradBuckets.version``).

    Call :meth:`refresh` after the gradients are synchronised and before reading or scaling
    :attr:`tensors` (norm, clipping, unscaling, the update); in-place changes to the copies then
    hold until the buckets change again.
    """

    def __init__(self, buckets: GradBuckets, sources: Sequence[torch.Tensor]) -> None:
        self.buckets = buckets
        self.sources = list(sources)
        self.tensors = [s if s.dtype == torch.float32 else torch.zeros_like(s, dtype=torch.float32)
                        for s in self.sources]
        self._copied: int | None = None

    @property
    def copies(self) -> bool:
        """True when the fp32 gradients are copies, not the sources."""
        return any(t is not s for t, s in zip(self.tensors, self.sources))

    def refresh(self) -> list[torch.Tensor]:
        """The fp32 gradients, copied from the sources first if the buckets changed."""
        if self.copies and self._copied != self.buckets.version:
            with torch.no_grad():
                for dst, src in zip(self.tensors, self.sources):
                    if dst is not src:
                        dst.copy_(src)
            self._copied = self.buckets.version
        return self.tensors


def make_main_params(buckets: GradBuckets, grads: Fp32Grads) -> dict[nn.Parameter, torch.Tensor]:
    """fp32 main weights for every parameter of ``buckets`` (from the model's current weights, as
    Megatron copies them), each with ``.grad`` a view into the parameter's range of ``grads``
    (whole buffers: the replicated optimizer)."""
    mains: dict[nn.Parameter, torch.Tensor] = {}
    for bucket, flat in zip(buckets.buckets, grads.tensors):
        for slot in bucket.slots:
            main = slot.param.detach().to(torch.float32, copy=True)
            main.grad = flat[slot.offset:slot.offset + slot.numel].view_as(slot.param)
            mains[slot.param] = main
    return mains


@torch.no_grad()
def copy_main_to_model(mains: dict[nn.Parameter, torch.Tensor]) -> None:
    """Round every main weight into its model parameter (after an update or a load)."""
    for param, main in mains.items():
        param.copy_(main)


def allocated_state_bytes(model: nn.Module, optimizer) -> int:
    """Bytes of every distinct tensor storage holding model state, as allocated: the model's
    parameters and their ``.grad`` / ``main_grad``, the gradient buckets and their reduced
    shards, the optimizer's fp32 gradient copies and every tensor its inner AdamW holds (main
    weights or master shards, their ``.grad``, the Adam moments). ``optimizer`` is a
    ``DataParallelOptimizer``; what :func:`megatron_h2.config.state_bytes_per_param` predicts
    per parameter once Adam's moments exist (after the first step)."""
    tensors = []
    for p in model.parameters():
        tensors += [p, p.grad, getattr(p, "main_grad", None)]
    for bucket in optimizer.grad_buckets.buckets:
        tensors += [bucket.buffer, bucket.shard_grad]
    tensors += optimizer.grads.tensors
    inner = optimizer.optimizer
    for group in inner.param_groups:
        tensors += group["params"] + [t.grad for t in group["params"]]
    for state in inner.state.values():
        tensors += [v for k, v in state.items() if k != "step"]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t is not None and t.numel()}
    return sum(storages.values())
