"""Data parallelism in one process: gradient buckets (partition, padding, gradients as views of
one buffer), the overlap flag reaching them, and what the ZeRO-1 distributed optimizer requires
of them. The model, batches and bucket sizes here are those of the multi-process runs
(tests/e2e/test_data_parallel.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_h2.config import OptimizerConfig
from megatron_h2.distributed import GradBuckets
from megatron_h2.distributed.grad_sync import Bucket, partition_params
from megatron_h2.optimizer import (
    DistributedOptimizer,
    build_data_parallel_optimizer,
)

GLOBAL_BATCH = 12  # divisible by DP * micro-batches for DP 1, 2, 3
CONFIG = OptimizerConfig(lr=0.01, weight_decay=0.1, lr_warmup_iters=0)
TINY, SMALL, LARGE = 0.0001, 0.0005, 25.0  # bucket sizes (MiB): ~1 param, ~3 params, all


class Scale(nn.Module):
    """A norm-like 1-D parameter (gets no weight decay)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def make_model() -> nn.Sequential:
    """Parameter sizes 105, 15, 15, 195, 13, 39, 3 (385 in all: not a multiple of 2 or 3)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 15), Scale(15), nn.Tanh(), nn.Linear(15, 13), nn.Tanh(),
                         nn.Linear(13, 3))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)


def loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample losses summed and divided by the global batch size (as the trainer does)."""
    return ((model(x) - y) ** 2).sum(-1).sum() / GLOBAL_BATCH


def names_of(model: nn.Module) -> dict[nn.Parameter, str]:
    return {p: n for n, p in model.named_parameters()}


def test_overlap_grad_reduce_is_off_by_default_and_reaches_the_buckets():
    from megatron_h2.training.arguments import config_from_args

    assert config_from_args([])[0].parallel.overlap_grad_reduce is False  # Megatron's default
    cfg = config_from_args(["--overlap-grad-reduce"])[0]
    opt = build_data_parallel_optimizer(make_model(), CONFIG, None,
                                        overlap=cfg.parallel.overlap_grad_reduce)
    assert opt.grad_buckets.overlap is True
        # while earlier layers compute


def test_partition_and_padding():
    model = make_model()
    params = list(model.parameters())
    sizes = [[p.numel() for p in group] for group in partition_params(params, TINY)]
    assert sizes == [[3, 39], [13, 195], [15, 15], [105]]  # reverse order, closed at >= 26
    assert [len(g) for g in partition_params(params, LARGE)] == [7]
    bucket = Bucket(0, params, dp_size=3, device=torch.device("cpu"))
    assert bucket.numel == 385 and bucket.shard_numel == 129 and bucket.buffer.numel() == 387
    assert bucket.shard_range(2) == (258, 387)
    with pytest.raises(ValueError, match="bucket_size_mb"):
        partition_params(params, 0)


def test_grads_are_buffer_views_and_set_to_none_is_caught():
    model = make_model()
    buckets = GradBuckets(list(model.parameters()), None, SMALL)
    assert buckets.dp_size == 1
    x, y = global_batch(0)
    loss_sum(model, x, y).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    for bucket in buckets.buckets:
        for slot in bucket.slots:
            assert slot.param.grad.data_ptr() == bucket.grad_view(slot).data_ptr()
    loss_sum(model, x, y).backward()  # accumulates in place
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * expected[n])
    model[0].weight.grad = None
    with pytest.raises(RuntimeError, match="no longer a view"):
        loss_sum(model, x, y).backward()
    buckets.zero_grad()  # re-attaches
    assert all(b.buffer.abs().sum() == 0 for b in buckets.buckets)
    loss_sum(model, x, y).backward()
    torch.testing.assert_close(model[0].weight.grad, expected["0.weight"])


def test_distributed_optimizer_requires_reduce_scatter_buckets():
    model = make_model()
    with pytest.raises(ValueError, match="reduce_scatter"):
        DistributedOptimizer(GradBuckets(list(model.parameters()), None), CONFIG)
    opt = build_data_parallel_optimizer(model, CONFIG, None, use_distributed_optimizer=True)
    assert opt.named_state(names_of(model)) == {}  # no state before the first step
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    decayed = {id(m) for m in opt.param_groups[0]["params"]}
    assert all((id(pc.master) in decayed) == (pc.param.ndim >= 2) for pc in opt.pieces)
