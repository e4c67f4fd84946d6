"""100 generated corruptions of Megatron-LM fixtures (truncated and missing files, wrong shapes,
missing keys, bad metadata): each is one line naming what is wrong; none loads."""

from __future__ import annotations

import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch

from megatron_h2.checkpointing.megatron_open import open_any_checkpoint
from megatron_h2.errors import ConfigError
from tests.helpers.paths import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "megatron"
SOURCES = [("gpt_tp2_pp1", "torch_dist"), ("llama_tp1_pp2", "torch"),
           ("llama_tp2_pp1", "torch_dist"), ("gpt_tp1_pp2", "torch")]


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _truncate(root: Path, rng: random.Random) -> str:
    path = rng.choice(_files(root))
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: int(size * rng.uniform(0.0, 0.95))])
    return f"truncate {path.name}"


def _delete(root: Path, rng: random.Random) -> str:
    path = rng.choice(_files(root))
    path.unlink()
    return f"delete {path.name}"


def _bad_metadata(root: Path, rng: random.Random) -> str:
    latest = root / "latest_checkpointed_iteration.txt"
    meta = root / "iter_0000002" / "metadata.json"
    choice = rng.randrange(5)
    if choice == 0:
        latest.write_text(rng.choice(["release", "-1", "abc", "", "7"]))
    elif meta.exists() and choice == 1:
        meta.write_text(rng.choice(["{", "[]", '{"sharded_backend": "zarr"}', "null"]))
    else:  # an entry of the state dict that says something else
        target = rng.choice([p for p in _files(root) if p.suffix == ".pt"])
        state = torch.load(target, weights_only=False)
        key, value = rng.choice([("checkpoint_version", rng.choice([0, 1.0, 2.0, "3"])),
                                 ("iteration", rng.choice([-1, "2", None, 3])),
                                 ("args", rng.choice([None, {}, 5]))])
        if key == "iteration" and value == 3 and "model" not in state:
            value = -1  # torch_dist: the directory's iteration comes from common.pt alone
        state[key] = value
        torch.save(state, target)
    return f"metadata {choice}"


def _state_edit(root: Path, rng: random.Random) -> str:
    """Missing keys, wrong shapes and a different model in the pickled state dicts."""
    pts = [p for p in _files(root) if p.suffix == ".pt" and p.name != "distrib_optim.pt"]
    target = rng.choice(pts)
    state = torch.load(target, weights_only=False)
    choice = rng.randrange(4)
    if choice == 0:
        state["args"].hidden_size *= 2
    elif choice == 1:
        state["args"].num_layers += 1
    elif "model" in state:
        tensors = [k for k, v in state["model"].items() if isinstance(v, torch.Tensor)]
        key = rng.choice(tensors)
        if choice == 2:
            del state["model"][key]
        else:
            state["model"][key] = state["model"][key].narrow(0, 0, state["model"][key].shape[0]
                                                             - 1)
    else:  # torch_dist: the tensors' index (pickled torch.distributed.checkpoint metadata)
        meta_path = root / "iter_0000002" / ".metadata"
        with open(meta_path, "rb") as fh:
            meta = pickle.load(fh)
        tensors = [k for k, v in meta.state_dict_metadata.items() if hasattr(v, "size")]
        key = rng.choice(tensors)
        if choice == 2:
            del meta.state_dict_metadata[key]
        else:
            item = meta.state_dict_metadata[key]
            item.size = torch.Size([*item.size[:-1], item.size[-1] + 1])
        with open(meta_path, "wb") as fh:
            pickle.dump(meta, fh)
        return f"dist metadata {choice} {key}"
    torch.save(state, target)
    return f"state {choice} {target.parent.name}"


def _buffer_edit(root: Path, rng: random.Random) -> str:
    """The distributed optimizer's flat buffers: one shorter, or sized as another bucket."""
    legacy = [p for p in _files(root) if p.name == "distrib_optim.pt"]
    if legacy:
        target = rng.choice(legacy)
        saved = torch.load(target, weights_only=False)
        (entry,) = saved[0].values()
        kind = rng.choice(["param", "exp_avg", "exp_avg_sq", "numel_unpadded"])
        cut = rng.choice([1, 63, 64, 640])
        entry[kind] = entry[kind] - cut if kind == "numel_unpadded" else entry[kind][:-cut]
        torch.save(saved, target)
        return f"distrib_optim {target.parent.name} {kind} -{cut}"
    meta_path = root / "iter_0000002" / ".metadata"
    with open(meta_path, "rb") as fh:
        meta = pickle.load(fh)
    key = rng.choice([k for k in meta.state_dict_metadata if ".bucket_idx_" in k])
    item = meta.state_dict_metadata[key]
    item.size = torch.Size([item.size[0] - rng.choice([1, 64, 128])])
    with open(meta_path, "wb") as fh:
        pickle.dump(meta, fh)
    return f"dist buffer {key}"


def _expert_edit(root: Path, rng: random.Random) -> str:
    """A mixture-of-experts checkpoint: an expert missing, or args with another expert count or
    expert-parallel size."""
    target = rng.choice([p for p in _files(root) if p.suffix == ".pt"])
    state = torch.load(target, weights_only=False)
    choice = rng.randrange(3)
    if choice == 0 and "model" in state:
        key = rng.choice([k for k in state["model"] if ".local_experts." in k])
        del state["model"][key]
    elif choice == 1 or "model" not in state:
        state["args"].num_experts = rng.choice([2, 3, 8])
    else:
        state["args"].expert_model_parallel_size = rng.choice([1, 3, 4])
    torch.save(state, target)
    return f"experts {choice} {target.parent.name}"


FAMILIES = [_truncate, _delete, _bad_metadata, _state_edit]
MOE_SOURCES = [("moe_ep2", "torch"), ("moe_ep2", "torch_dist"), ("moe_ep1", "torch"),
               ("moe_freq", "torch_dist")]
DISTOPT_SOURCES = [("gpt_distopt_tp2_pp2_dp2", "dp_reshardable"),
                   ("gpt_distopt_tp2_pp2_dp2", "torch"), ("llama_distopt_tp2", "dp_reshardable"),
                   ("gpt_distopt_pp2", "torch"), ("gpt_distopt_dp2", "dp_reshardable")]


@pytest.mark.parametrize(("sources", "families", "cases"), [
    (SOURCES, FAMILIES, 100), (DISTOPT_SOURCES, [*FAMILIES, _buffer_edit], 50),
    (MOE_SOURCES, [*FAMILIES, _expert_edit], 60)])
def test_corruptions_each_one_line(tmp_path, sources, families, cases):
    """100 of the plain fixtures; 50 of the distributed optimizer's (its buffers too); 60 of
    the mixture-of-experts ones (their experts too)."""
    rng = random.Random(2026)
    outcomes = []
    for case in range(cases):
        name, fmt = sources[(case // len(families)) % len(sources)]  # every pairing
        root = tmp_path / f"c{case}"
        shutil.copytree(FIXTURES / name / fmt, root)
        what = families[case % len(families)](root, rng)
        try:
            open_any_checkpoint(root)
        except ConfigError as exc:
            message = str(exc)
        else:
            pytest.fail(f"case {case} ({name} {fmt}: {what}) loaded")
        assert "\n" not in message and message, (what, message)
        outcomes.append((what, message))
        shutil.rmtree(root)
    assert len(outcomes) == cases
