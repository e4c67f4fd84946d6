"""Megatron-LM checkpoints written by Megatron-Core itself (tests/fixtures/megatron, made by its
generate.py) read into our layout-independent state: the logits Megatron-Core computed, at every
TP/PP the fixtures were saved with, in both formats, with the training state."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron_h2.checkpointing.megatron_open import MegatronReader, open_any_checkpoint
from megatron_h2.checkpointing.megatron_read import read_megatron
from megatron_h2.errors import ConfigError
from megatron_h2.models.gpt.gpt_model import GPTModel
from tests.helpers.paths import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "megatron"
NAMES = ["gpt_tp1_pp1", "gpt_tp2_pp1", "gpt_tp1_pp2",
         "llama_tp1_pp1", "llama_tp2_pp1", "llama_tp1_pp2"]
FORMATS = ["torch_dist", "torch"]


def iter_dir(name: str, fmt: str) -> Path:
    return FIXTURES / name / fmt / "iter_0000002"


@torch.no_grad()
def logits_of(state) -> torch.Tensor:
    model = GPTModel(state.config).eval()
    model.load_state_dict(state.model, strict=True)
    return model(torch.load(FIXTURES / state.path.parent.parent.name / "reference.pt")["tokens"])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", NAMES)
def test_fixture_gives_megatron_cores_logits(name, fmt):
    state = read_megatron(iter_dir(name, fmt))
    want = torch.load(FIXTURES / name / "reference.pt")["logits"]
    assert (logits_of(state) - want).abs().max().item() <= 1e-6
    assert state.config.swiglu == name.startswith("llama")
    assert state.config.tied_embeddings == name.startswith("gpt")
    assert (state.iteration, state.consumed_samples) == (2, 8)
    assert state.scheduler["num_steps"] == 8
    # Adam's moments and step of every parameter
    assert set(state.optimizer) == {f"{n}.{k}" for n in state.model
                                   for k in ("exp_avg", "exp_avg_sq", "step")}
    assert all(state.optimizer[f"{n}.exp_avg_sq"].abs().sum() > 0 for n in state.model)
    assert float(state.optimizer["decoder.final_layernorm.weight.step"]) == 2.0


@pytest.mark.parametrize("name", NAMES)
def test_both_formats_hold_the_same_state(name):
    dist, legacy = (read_megatron(iter_dir(name, fmt)) for fmt in FORMATS)
    assert dist.model.keys() == legacy.model.keys()
    assert all(torch.equal(dist.model[k], legacy.model[k]) for k in dist.model)
    assert dist.optimizer.keys() == legacy.optimizer.keys()
    assert all(torch.equal(dist.optimizer[k], legacy.optimizer[k]) for k in dist.optimizer)


def test_layouts_are_undone():
    """A TP 2 checkpoint's merged SwiGLU fc1 is [gate; up] (our layout), not the rank-major
    [gate_0; up_0; gate_1; up_1] of a plain concatenation: the logits above depend on it, and
    here the legacy shards are checked directly."""
    state = read_megatron(iter_dir("llama_tp2_pp1", "torch"))
    shards = [torch.load(iter_dir("llama_tp2_pp1", "torch") / f"mp_rank_0{t}" /
                         "model_optim_rng.pt", weights_only=False)["model"]
              ["decoder.layers.1.mlp.linear_fc1.weight"] for t in range(2)]
    gate = torch.cat([s.chunk(2)[0] for s in shards])
    assert torch.equal(state.model["decoder.layers.1.mlp.linear_fc1.weight"].chunk(2)[0], gate)


def test_open_any_reads_megatron_dirs_and_checks_the_format():
    reader = open_any_checkpoint(FIXTURES / "gpt_tp2_pp1" / "torch_dist")
    assert isinstance(reader, MegatronReader)
    assert reader.metadata["consumed_samples"] == 8
    assert reader.metadata["megatron"]["tensor_model_parallel_size"] == 2
    assert reader.has("decoder.layers.0.mlp.linear_fc1.bias.exp_avg", "optim")
    with pytest.raises(ConfigError, match="--ckpt-format torch_dist or --auto-detect"):
        open_any_checkpoint(FIXTURES / "gpt_tp2_pp1" / "torch_dist", ckpt_format="torch")
    assert open_any_checkpoint(FIXTURES / "gpt_tp2_pp1" / "torch", ckpt_format="torch_dist",
                               auto_detect=True).state.format == "torch"


def test_missing_shard_directory_is_named(tmp_path):
    shutil.copytree(FIXTURES / "gpt_tp2_pp1" / "torch", tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "ckpt" / "iter_0000002" / "mp_rank_01")
    with pytest.raises(ConfigError, match="missing shard directory mp_rank_01"):
        read_megatron(tmp_path / "ckpt" / "iter_0000002")


def test_unknown_checkpoint_version_is_named(tmp_path):
    shutil.copytree(FIXTURES / "gpt_tp1_pp1" / "torch_dist", tmp_path / "ckpt")
    common = tmp_path / "ckpt" / "iter_0000002" / "common.pt"
    state = torch.load(common, weights_only=False)
    torch.save({**state, "checkpoint_version": 2.0}, common)
    with pytest.raises(ConfigError, match=r"common.pt has checkpoint_version 2.0"):
        read_megatron(tmp_path / "ckpt" / "iter_0000002")


@pytest.mark.parametrize("fmt", FORMATS)
def test_without_the_optimizer_its_tensors_are_not_read(fmt):
    state = read_megatron(iter_dir("llama_tp2_pp1", fmt), load_optim=False)
    assert state.model and not state.optimizer
    if fmt == "torch_dist":
        assert "optimizer.state.exp_avg.output_layer.weight" in state.not_read


def test_fp32_main_weights_are_the_weights(tmp_path):
    """A mixed-precision run's torch_dist checkpoint: bf16 weights plus the optimizer's fp32
    main weights (``optimizer.state.fp32_param.<key>``); the main weights come over. (Made from
    an fp32 fixture with torch's checkpoint writer: the layout Megatron-Core's
    Float16OptimizerWithFloat16Params saves.)"""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    from megatron_h2.checkpointing.megatron_dist import read_dist_tensors

    src = iter_dir("gpt_tp1_pp1", "torch_dist")
    tensors, _ = read_dist_tensors(src)
    mains = {f"optimizer.state.fp32_param.{k}": v + 1e-3 for k, v in tensors.items()
             if not k.startswith("optimizer.")}
    state = {k: v.bfloat16() if not k.startswith("optimizer.") else v
             for k, v in tensors.items()}
    out = tmp_path / "iter_0000002"

    def write(tensors: dict) -> None:
        shutil.rmtree(out, ignore_errors=True)
        dcp_save(tensors, storage_writer=FileSystemWriter(str(out)), no_dist=True)
        for name in ("common.pt", "metadata.json"):
            shutil.copy(src / name, out / name)

    write({**state, **mains})
    got, want = read_megatron(out), read_megatron(src)
    for name, tensor in got.model.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, want.model[name] + 1e-3), name
    del mains[next(iter(mains))]  # one main weight missing: refused
    write({**state, **mains})
    with pytest.raises(ConfigError, match="fp32 main weights for some parameters"):
        read_megatron(out)
