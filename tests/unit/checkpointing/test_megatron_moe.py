"""Megatron-LM mixture-of-experts checkpoints (fixtures made by Megatron-Core with
tests/fixtures/megatron/generate_moe.py: 4 SequentialMLP experts, top-2, a shared expert, saved
at EP 1 and EP 2, and at EP 1 with --moe-layer-freq [1,0]: layer 1 dense)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron_h2.checkpointing.megatron_read import read_megatron
from megatron_h2.errors import ConfigError
from tests.unit.checkpointing.test_megatron_read import FIXTURES, FORMATS, logits_of

NAMES = ["moe_ep1", "moe_ep2", "moe_freq"]
EXPERT = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"


def iter_dir(name: str, fmt: str) -> Path:
    return FIXTURES / name / fmt / "iter_0000002"


@pytest.mark.parametrize(("name", "fmt"), [(n, f) for n in NAMES for f in FORMATS])
def test_moe_fixture_gives_megatron_cores_logits(name, fmt):
    state = read_megatron(iter_dir(name, fmt))
    reference = torch.load(FIXTURES / name / "reference.pt")
    assert (logits_of(state) - reference["logits"]).abs().max().item() <= 1e-6
    c = state.config
    assert (c.num_experts, c.moe_router_topk, c.moe_ffn_hidden_size,
            c.moe_shared_expert_intermediate_size) == (4, 2, 8, 16)
    assert c.moe_layer_freq == ([1, 0] if name == "moe_freq" else 1)
    expert = EXPERT.replace("layers.1", "layers.0") if name == "moe_freq" else EXPERT
    assert expert in state.model and state.model[expert].shape == (16, 8)
    assert set(state.optimizer) == {f"{n}.{k}" for n in state.model
                                   for k in ("exp_avg", "exp_avg_sq", "step")}
    assert (state.iteration, state.consumed_samples) == (2, 8)


@pytest.mark.parametrize("name", NAMES)
def test_moe_formats_agree(name):
    dist, legacy = (read_megatron(iter_dir(name, fmt)) for fmt in FORMATS)
    assert dist.model.keys() == legacy.model.keys()
    assert all(torch.equal(dist.model[k], legacy.model[k]) for k in dist.model)
    assert all(torch.equal(dist.optimizer[k], legacy.optimizer[k]) for k in dist.optimizer)


def test_ep2_local_experts_take_their_global_index():
    """EP rank 1's local expert 0 (in mp_rank_00_001) is global expert 2."""
    state = read_megatron(iter_dir("moe_ep2", "torch"))
    rank1 = torch.load(iter_dir("moe_ep2", "torch") / "mp_rank_00_001" / "model_optim_rng.pt",
                       weights_only=False)["model"]
    local = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    assert torch.equal(state.model[local.replace("experts.0.", "experts.2.")], rank1[local])


def _edit(path: Path, change) -> None:
    state = torch.load(path, weights_only=False)
    change(state)
    torch.save(state, path)


def _copy(name: str, fmt: str, tmp_path: Path) -> Path:
    shutil.copytree(FIXTURES / name / fmt, tmp_path / fmt)
    return tmp_path / fmt / "iter_0000002"


def test_missing_expert_is_named(tmp_path):
    root = _copy("moe_ep2", "torch", tmp_path)
    local = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    _edit(root / "mp_rank_00_001" / "model_optim_rng.pt", lambda s: s["model"].pop(local))
    with pytest.raises(ConfigError, match="the optimizer has 25 parameters, the model 24"):
        read_megatron(root)
    with pytest.raises(ConfigError, match="no tensor decoder.layers.1.mlp.experts.local_experts"
                                          r"\.3\.linear_fc1\.weight"):
        read_megatron(root, load_optim=False)


def test_missing_expert_parallel_rank_is_named(tmp_path):
    root = _copy("moe_ep2", "torch", tmp_path)
    shutil.rmtree(root / "mp_rank_00_001")
    with pytest.raises(ConfigError, match=r"missing shard directory mp_rank_00_001 \(a TP 1 x "
                                          r"PP 1 x EP 2 checkpoint\)"):
        read_megatron(root)


@pytest.mark.parametrize(("fmt", "count", "says"), [
    ("torch_dist", 8, "expected 2 x 8 \\(layers x\\) experts first"),
    ("torch", 8, "has no tensor decoder.layers.0.mlp.experts.local_experts.2.linear_fc1"),
    ("torch", 2, "holds decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight, but its "
                 "args give each EP rank 1 experts")])
def test_wrong_expert_count_is_one_line(fmt, count, says, tmp_path):
    root = _copy("moe_ep2", fmt, tmp_path)
    for path in [*root.glob("common.pt"), *root.glob("mp_rank_*/model_optim_rng.pt")]:
        _edit(path, lambda s: setattr(s["args"], "num_experts", count))
    with pytest.raises(ConfigError, match=says) as info:
        read_megatron(root)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("arg", "value"), [("moe_grouped_gemm", True),
                                            ("moe_expert_capacity_factor", 1.5),
                                            ("expert_model_parallel_size", 3)])
def test_moe_args_it_does_not_read_are_named(arg, value, tmp_path):
    root = _copy("moe_ep1", "torch_dist", tmp_path)
    _edit(root / "common.pt", lambda s: setattr(s["args"], arg, value))
    with pytest.raises(ConfigError, match=f"args.{arg} is {value!r}"):
        read_megatron(root)


@pytest.mark.parametrize("fmt", FORMATS)
def test_distributed_optimizer_of_moe_is_refused_in_one_line(fmt, tmp_path):
    root = _copy("moe_ep2", fmt, tmp_path)
    for path in [*root.glob("common.pt"), *root.glob("mp_rank_*/model_optim_rng.pt")]:
        _edit(path, lambda s: setattr(s["args"], "use_distributed_optimizer", True))
    with pytest.raises(ConfigError, match="distributed optimizer's state of a mixture-of-experts"):
        read_megatron(root)
    assert read_megatron(root, load_optim=False).optimizer == {}


def test_legacy_files_with_their_own_expert_tp_are_refused_in_one_line(tmp_path):
    """Legacy files split the experts over the expert-TP group: not merged like TP shards."""
    root = _copy("moe_ep2", "torch", tmp_path)
    for path in root.glob("mp_rank_*/model_optim_rng.pt"):
        _edit(path, lambda s: setattr(s["args"], "expert_tensor_parallel_size", 2))
    with pytest.raises(ConfigError, match="args.expert_tensor_parallel_size 2 differs from its "
                                          "TP 1; .* save it as torch_dist") as info:
        read_megatron(root)
    assert "\n" not in str(info.value)
