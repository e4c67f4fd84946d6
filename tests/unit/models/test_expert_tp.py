"""Expert tensor parallelism's local part: each expert-TP rank runs its column shard of
``linear_fc1`` (the gate and up halves each split under SwiGLU) and row shard of ``linear_fc2``
on every gathered row; the ranks' partial outputs add up to the whole expert's output (routing
probability and ``linear_fc2`` bias applied as in one process), each rank's weight gradients are
the whole expert's gradients' shards, and the replicated bias receives the whole gradient on
every rank."""

from __future__ import annotations

import pytest
import torch

from megatron_h2.devices.kernels import Kernels
from megatron_h2.models.gpt.layers import MLP
from megatron_h2.models.gpt.moe_layer import partial_expert
from megatron_h2.parallel import TPContext, get_tp_shard, shard_tensor
from tests.unit.models.test_moe import moe_config

ETP = 2


def _sharded_mlps(config, full: MLP) -> list[MLP]:
    """The ETP ranks' MLPs holding ``full``'s shards (no process group: nothing communicates)."""
    shards = []
    for rank in range(ETP):
        tp = TPContext(group=object(), rank=rank, size=ETP)  # type: ignore[arg-type]
        mlp = MLP(config, Kernels(), tp, ffn_hidden_size=config.moe_ffn_hidden_size)
        with torch.no_grad():
            for mine, whole in zip(mlp.parameters(), full.parameters()):
                spec = get_tp_shard(mine)
                mine.copy_(whole if spec is None else shard_tensor(whole, spec, rank, ETP))
        shards.append(mlp)
    return shards


@pytest.mark.parametrize("swiglu", [False, True])
def test_partial_outputs_and_gradients_add_up_to_the_whole_expert(swiglu):
    config = moe_config(swiglu=swiglu, add_bias_linear=True, moe_ffn_hidden_size=8)
    full = MLP(config, Kernels(), TPContext.single(), ffn_hidden_size=8)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    shards = _sharded_mlps(config, full)
    x = torch.randn(5, config.hidden_size, generator=gen)
    probs = torch.rand(5, generator=gen)
    grad_out = torch.randn(5, config.hidden_size, generator=gen)

    want = full(x, per_token_scale=probs)
    (want * grad_out).sum().backward()
    got = sum(partial_expert(mlp, x, probs, ETP) for mlp in shards)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for mlp in shards:
        (partial_expert(mlp, x, probs, ETP) * grad_out).sum().backward()
    for rank, mlp in enumerate(shards):
        for mine, whole in zip(mlp.parameters(), full.parameters()):
            spec = get_tp_shard(mine)
            expect = whole.grad if spec is None else shard_tensor(whole.grad, spec, rank, ETP)
            torch.testing.assert_close(mine.grad, expect, rtol=0, atol=1e-5)
