"""Writing Megatron-LM torch_dist checkpoints and converting on disk: megatron -> megatron_h2 ->
megatron is exact bit for bit, the written directory has every entry Megatron-Core wrote for the
same model (extra-state objects included), the vocabulary is padded as the target TP pads it."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from megatron_h2.checkpointing import load_checkpoint
from megatron_h2.checkpointing.megatron_dist import read_dist_tensors
from megatron_h2.checkpointing.megatron_read import read_megatron
from tests.helpers.convert_cli import convert
from tests.helpers.paths import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "megatron"


def entries(ckpt_dir: Path) -> dict[str, str]:
    meta = FileSystemReader(str(ckpt_dir)).read_metadata()
    return {k: "bytes" if isinstance(v, BytesStorageMetadata) else str(tuple(v.size))
            for k, v in meta.state_dict_metadata.items()}


def load_object(ckpt_dir: Path, key: str):
    """A byte object of a torch_dist checkpoint, unpickled (as Megatron-Core loads it)."""
    meta = FileSystemReader(str(ckpt_dir)).read_metadata()
    info = next(s for i, s in meta.storage_data.items() if i.fqn == key)
    raw = (ckpt_dir / info.relative_path).read_bytes()
    return torch.load(io.BytesIO(raw[info.offset: info.offset + info.length]),
                      weights_only=False)


@pytest.mark.parametrize("name, fmt, tp", [("gpt_tp2_pp1", "torch", 2),
                                           ("llama_tp1_pp2", "torch_dist", 1),
                                           ("gpt_tp1_pp2", "torch_dist", 1),
                                           ("llama_tp2_pp1", "torch_dist", 2),
                                           ("moe_ep1", "torch_dist", 1),
                                           ("moe_ep2", "torch", 1),
                                           ("moe_freq", "torch", 1)])
def test_round_trip_is_exact(name, fmt, tp, tmp_path):
    src = FIXTURES / name / fmt
    assert convert("--from", "megatron", "--to", "megatron_h2", "--input", src,
                   "--output", tmp_path / "ours") == 0
    ours = load_checkpoint(tmp_path / "ours")
    assert ours.iteration == 2 and ours.metadata["consumed_samples"] == 8
    assert convert("--from", "megatron_h2", "--to", "megatron", "--input", tmp_path / "ours",
                   "--output", tmp_path / "back", "--target-tensor-parallel-size", tp,
                   "--target-pipeline-parallel-size", 1,
                   "--make-vocab-size-divisible-by", 64 // tp) == 0
    a, b = read_megatron(src / "iter_0000002"), read_megatron(tmp_path / "back" / "iter_0000002")
    for x, y in ((a.model, b.model), (a.optimizer, b.optimizer)):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert (b.iteration, b.consumed_samples, b.scheduler) == (2, 8, a.scheduler)
    assert b.args["tensor_model_parallel_size"] == tp
    reference = FIXTURES / name / "torch_dist" / "iter_0000002"
    back = tmp_path / "back" / "iter_0000002"
    assert entries(back) == entries(reference)  # every key and shape Megatron-Core wrote
    for key in (k for k, v in entries(reference).items() if v == "bytes"):  # extra state
        assert load_object(back, key) == load_object(reference, key) == [None]
    got, _ = read_dist_tensors(back)
    want, _ = read_dist_tensors(reference)
    assert all(torch.equal(got[k], want[k]) for k in want)  # the raw stacked tensors too


def test_vocabulary_padded_for_the_target_tp(tmp_path):
    assert convert("--from", "megatron", "--to", "megatron_h2", "--input",
                   FIXTURES / "llama_tp1_pp1" / "torch_dist", "--output", tmp_path / "ours") == 0
    assert convert("--from", "megatron_h2", "--to", "megatron", "--input", tmp_path / "ours",
                   "--output", tmp_path / "tp2", "--target-tensor-parallel-size", "2",
                   "--target-pipeline-parallel-size", "2") == 0
    state = read_megatron(tmp_path / "tp2" / "iter_0000002")
    assert state.config.vocab_size == 256  # 64 real rows padded to 128 x TP 2, as Megatron pads
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert torch.equal(state.model[name][64:], torch.zeros(192, 16))
        assert torch.equal(state.optimizer[f"{name}.exp_avg"][64:], torch.zeros(192, 16))
    assert state.args["pipeline_model_parallel_size"] == 2
    common = torch.load(tmp_path / "tp2" / "iter_0000002" / "common.pt", weights_only=False)
    assert float(common["optimizer"]["state"]["common_step"]) == 2.0
    assert load_object(tmp_path / "tp2" / "iter_0000002",
                       "decoder.layers.mlp.linear_fc2._extra_state/shard_1_2") == [None]


@pytest.mark.parametrize("argv, says", [
    (["--to", "megatron", "--target-tensor-parallel-size", "2"], "--target-pipeline"),
    (["--to", "megatron_h2", "--target-tensor-parallel-size", "2"], "apply only to --to"),
    (["--to", "megatron", "--target-tensor-parallel-size", "3",
      "--target-pipeline-parallel-size", "1"], "does not divide"),
])
def test_bad_conversions_are_one_line(argv, says, tmp_path, capsys):
    assert convert("--from", "megatron", "--to", "megatron_h2", "--input",
                   FIXTURES / "gpt_tp1_pp1" / "torch", "--output", tmp_path / "ours") == 0
    capsys.readouterr()
    src = "megatron" if argv[1] == "megatron_h2" else "megatron_h2"
    assert convert("--from", src, *argv, "--input", tmp_path / "ours",
                   "--output", tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and says in err, err


def test_hf_to_megatron_goes_through_megatron_h2(tmp_path, capsys):
    assert convert("--from", "hf", "--to", "megatron", "--input", tmp_path,
                   "--output", tmp_path / "x", "--target-tensor-parallel-size", "1",
                   "--target-pipeline-parallel-size", "1") == 2
    assert "through megatron_h2" in capsys.readouterr().err
