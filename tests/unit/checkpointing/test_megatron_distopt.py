"""torch_dist checkpoints written by Megatron-Core's DistributedOptimizer (Megatron-LM
``--use-distributed-optimizer``, with its default ``dp_reshardable`` sharding and with
``--dist-ckpt-optim-fully-reshardable``, and the legacy format's ``distrib_optim.pt``; fixtures
made by tests/fixtures/megatron/generate_distopt.py): their fp32 main weights, Adam's moments
and step come over equal to the state the optimizer held when it saved."""

from __future__ import annotations

import shutil

import pytest
import torch

from megatron_h2.checkpointing.megatron_read import read_megatron
from megatron_h2.errors import ConfigError
from tests.helpers.paths import ROOT

FIXTURE = ROOT / "tests" / "fixtures" / "megatron" / "gpt_distopt"
ITER = FIXTURE / "fully_reshardable" / "iter_0000002"
DP_ITER = FIXTURE / "dp_reshardable" / "iter_0000002"
BUCKETS_ITER = FIXTURE / "dp_reshardable_buckets" / "iter_0000002"  # --ddp-bucket-size 2000
LEGACY_ITER = FIXTURE / "torch" / "iter_0000002"
# --overlap-grad-reduce --ddp-bucket-size 10: a bucket per parameter, coalesced unpadded
LEGACY_BUCKETS_ITER = FIXTURE / "torch_buckets" / "iter_0000002"


@pytest.mark.parametrize("where", [ITER, DP_ITER, BUCKETS_ITER, LEGACY_ITER,
                                   LEGACY_BUCKETS_ITER])
def test_distributed_optimizer_state_is_the_one_megatron_core_held(where):
    state = read_megatron(where)
    held = torch.load(FIXTURE / "optim_reference.pt")
    assert set(state.model) == set(held)
    for name, tensors in held.items():
        assert torch.equal(state.model[name], tensors["param"]), name
        assert torch.equal(state.optimizer[f"{name}.exp_avg"], tensors["exp_avg"]), name
        assert torch.equal(state.optimizer[f"{name}.exp_avg_sq"], tensors["exp_avg_sq"]), name
        assert float(state.optimizer[f"{name}.step"]) == 2.0
    assert all(t["exp_avg_sq"].abs().sum() > 0 for t in held.values())


def test_legacy_buckets_split_by_megatron_cores_rule(tmp_path):
    """distrib_optim.pt records only the buffer's total: the split comes from the args' bucket
    size; the same file read as one bucket does not fit, one line."""
    where = tmp_path / "iter_0000002"
    shutil.copytree(LEGACY_BUCKETS_ITER, where)
    path = where / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["args"].overlap_grad_reduce = False
    torch.save(state, path)
    with pytest.raises(ConfigError, match=r"buckets of \[7744\] elements.*lays out \[8448\]"):
        read_megatron(where)


def test_a_missing_step_is_one_line(tmp_path):
    where = tmp_path / "iter_0000002"
    shutil.copytree(ITER, where)
    common = torch.load(where / "common.pt", weights_only=False)
    for group in common["optimizer"]["optimizer"]["param_groups"]:
        group.pop("step")
    torch.save(common, where / "common.pt")
    with pytest.raises(ConfigError, match="no Adam step"):
        read_megatron(where)


def test_another_sharding_is_refused_in_one_line(tmp_path):
    where = tmp_path / "iter_0000002"
    shutil.copytree(DP_ITER, where)
    common = torch.load(where / "common.pt", weights_only=False)
    common["optimizer"]["param_state_sharding_type"] = "fully_sharded_model_space"
    torch.save(common, where / "common.pt")
    with pytest.raises(ConfigError, match="saved 'fully_sharded_model_space'.*--no-load-optim"):
        read_megatron(where)


@pytest.mark.parametrize("where", [ITER, DP_ITER, LEGACY_ITER])
def test_without_the_optimizer_the_weights_come_over(where):
    state = read_megatron(where, load_optim=False)
    held = torch.load(FIXTURE / "optim_reference.pt")
    assert not state.optimizer
    assert all(torch.equal(state.model[n], t["param"]) for n, t in held.items())
