"""Checksums written with every checkpoint part, checked on load; damage is named together with
the newest intact iteration; malformed metadata and latest files are one line."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from megatron_h2.checkpointing import (
    find_intact_before,
    find_latest_iteration,
    load_checkpoint,
    save_checkpoint,
)
from megatron_h2.checkpointing.format import LATEST_FILE, METADATA_FILE
from megatron_h2.checkpointing.integrity import MANIFEST_FILE, write_safetensors
from megatron_h2.errors import ConfigError
from megatron_h2.training.main import main
from tests.helpers.tiny_runs import flags

DAMAGED = "is truncated or corrupt: it does not match the size / checksum"


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """A run of 4 iterations that saved at 2 and 4 (each test works on a copy)."""
    tmp = tmp_path_factory.mktemp("trained")
    assert main(flags(corpus, tmp, "--train-iters", "4", "--lr-warmup-iters", "1",
                      "--save", str(tmp / "ckpt"), "--save-interval", "2")) == 0
    return tmp / "ckpt"


def _copy(trained: Path, tmp_path: Path) -> Path:
    shutil.copytree(trained, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _save(root: Path, it: int, value: float = 1.0) -> Path:
    return save_checkpoint(root, it, {"a.weight": torch.full((4, 3), value),
                                      "b.bias": torch.arange(5.0)},
                           {"a.weight.exp_avg": torch.zeros(4, 3)}, {"consumed_samples": it * 4})


def _flip_byte(path: Path, offset_from_end: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


def test_parts_are_standard_safetensors_and_the_manifest_holds_their_sha256(tmp_path):
    tensors = {"w": torch.randn(3, 4), "i": torch.arange(6), "h": torch.randn(2).bfloat16(),
               "s": torch.tensor(2.0), "e": torch.zeros(0), "m": torch.tensor([True, False])}
    entry = write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    raw = (tmp_path / "x.safetensors").read_bytes()
    assert raw == save(tensors, metadata={"format": "pt"})  # byte for byte the library's file
    assert entry == {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    d = _save(tmp_path / "ckpt", 3)
    manifest = json.loads((d / MANIFEST_FILE).read_text())
    assert set(manifest["files"]) == {"model_00000.safetensors", "optim_00000.safetensors",
                                      METADATA_FILE}
    for name, e in manifest["files"].items():
        assert e["sha256"] == hashlib.sha256((d / name).read_bytes()).hexdigest()


def test_bytes_changed_in_place_name_the_file_and_the_intact_iteration(tmp_path):
    _save(tmp_path, 5)
    d = _save(tmp_path, 10, 2.0)
    part = d / "model_00000.safetensors"
    _flip_byte(part)  # same size: only a checksum can tell
    with pytest.raises(ConfigError) as err:
        load_checkpoint(tmp_path)
    text = str(err.value)
    assert str(part) in text and DAMAGED in text and "\n" not in text
    assert "iteration 5" in text and "--ckpt-step 5" in text
    assert find_intact_before(tmp_path, 10) == 5
    assert load_checkpoint(tmp_path, 5).iteration == 5
    unchecked = load_checkpoint(tmp_path, verify=False)  # the user's explicit choice
    assert not torch.equal(unchecked.model["b.bias"], torch.arange(5.0))


def test_no_intact_iteration_is_said_so(tmp_path):
    d = _save(tmp_path, 4)
    _flip_byte(d / "optim_00000.safetensors")
    with pytest.raises(ConfigError, match="no earlier iteration in this directory is intact"):
        load_checkpoint(tmp_path)


def test_edited_metadata_is_caught_by_its_checksum(tmp_path):
    d = _save(tmp_path, 6)
    meta = json.loads((d / METADATA_FILE).read_text())
    assert meta["consumed_samples"] == 24
    meta["consumed_samples"] = 25  # same length: only the checksum can tell
    (d / METADATA_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
    with pytest.raises(ConfigError, match="metadata.json " + DAMAGED):
        load_checkpoint(tmp_path)


def test_a_checkpoint_without_manifest_needs_the_explicit_flag(tmp_path):
    d = _save(tmp_path, 2)
    (d / MANIFEST_FILE).unlink()
    with pytest.raises(ConfigError, match="no manifest.json.*--no-verify-checkpoint"):
        load_checkpoint(tmp_path)
    assert load_checkpoint(tmp_path, verify=False).iteration == 2


@pytest.mark.parametrize("content", [b"\xff\xfe\x00binary", "٣".encode(), b"-3", b"3.0", b"",
                                     b"1e3", "12\u00a0".encode(), b"0x10"])
def test_latest_file_must_be_ascii_digits(tmp_path, content):
    _save(tmp_path, 3)
    (tmp_path / LATEST_FILE).write_bytes(content)
    with pytest.raises(ConfigError) as err:
        find_latest_iteration(tmp_path)
    assert "should hold an iteration number" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("case, fragment", [
    ("list", "must be a JSON object, found list"),
    ("no_iteration", "has no iteration"),
    ("wrong_iteration", "says iteration 7 but lives in iter_0000004"),
    ("string_samples", "consumed_samples='12'"),
    ("bad_rng", "invalid RNG state"),
    ("short_rng", "invalid RNG state"),
    ("config_list", "config must be an object"),
])
def test_malformed_metadata_is_one_line_before_training(corpus, trained, tmp_path, capsys, case,
                                                        fragment):
    ckpt = _copy(trained, tmp_path)
    d = ckpt / "iter_0000004"
    meta = json.loads((d / METADATA_FILE).read_text())
    if case == "list":
        meta = [meta]
    elif case == "no_iteration":
        del meta["iteration"]
    elif case == "wrong_iteration":
        meta["iteration"] = 7
    elif case == "string_samples":
        meta["consumed_samples"] = "12"
    elif case == "bad_rng":
        meta["rng_per_rank"][0]["torch_cpu"] = "AAAA"
    elif case == "short_rng":
        meta["rng_per_rank"][0]["numpy"][1] = meta["rng_per_rank"][0]["numpy"][1][:10]
    elif case == "config_list":
        meta["config"] = [1, 2]
    (d / METADATA_FILE).write_text(json.dumps(meta))
    capsys.readouterr()
    # unchecked, so that the structure checks themselves are exercised
    assert main(flags(corpus, tmp_path, "--load", str(ckpt), "--train-iters", "5",
                      "--lr-warmup-iters", "1", "--no-verify-checkpoint")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and fragment in err, err
    # checked: the edited file no longer matches its checksum
    assert main(flags(corpus, tmp_path, "--load", str(ckpt), "--train-iters", "5",
                      "--lr-warmup-iters", "1")) == 2
    assert "metadata.json " + DAMAGED in capsys.readouterr().err


def test_nan_in_a_saved_weight_is_refused_at_load(corpus, trained, tmp_path, capsys):
    """A checkpoint that holds NaN (saved by a run with the checks off, or edited and re-saved)
    is refused when it is loaded, not 11 iterations later."""
    ckpt = _copy(trained, tmp_path)
    loaded = load_checkpoint(ckpt)
    loaded.model["decoder.layers.1.mlp.linear_fc2.weight"][0, 0] = float("nan")
    save_checkpoint(ckpt, 4, loaded.model, loaded.optimizer,
                    {k: v for k, v in loaded.metadata.items() if k != "parts"})
    capsys.readouterr()
    assert main(flags(corpus, tmp_path, "--load", str(ckpt), "--train-iters", "6",
                      "--override-opt_param-scheduler",
                      "--lr-warmup-iters", "1")) == 2
    err = capsys.readouterr().err.strip()
    assert "holds NaN or Inf in decoder.layers.1.mlp.linear_fc2.weight" in err
    assert "\n" not in err


def test_corrupt_part_is_refused_by_training_with_the_intact_iteration(corpus, trained,
                                                                       tmp_path, capsys):
    ckpt = _copy(trained, tmp_path)
    _flip_byte(ckpt / "iter_0000004" / "model_00000.safetensors", 1000)
    capsys.readouterr()
    assert main(flags(corpus, tmp_path, "--load", str(ckpt), "--train-iters", "6",
                      "--override-opt_param-scheduler",
                      "--lr-warmup-iters", "1")) == 2
    err = capsys.readouterr().err.strip()
    assert "iter_0000004/model_00000.safetensors " + DAMAGED in err
    assert "iteration 2" in err and "\n" not in err
