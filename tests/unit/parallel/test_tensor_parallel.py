"""Tensor parallelism in one process: sharding specs, and the TP layers, vocab-parallel cross
entropy and mappings at TP=1, bit-identical to plain torch. (Every layer on real gloo ranks at
TP=2 and TP=4: tests/e2e/test_tensor_parallel.py, with the sizes and inputs from here.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_h2.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    TPShard,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_tp_tensor,
    get_tp_shard,
    is_sequence_parallel,
    mark_sequence_parallel,
    reduce_from_tp_region,
    scatter_to_sequence_parallel_region,
    shard_slices,
    shard_tensor,
    unshard_tensors,
    vocab_parallel_cross_entropy,
)

B, S, H, FFN, V = 2, 8, 16, 16, 32  # S, FFN, V divisible by 4; 2 x FFN by 2 blocks x 4 ranks


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def _ce_labels() -> torch.Tensor:
    labels = _tokens(11)
    labels[0, 3] = labels[1, 0] = -100  # ignored positions
    return labels


# ---------------------------------------------------------------------------------------------
# Sharding specs (pure, single process)
# ---------------------------------------------------------------------------------------------

SHARD_CASES = [((24, 6), TPShard(0)), ((24, 6), TPShard(0, 2)), ((6, 24), TPShard(1)),
               ((6, 24), TPShard(-1, 3)), ((2, 4, 24), TPShard(2, 2)), ((24,), TPShard(0, 2))]


@pytest.mark.parametrize("shape,spec", SHARD_CASES)
@pytest.mark.parametrize("size", [1, 2, 4])
def test_shard_unshard_round_trip(shape, spec, size):
    full = torch.arange(int(np.prod(shape)), dtype=torch.float32).view(shape)
    shards = [shard_tensor(full, spec, r, size) for r in range(size)]
    dim = spec.dim % len(shape)
    assert all(s.shape[dim] == shape[dim] // size and s.is_contiguous() for s in shards)
    assert torch.equal(unshard_tensors(shards, spec), full)
    for r, shard in enumerate(shards):
        by_slices = torch.cat([full[sl] for sl in shard_slices(shape, spec, r, size)], dim=dim)
        assert torch.equal(by_slices, shard)


def test_block_sharding_keeps_gate_and_up_aligned():
    gate, up = torch.arange(8.0), torch.arange(100.0, 108.0)
    shards = [shard_tensor(torch.cat([gate, up]), TPShard(0, 2), r, 2) for r in range(2)]
    assert torch.equal(shards[0], torch.cat([gate[:4], up[:4]]))
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))


def test_shard_slices_read_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    full = _rand(50, 32, 8)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    spec = TPShard(0, 2)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        view = f.get_slice("w")
        for rank in range(4):
            parts = [view[sl] for sl in shard_slices(view.get_shape(), spec, rank, 4)]
            assert torch.equal(torch.cat(parts, dim=0), shard_tensor(full, spec, rank, 4))


def test_sharding_rejects_bad_layouts():
    with pytest.raises(ValueError, match="not divisible"):
        shard_tensor(torch.zeros(6, 4), TPShard(0, 2), 0, 2)
    with pytest.raises(ValueError, match="out of range"):
        shard_slices((6, 4), TPShard(2), 0, 2)
    with pytest.raises(ValueError, match="invalid TP rank"):
        shard_slices((8, 4), TPShard(0), 2, 2)
    with pytest.raises(ValueError):
        TPShard(0, blocks=0)
    with pytest.raises(ValueError):
        ColumnParallelLinear(8, 12, TPContext.single(), blocks=8)


def test_tp_context_validation():
    single = TPContext.single()
    assert (single.group, single.rank, single.size, single.sequence_parallel) == (None, 0, 1,
                                                                                   False)
    with pytest.raises(ValueError, match="explicit process group"):
        TPContext(group=None, rank=0, size=2)
    with pytest.raises(ValueError, match="invalid TP rank"):
        TPContext(group=None, rank=1, size=1)


def test_parameter_attributes():
    tp = TPContext.single()
    col = ColumnParallelLinear(H, 2 * FFN, tp, blocks=2)
    row, emb = RowParallelLinear(FFN, H, tp), VocabParallelEmbedding(V, H, tp)
    assert get_tp_shard(col.weight) == TPShard(0, 2)
    assert get_tp_shard(row.weight) == TPShard(1)
    assert get_tp_shard(emb.weight) == TPShard(0)
    assert [n for n, _ in col.named_parameters()] == ["weight"]
    norm = nn.Parameter(torch.ones(H))
    assert get_tp_shard(norm) is None and not is_sequence_parallel(norm)
    mark_sequence_parallel(norm)
    assert is_sequence_parallel(norm)
    assert get_tp_shard(col.to(torch.float64).weight) == TPShard(0, 2)  # survives .to()


# ---------------------------------------------------------------------------------------------
# TP=1: bit-identical to plain torch
# ---------------------------------------------------------------------------------------------

def _assert_same_fwd_bwd(ours: nn.Module, ref: nn.Module, x: torch.Tensor) -> None:
    x1, x2 = x.clone().requires_grad_(x.is_floating_point()), x.clone()
    x2.requires_grad_(x.is_floating_point())
    y1, y2 = ours(x1), ref(x2)
    assert torch.equal(y1, y2)
    g = _rand(60, *y1.shape).to(y1.dtype)
    y1.backward(g)
    y2.backward(g)
    assert torch.equal(ours.weight.grad, ref.weight.grad)
    if x.is_floating_point():
        assert torch.equal(x1.grad, x2.grad)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp1_linear_layers_are_bit_identical(sequence_parallel):
    tp = TPContext(None, 0, 1, sequence_parallel)
    for ours_cls, (fan_in, fan_out) in ((ColumnParallelLinear, (H, 2 * FFN)),
                                        (RowParallelLinear, (FFN, H))):
        torch.manual_seed(0)
        ours = ours_cls(fan_in, fan_out, tp)
        torch.manual_seed(0)
        ref = nn.Linear(fan_in, fan_out, bias=False)
        assert torch.equal(ours.weight, ref.weight)  # same default init
        _assert_same_fwd_bwd(ours, ref, _rand(61, B, S, fan_in))
    torch.manual_seed(0)
    ours = ColumnParallelLinear(H, 2 * FFN, tp, blocks=2, gather_output=True)
    torch.manual_seed(0)
    _assert_same_fwd_bwd(ours, nn.Linear(H, 2 * FFN, bias=False), _rand(62, B, S, H))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp1_embedding_is_bit_identical(sequence_parallel):
    torch.manual_seed(0)
    ours = VocabParallelEmbedding(V, H, TPContext(None, 0, 1, sequence_parallel))
    torch.manual_seed(0)
    ref = nn.Embedding(V, H)
    assert torch.equal(ours.weight, ref.weight)
    _assert_same_fwd_bwd(ours, ref, _tokens(63))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tp1_cross_entropy_is_bit_identical(dtype):
    labels = _ce_labels()
    l1 = (_rand(64, B, S, V) * 3).to(dtype).requires_grad_()
    l2 = l1.detach().clone().requires_grad_()
    ours = vocab_parallel_cross_entropy(l1, labels, TPContext.single())
    ref = F.cross_entropy(l2.float().flatten(0, 1), labels.flatten(), reduction="none")
    assert ours.dtype == torch.float32 and torch.equal(ours, ref.view_as(labels))
    ours.sum().backward()
    ref.sum().backward()
    assert torch.equal(l1.grad, l2.grad)


def test_tp1_mappings_are_identity_without_autograd_nodes():
    tp = TPContext(None, 0, 1, sequence_parallel=True)
    x = _rand(65, B, S, H).requires_grad_()
    for fn in (copy_to_tp_region, reduce_from_tp_region, scatter_to_sequence_parallel_region,
               gather_from_sequence_parallel_region):
        assert fn(x, tp) is x
    w = nn.Parameter(torch.ones(3))
    w.grad = torch.full((3,), 2.0)
    mark_sequence_parallel(w)
    allreduce_sequence_parallel_grads([w], tp)
    assert torch.equal(w.grad, torch.full((3,), 2.0))
    assert torch.equal(gather_tp_tensor(x, TPShard(0), tp), x)
