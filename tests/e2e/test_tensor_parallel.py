"""Tensor parallelism across processes: TP layers, vocab-parallel cross entropy, sequence
parallel.

Multi-process cases run every layer on real gloo ranks (TP=2 and TP=4, one spawn each) from the
shards of deterministic full tensors, and gather outputs and grads back to full tensors; the
parent process compares them with plain single-process torch on the full tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_h2.devices.kernels import native_swiglu
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
    load_shard_,
    mark_sequence_parallel,
    reduce_from_tp_region,
    scatter_to_sequence_parallel_region,
    shard_tensor,
    vocab_parallel_cross_entropy,
)
from tests.helpers.dist_utils import run_distributed
from tests.unit.parallel.test_tensor_parallel import FFN, B, H, S, V, _ce_labels, _rand, _tokens

EPS = 1e-5
Tensors = dict[str, torch.Tensor]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Cases: each has a TP version (run on every rank) and a single-process reference.
# ---------------------------------------------------------------------------------------------

def _tp_column(tp: TPContext, blocks: int, gather_output: bool) -> Tensors:
    w, x, g = _rand(1, 2 * FFN, H), _rand(2, B, S, H).requires_grad_(), _rand(3, B, S, 2 * FFN)
    layer = ColumnParallelLinear(H, 2 * FFN, tp, blocks=blocks, gather_output=gather_output)
    load_shard_(layer.weight, w, tp)
    y = layer(x)
    out_spec = TPShard(-1, blocks)
    if gather_output:
        assert y.shape == (B, S, 2 * FFN)
        (y * g).sum().backward()
    else:
        assert y.shape == (B, S, 2 * FFN // tp.size)
        (y * shard_tensor(g, out_spec, tp.rank, tp.size)).sum().backward()
        y = gather_tp_tensor(y, out_spec, tp)
    return {"out": y, "grad_x": x.grad,
            "grad_w": gather_tp_tensor(layer.weight.grad, layer.weight.tp_shard, tp)}


def _ref_column(blocks: int, gather_output: bool) -> Tensors:
    w, x = _rand(1, 2 * FFN, H).requires_grad_(), _rand(2, B, S, H).requires_grad_()
    y = F.linear(x, w)
    (y * _rand(3, B, S, 2 * FFN)).sum().backward()
    return {"out": y, "grad_x": x.grad, "grad_w": w.grad}


def _tp_row(tp: TPContext, input_is_parallel: bool) -> Tensors:
    w, x, g = _rand(4, H, FFN), _rand(5, B, S, FFN), _rand(6, B, S, H)
    layer = RowParallelLinear(FFN, H, tp, input_is_parallel=input_is_parallel)
    load_shard_(layer.weight, w, tp)
    if input_is_parallel:
        x = shard_tensor(x, TPShard(-1), tp.rank, tp.size)
    x.requires_grad_()
    y = layer(x)
    assert y.shape == (B, S, H)
    (y * g).sum().backward()
    grad_x = gather_tp_tensor(x.grad, TPShard(-1), tp) if input_is_parallel else x.grad
    return {"out": y, "grad_x": grad_x,
            "grad_w": gather_tp_tensor(layer.weight.grad, layer.weight.tp_shard, tp)}


def _ref_row(input_is_parallel: bool) -> Tensors:
    w, x = _rand(4, H, FFN).requires_grad_(), _rand(5, B, S, FFN).requires_grad_()
    y = F.linear(x, w)
    (y * _rand(6, B, S, H)).sum().backward()
    return {"out": y, "grad_x": x.grad, "grad_w": w.grad}


def _tp_embedding(tp: TPContext, sp: bool) -> Tensors:
    tp = TPContext(tp.group, tp.rank, tp.size, sequence_parallel=sp)
    layer = VocabParallelEmbedding(V, H, tp)
    load_shard_(layer.weight, _rand(7, V, H), tp)
    y, g = layer(_tokens(8)), _rand(9, B, S, H)
    if sp:
        assert y.shape == (B, S // tp.size, H)
        (y * shard_tensor(g, TPShard(1), tp.rank, tp.size)).sum().backward()
        y = gather_tp_tensor(y, TPShard(1), tp)
    else:
        (y * g).sum().backward()
    return {"out": y, "grad_w": gather_tp_tensor(layer.weight.grad, TPShard(0), tp)}


def _ref_embedding(sp: bool) -> Tensors:
    w = _rand(7, V, H).requires_grad_()
    y = F.embedding(_tokens(8), w)
    (y * _rand(9, B, S, H)).sum().backward()
    return {"out": y, "grad_w": w.grad}


def _tp_cross_entropy(tp: TPContext) -> Tensors:
    logits = shard_tensor(_rand(10, B, S, V) * 3, TPShard(-1), tp.rank, tp.size)
    logits.requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, _ce_labels(), tp)
    assert loss.dtype == torch.float32 and loss.shape == (B, S)
    (loss * _rand(12, B, S)).sum().backward()
    return {"out": loss, "grad_logits": gather_tp_tensor(logits.grad, TPShard(-1), tp)}


def _ref_cross_entropy() -> Tensors:
    logits = (_rand(10, B, S, V) * 3).requires_grad_()
    labels = _ce_labels()
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    loss = loss.view_as(labels)
    (loss * _rand(12, B, S)).sum().backward()
    return {"out": loss, "grad_logits": logits.grad}


def _norm_weight() -> torch.Tensor:
    return 1.0 + 0.1 * _rand(13, H)


def _mlp_weight(seed: int, fan_out: int, fan_in: int) -> torch.Tensor:
    return _rand(seed, fan_out, fan_in) / fan_in**0.5  # keeps activations O(1)


def _tp_mlp(tp: TPContext, sp: bool) -> Tensors:
    """x + fc2(swiglu(fc1(rms_norm(x)))) with column fc1 ([gate; up], 2 blocks) and row fc2."""
    tp = TPContext(tp.group, tp.rank, tp.size, sequence_parallel=sp)
    x_full = _rand(14, B, S, H).requires_grad_()
    norm_w = nn.Parameter(_norm_weight())
    if sp:
        mark_sequence_parallel(norm_w)
    fc1 = ColumnParallelLinear(H, 2 * FFN, tp, blocks=2)
    fc2 = RowParallelLinear(FFN, H, tp)
    load_shard_(fc1.weight, _mlp_weight(15, 2 * FFN, H), tp)
    load_shard_(fc2.weight, _mlp_weight(16, H, FFN), tp)
    x = scatter_to_sequence_parallel_region(x_full, tp) if sp else x_full  # [b, s/tp, h]
    y = x + fc2(native_swiglu(fc1(F.rms_norm(x, (H,), norm_w, EPS))))
    g = _rand(17, B, S, H)
    if sp:
        assert y.shape == (B, S // tp.size, H)
        g = shard_tensor(g, TPShard(1), tp.rank, tp.size)
    (y * g).sum().backward()
    partial_norm_grad = norm_w.grad.clone()
    allreduce_sequence_parallel_grads([norm_w, fc1.weight, fc2.weight], tp)
    return {"out": gather_tp_tensor(y, TPShard(1), tp) if sp else y, "grad_x": x_full.grad,
            "grad_norm": norm_w.grad, "partial_grad_norm": partial_norm_grad,
            "grad_fc1": gather_tp_tensor(fc1.weight.grad, TPShard(0, 2), tp),
            "grad_fc2": gather_tp_tensor(fc2.weight.grad, TPShard(1), tp)}


def _ref_mlp(sp: bool) -> Tensors:
    x, norm_w = _rand(14, B, S, H).requires_grad_(), _norm_weight().requires_grad_()
    w1 = _mlp_weight(15, 2 * FFN, H).requires_grad_()
    w2 = _mlp_weight(16, H, FFN).requires_grad_()
    y = x + F.linear(native_swiglu(F.linear(F.rms_norm(x, (H,), norm_w, EPS), w1)), w2)
    (y * _rand(17, B, S, H)).sum().backward()
    return {"out": y, "grad_x": x.grad, "grad_norm": norm_w.grad, "grad_fc1": w1.grad,
            "grad_fc2": w2.grad}


def _tp_mappings(tp: TPContext) -> Tensors:
    """copy/reduce with rank-dependent tensors; sequence gather with and without grad reduce."""
    x, g = _rand(20 + tp.rank, B, S, H).requires_grad_(), _rand(30 + tp.rank, B, S, H)
    copy_to_tp_region(x, tp).backward(g)
    out: Tensors = {"copy_grad": x.grad}
    x.grad = None
    reduced = reduce_from_tp_region(x, tp)
    reduced.backward(g)
    out |= {"reduce_out": reduced, "reduce_grad": x.grad}
    full, g_full = _rand(40, B, S, H), _rand(41, B, S, H)  # replicated on every rank
    for reduce_grads in (False, True):
        local = shard_tensor(full, TPShard(1), tp.rank, tp.size).requires_grad_()
        gathered = gather_from_sequence_parallel_region(local, tp, reduce_grads=reduce_grads)
        gathered.backward(g_full)
        out[f"seq_gather_out_{reduce_grads}"] = gathered
        out[f"seq_gather_grad_{reduce_grads}"] = gather_tp_tensor(local.grad, TPShard(1), tp)
    return out


def _ref_mappings(size: int) -> Tensors:
    xs = [_rand(20 + r, B, S, H) for r in range(size)]
    gs = [_rand(30 + r, B, S, H) for r in range(size)]
    full, g_full = _rand(40, B, S, H), _rand(41, B, S, H)
    return {"copy_grad": sum(gs), "reduce_out": sum(xs), "seq_gather_out_False": full,
            "seq_gather_grad_False": g_full, "seq_gather_out_True": full,
            "seq_gather_grad_True": g_full * size}


def _cases() -> dict[str, tuple[Callable[..., Tensors], Callable[..., Tensors], tuple]]:
    """name -> (TP function, reference function, extra arguments)."""
    cases = {f"column_b{b}_g{int(gather)}": (_tp_column, _ref_column, (b, gather))
             for b in (1, 2) for gather in (False, True)}
    for flag in (False, True):
        cases[f"row_parallel_in{int(flag)}"] = (_tp_row, _ref_row, (flag,))
        cases[f"embedding_sp{int(flag)}"] = (_tp_embedding, _ref_embedding, (flag,))
        cases[f"mlp_sp{int(flag)}"] = (_tp_mlp, _ref_mlp, (flag,))
    cases["cross_entropy"] = (_tp_cross_entropy, _ref_cross_entropy, ())
    return cases


def _run_all_cases(rank: int, world_size: int) -> dict[str, dict[str, np.ndarray]]:
    tp = TPContext.from_group(dist.group.WORLD)
    assert (tp.rank, tp.size) == (rank, world_size)
    results = {name: tp_fn(tp, *args) for name, (tp_fn, _, args) in _cases().items()}
    results["mappings"] = _tp_mappings(tp)
    return {name: {k: v.detach().numpy() for k, v in res.items()}
            for name, res in results.items()}


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def tp_results(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    """(TP size, per-rank results of every case), one gloo spawn per TP size."""
    return request.param, run_distributed(_run_all_cases, request.param)


def _check_case(tp_results: tuple[int, list[dict]], name: str,
                expected: Tensors | None = None) -> None:
    size, per_rank = tp_results
    if expected is None:
        _, ref_fn, args = _cases()[name]
        expected = ref_fn(*args)
    assert len(per_rank) == size
    for results in per_rank:  # every rank ends with the same full tensors
        got = results[name]
        for key, want in expected.items():
            _close(torch.from_numpy(got[key]), want.detach())


@pytest.mark.e2e
@pytest.mark.parametrize("blocks", [1, 2])
@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel_matches_full_linear(tp_results, blocks, gather_output):
    _check_case(tp_results, f"column_b{blocks}_g{int(gather_output)}")


@pytest.mark.e2e
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_matches_full_linear(tp_results, input_is_parallel):
    _check_case(tp_results, f"row_parallel_in{int(input_is_parallel)}")


@pytest.mark.e2e
@pytest.mark.parametrize("sp", [False, True])
def test_vocab_parallel_embedding_matches_full_embedding(tp_results, sp):
    _check_case(tp_results, f"embedding_sp{int(sp)}")


@pytest.mark.e2e
def test_vocab_parallel_cross_entropy_matches_full(tp_results):
    _check_case(tp_results, "cross_entropy")


@pytest.mark.e2e
@pytest.mark.parametrize("sp", [False, True])
def test_column_row_mlp_chain(tp_results, sp):
    _check_case(tp_results, f"mlp_sp{int(sp)}")


@pytest.mark.e2e
def test_sequence_parallel_norm_grads_are_partial_before_allreduce(tp_results):
    _, per_rank = tp_results
    full = _ref_mlp(True)["grad_norm"]
    partial = [torch.from_numpy(r["mlp_sp1"]["partial_grad_norm"]) for r in per_rank]
    _close(sum(partial), full)
    assert not torch.allclose(partial[0], full, atol=1e-3)


@pytest.mark.e2e
def test_mappings_forward_and_backward(tp_results):
    size, per_rank = tp_results
    _check_case(tp_results, "mappings", _ref_mappings(size))
    for rank, results in enumerate(per_rank):  # rank-dependent: reduce's grad is its own g
        _close(torch.from_numpy(results["mappings"]["reduce_grad"]), _rand(30 + rank, B, S, H))
