"""The distributed optimizer's state saved by Megatron-Core at DP 2, TP 2, PP 2 and all three
at once (tests/fixtures/megatron/*_distopt_*, made by generate_distopt.py under torchrun):
in torch_dist ``dp_reshardable`` and in the legacy ``distrib_optim.pt``, the fp32 main weights,
Adam's moments and step come over bit for bit equal to the state Megatron-Core's optimizer held
(its data-parallel ranks' slices put together, its TP shards merged by the rules the model
reader uses), and the model gives the logits Megatron-Core computed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megatron_h2.checkpointing.megatron_names import LAYER_PREFIX, merge_tp, split_layer_name
from megatron_h2.checkpointing.megatron_read import read_megatron
from megatron_h2.commands.convert_checkpoint import main as convert
from megatron_h2.errors import ConfigError
from megatron_h2.models.gpt.gpt_model import GPTModel
from tests.helpers.paths import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "megatron"
LAYOUTS = {"gpt_distopt_dp2": (1, 1, 2), "llama_distopt_tp2": (2, 1, 1),
           "gpt_distopt_pp2": (1, 2, 1), "gpt_distopt_tp2_pp2_dp2": (2, 2, 2)}  # TP, PP, DP
FORMATS = ["dp_reshardable", "torch"]


def held_state(name: str) -> dict[str, torch.Tensor]:
    """What Megatron-Core's optimizer held, under our names: ``<name>.param|exp_avg|..``. The
    reference is per (TP rank, stage) at local names; the last stage's copy of a tied
    embedding is left out (the reader checks it equals the embedding's)."""
    tp, pp, _ = LAYOUTS[name]
    per_stage = 2 // pp
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for (tp_rank, stage), params in torch.load(FIXTURES / name / "optim_reference.pt").items():
        for local, tensors in params.items():
            layer = split_layer_name(local)
            ours = (f"{LAYER_PREFIX}{stage * per_stage + layer[0]}.{layer[1]}"
                    if layer else local)
            if ours == "output_layer.weight" and name.startswith("gpt"):
                continue
            for kind, tensor in tensors.items():
                shards.setdefault(f"{ours}.{'main' if kind == 'param' else kind}",
                                  {})[tp_rank] = tensor
    assert all(len(pieces) == tp for pieces in shards.values())
    return {key: merge_tp(key, [pieces[r] for r in range(tp)], name.startswith("llama"),
                          Path(name))
            for key, pieces in shards.items()}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_state_is_the_one_megatron_core_held(name, fmt):
    state = read_megatron(FIXTURES / name / fmt / "iter_0000002")
    held = held_state(name)
    assert {f"{n}.main" for n in state.model} | set(state.optimizer) == set(held)
    for key, tensor in held.items():
        param, kind = key.rsplit(".", 1)
        got = state.model[param] if kind == "main" else state.optimizer[key]
        assert torch.equal(got, tensor), key
    assert all(held[f"{n}.exp_avg_sq"].abs().sum() > 0 for n in state.model)
    assert {float(state.optimizer[f"{n}.step"]) for n in state.model} == {2.0}
    _, _, dp = LAYOUTS[name]
    assert (state.iteration, state.consumed_samples) == (2, 2 * 2 * dp)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(LAYOUTS))
@torch.no_grad()
def test_the_model_gives_megatron_cores_logits(name, fmt):
    state = read_megatron(FIXTURES / name / fmt / "iter_0000002")
    reference = torch.load(FIXTURES / name / "reference.pt")
    model = GPTModel(state.config).eval()
    model.load_state_dict(state.model, strict=True)
    assert (model(reference["tokens"]) - reference["logits"]).abs().max().item() <= 1e-6


def test_swapped_tensor_parallel_ranks_are_one_line(tmp_path):
    """Rank 1's buffers read as rank 0's would be another parameter's state in the right
    shapes: the fp32 main weights then differ from the weights, one line."""
    where = tmp_path / "iter_0000002"
    shutil.copytree(FIXTURES / "llama_distopt_tp2" / "dp_reshardable" / "iter_0000002", where)
    meta = where / ".metadata"
    raw = meta.read_bytes()
    swapped = (raw.replace(b"dp_group_idx_0.gbuf", b"dp_group_idx_X.gbuf")
               .replace(b"dp_group_idx_1.gbuf", b"dp_group_idx_0.gbuf")
               .replace(b"dp_group_idx_X.gbuf", b"dp_group_idx_1.gbuf"))
    assert swapped != raw
    meta.write_bytes(swapped)
    with pytest.raises(ConfigError, match="fp32 main weight of .* differs from the fp32 "
                       "weight itself") as err:
        read_megatron(where)
    assert "\n" not in str(err.value)


def test_a_stage_with_the_other_stages_buffers_is_one_line(tmp_path):
    """The stages lay out differently (their own parameters, the tied embedding's bucket): the
    first stage's buffers read as the last's do not fit, one line naming the sizes."""
    where = tmp_path / "iter_0000002"
    shutil.copytree(FIXTURES / "gpt_distopt_pp2" / "dp_reshardable" / "iter_0000002", where)
    meta = where / ".metadata"
    meta.write_bytes(meta.read_bytes().replace(b"dp_group_idx_0.", b"dp_group_idx_X.")
                     .replace(b"dp_group_idx_1.", b"dp_group_idx_0.")
                     .replace(b"dp_group_idx_X.", b"dp_group_idx_1."))
    with pytest.raises(ConfigError, match=r"has buckets of \[\d+, \d+\] elements.*lays out"):
        read_megatron(where)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_without_the_optimizer_the_weights_come_over(name):
    held = held_state(name)
    for fmt in FORMATS:
        state = read_megatron(FIXTURES / name / fmt / "iter_0000002", load_optim=False)
        assert not state.optimizer
        assert all(torch.equal(t, held[f"{n}.main"]) for n, t in state.model.items())


@pytest.mark.parametrize(("name", "fmt"), [("gpt_distopt_tp2_pp2_dp2", "dp_reshardable"),
                                           ("llama_distopt_tp2", "torch")])
def test_round_trip_through_megatron_h2_is_exact(tmp_path, name, fmt):
    """megatron -> megatron_h2 -> megatron (torch_dist at the saved TP / PP, the vocabulary
    padded as the saving run padded it): the weights, Adam's moments and step read back bit for
    bit."""
    tp, pp, _ = LAYOUTS[name]
    ours, back = tmp_path / "ours", tmp_path / "back"
    assert convert(["--from", "megatron", "--to", "megatron_h2", "--input",
                    str(FIXTURES / name / fmt), "--output", str(ours)]) == 0
    assert convert(["--from", "megatron_h2", "--to", "megatron", "--input", str(ours),
                    "--output", str(back), "--target-tensor-parallel-size", str(tp),
                    "--target-pipeline-parallel-size", str(pp),
                    "--make-vocab-size-divisible-by", str(64 // tp)]) == 0  # as saved
    first = read_megatron(FIXTURES / name / fmt / "iter_0000002")
    again = read_megatron(back / "iter_0000002")
    assert first.model.keys() == again.model.keys()
    assert all(torch.equal(first.model[k], again.model[k]) for k in first.model)
    assert first.optimizer.keys() == again.optimizer.keys()
    assert all(torch.equal(first.optimizer[k], again.optimizer[k]) for k in first.optimizer)
