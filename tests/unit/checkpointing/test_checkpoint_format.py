"""Checkpoint files: atomic saves, merging parts, and one-line errors on damage."""

import json
import os

import pytest
import torch

from megatron_h2.checkpointing import (
    begin_save,
    commit_save,
    find_latest_iteration,
    load_checkpoint,
    save_checkpoint,
    write_part,
)
from megatron_h2.checkpointing.format import LATEST_FILE
from megatron_h2.errors import ConfigError


def _save(tmp_path, it, value=1.0):
    return save_checkpoint(tmp_path, it, {"a.weight": torch.full((2, 3), value)},
                           {"a.weight.exp_avg": torch.zeros(2, 3)}, {"consumed_samples": it * 4})


def test_round_trip_and_latest(tmp_path):
    assert load_checkpoint(tmp_path) is None  # empty dir: fresh start
    _save(tmp_path, 5)
    _save(tmp_path, 10, 2.0)
    assert find_latest_iteration(tmp_path) == 10
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.iteration == 10 and ckpt.metadata["consumed_samples"] == 40
    assert torch.equal(ckpt.model["a.weight"], torch.full((2, 3), 2.0))
    assert "a.weight.exp_avg" in ckpt.optimizer
    assert load_checkpoint(tmp_path, 5).model["a.weight"][0, 0] == 1.0
    assert load_checkpoint(tmp_path, load_optimizer=False).optimizer == {}
    # nothing in the format is pickled: every file is safetensors, JSON or text
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert path.suffix in (".safetensors", ".json", ".txt"), path


def test_parts_from_several_writers_merge(tmp_path):
    tmp = begin_save(tmp_path, 3)
    entries = dict([write_part(tmp, "model", 0, {"x": torch.ones(2)}),
                    write_part(tmp, "model", 1, {"y": torch.zeros(3)})])
    commit_save(tmp_path, tmp, 3, {}, entries)
    assert set(load_checkpoint(tmp_path).model) == {"x", "y"}


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    _save(tmp_path, 5)
    tmp = begin_save(tmp_path, 10)  # a writer that dies before commit
    write_part(tmp, "model", 0, {"a.weight": torch.zeros(2, 3)})
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.iteration == 5 and torch.equal(ckpt.model["a.weight"], torch.ones(2, 3))


def test_resaving_an_iteration_replaces_it(tmp_path):
    _save(tmp_path, 5)
    _save(tmp_path, 5, 3.0)
    assert load_checkpoint(tmp_path).model["a.weight"][0, 0] == 3.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000005", LATEST_FILE]


@pytest.mark.parametrize("damage, fragment", [
    ("truncate", "truncated or corrupt"),
    ("garbage", "is corrupt"),
    ("no_metadata", "incomplete: metadata.json is missing"),
    ("missing_part", "incomplete: model_00000.safetensors is missing"),
    ("bad_latest", "should hold an iteration number"),
    ("latest_points_nowhere", "does not exist"),
    ("bad_json", "metadata"),
])
def test_damaged_checkpoint_is_one_clear_line(tmp_path, damage, fragment):
    d = _save(tmp_path, 7)
    part = d / "model_00000.safetensors"
    if damage == "truncate":
        part.write_bytes(part.read_bytes()[:-5])
    elif damage == "garbage":
        part.write_bytes(b"\x00" * part.stat().st_size)
    elif damage == "no_metadata":
        (d / "metadata.json").unlink()
    elif damage == "missing_part":
        part.unlink()
    elif damage == "bad_latest":
        (tmp_path / LATEST_FILE).write_text("seven")
    elif damage == "latest_points_nowhere":
        (tmp_path / LATEST_FILE).write_text("8")
    elif damage == "bad_json":
        (d / "metadata.json").write_text("{not json")
    with pytest.raises(ConfigError) as err:
        load_checkpoint(tmp_path)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_metadata_records_part_sizes(tmp_path):
    d = _save(tmp_path, 1)
    meta = json.loads((d / "metadata.json").read_text())
    part = "model_00000.safetensors"
    assert meta["parts"][part] == os.path.getsize(d / part)
