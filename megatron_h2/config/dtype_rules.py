"""Numeric precision of training (``--bf16``, ``--fp16`` and their gradient flags) and the bytes
of model state per parameter it costs, shared by the runtime and the planner.

As in Megatron-LM, ``--bf16`` / ``--fp16`` store the model's weights in that dtype and keep fp32
*main* weights in the optimizer; gradients accumulate and are reduced over data parallelism in
fp32 under ``--bf16`` (Megatron turns ``--accumulate-allreduce-grads-in-fp32`` on unless
``--grad-reduce-in-bf16``) and in the weights' dtype under ``--fp16`` unless
``--accumulate-allreduce-grads-in-fp32``. :class:`Precision` is what the runtime allocates from
(``megatron_h2.optimizer``) and what :func:`state_bytes_per_param` counts, so the planner's
memory model and the runtime cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of the dtypes training uses (names as in ``megatron_h2.devices``)."""
ADAM_BYTES = 8
"""Adam's two fp32 moments."""


@dataclass(frozen=True)
class Precision:
    """Dtypes of one run's model state.

    ``params``: the model's weights (and so its activations and the pipeline's traffic);
    ``grads``: the gradient buckets, where micro-batch gradients accumulate and which the
    data-parallel reduction sums.
    """

    params: str = "fp32"
    grads: str = "fp32"

    def __post_init__(self) -> None:
        for value in (self.params, self.grads):
            if value not in DTYPE_BYTES:
                raise ValueError(f"unknown dtype {value!r}; one of {', '.join(DTYPE_BYTES)}")

    @property
    def main_params(self) -> bool:
        """True when the optimizer keeps fp32 main weights apart from the model's."""
        return self.params != "fp32"

    @property
    def main_grad_copy(self) -> bool:
        """True when the optimizer needs an fp32 copy of the bucket gradients (the buckets are
        not fp32; Megatron's ``main_grad.float()``)."""
        return self.grads != "fp32"

    def describe(self) -> str:
        """For the start-up line."""
        if not self.main_params:
            return "fp32"
        return (f"{self.params} weights, fp32 main weights in the optimizer, gradients "
                f"accumulated and reduced in {self.grads}")


MEGATRON_BF16 = Precision("bf16", "fp32")
"""``--bf16`` with Megatron's defaults: what the planner plans accelerator runs for."""


def state_bytes_per_param(precision: Precision = MEGATRON_BF16, data_parallel_size: int = 1,
                          distributed_optimizer: bool = False) -> float:
    """Bytes of model state per parameter that the runtime holds from the first optimizer step
    on: weight, gradient bucket, the optimizer's fp32 gradient copy (buckets not in fp32), fp32
    main weight and Adam's two moments.

    Replicated optimizer: everything per parameter (the main weight only when the weights are
    not fp32: the fp32 weights are their own main copy). bf16 (fp32 gradients):
    2 + 4 + 4 + 8 = 18; fp32: 4 + 4 + 8 = 16; bf16 with ``--grad-reduce-in-bf16`` or fp16:
    2 + 2 + 4 + 4 + 8 = 20.

    Distributed optimizer (ZeRO-1): weight and gradient bucket per parameter; the fp32 master
    shard (also with fp32 weights), Adam's moments and any fp32 gradient copy divided by DP;
    with DP > 1 each rank also receives its reduced shard of the buckets (gradient bytes / DP).
    bf16: 6 + 12 / DP (+ 4 / DP with DP > 1); fp32: 8 + 12 / DP (+ 4 / DP).
    """
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    weight = DTYPE_BYTES[precision.params]
    grad = DTYPE_BYTES[precision.grads]
    copy = 4 if precision.main_grad_copy else 0
    if not distributed_optimizer:
        main = 4 if precision.main_params else 0
        return float(weight + grad + copy + main + ADAM_BYTES)
    received = grad / data_parallel_size if data_parallel_size > 1 else 0.0
    return weight + grad + received + (copy + 4 + ADAM_BYTES) / data_parallel_size
