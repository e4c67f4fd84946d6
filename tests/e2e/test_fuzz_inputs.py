"""Fuzzing every input format a user hands us: at least 100 generated corruptions each of
checkpoint metadata, the latest file and the ``.idx`` index, and at least 200 each of plan YAML
and cluster YAML (among them keys given twice and huge numbers).

Each corruption must end in one of two ways: a one-line ConfigError, or a load that is correct
(what the file says, or, where a checksum guards the file, exactly the original). Never a
traceback, never a silent wrong load.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from megatron_h2.checkpointing import find_latest_iteration, load_checkpoint, read_metadata
from megatron_h2.checkpointing.checkpoint_io import (
    capture_rng,
    check_compatible,
    check_rng_metadata,
    restore_rng,
)
from megatron_h2.checkpointing.format import LATEST_FILE, METADATA_FILE, save_checkpoint
from megatron_h2.config import RunConfig
from megatron_h2.data import check_token_ids
from megatron_h2.data.indexed_dataset import IndexedDataset
from megatron_h2.devices import get_accelerator
from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner.cluster import Cluster

CASES = 120
YAML_CASES = 240
HUGE = ["800000000000000000000000000", "80000000000", "16777217", "99999999999999999999",
        "1.0e+300", "-99999999999999999999", "4294967297", "1.0e+10"]
SCALARS = [None, True, False, -1, 0, 2**70, 1.5, float("nan"), "x", "7", "", [], {}, [1, 2],
           {"a": 1}]
YAML_SCALARS = ["-1", "0", "2.0", "true", "null", "'2'", "[1, 2]", "{a: 1}", "1e3", "0x10", "~",
                "''", ".nan", ".inf", "99999999999999999999", "cpu", "fats", "full", "1.0"]
WEIRD = [b"\x00", b"\xff\xfe", b"-1", b"1e309", b"NaN", "٣".encode(), b"\n", b" ", b"{", b"]",
         b"\"", b"- ", b": ", b"&a *a", b"!!python/object:os.system"]


def byte_mutations(data: bytes, rng: random.Random, count: int) -> list[bytes]:
    """``count`` distinct corruptions: bit flips, random bytes, cuts, insertions, splices."""
    out: dict[bytes, None] = {}
    while len(out) < count:
        b = bytearray(data)
        op = rng.randrange(7)
        i = rng.randrange(len(b)) if b else 0
        if op == 0 and b:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[i] = rng.randrange(256)
        elif op == 2:
            del b[i:i + rng.randint(1, 16)]
        elif op == 3:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 4:
            b = b[:i]
        elif op == 5:
            b[i:i] = rng.choice(WEIRD)
        else:
            j = rng.randrange(len(b) + 1)
            b[i:i] = b[min(i, j):max(i, j)][:64]
        if bytes(b) != data:
            out[bytes(b)] = None
    return list(out)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list) and len(obj) < 20:
        for k, v in enumerate(obj):
            yield from _paths(v, prefix + (k,))


def json_mutations(obj, rng: random.Random, count: int) -> list[bytes]:
    """Structure-aware corruptions: a value replaced by another type, a key deleted, a list."""
    paths = list(_paths(obj))
    out: dict[bytes, None] = {}
    while len(out) < count:
        path = rng.choice(paths)
        mutated = json.loads(json.dumps(obj))
        if not path:
            mutated = rng.choice([[mutated], None, "text", 3])
        else:
            parent = mutated
            for key in path[:-1]:
                parent = parent[key]
            if isinstance(parent, dict) and rng.random() < 0.3:
                del parent[path[-1]]
            else:
                parent[path[-1]] = rng.choice(SCALARS)
        text = json.dumps(mutated).encode()
        out[text] = None
    return list(out)


def yaml_mutations(text: str, rng: random.Random, count: int) -> list[bytes]:
    """Line-level and value-level YAML corruptions plus byte-level ones."""
    lines = text.splitlines()
    values = [m.span(1) for m in re.finditer(r":\s*([^,{}\n\[\]#]+)", text)]
    out: dict[bytes, None] = {}
    keys = [(m.start(1), m.group(1)) for m in re.finditer(r"([A-Za-z_]+):", text)]
    while len(out) < count:
        op = rng.randrange(8)
        if op == 0:
            start, end = rng.choice(values)
            new = text[:start] + rng.choice(YAML_SCALARS) + text[end:]
        elif op == 5:  # a huge number
            start, end = rng.choice(values)
            new = text[:start] + rng.choice(HUGE) + text[end:]
        elif op == 6:  # a key given twice on its line (inline mappings) or on a copied line
            start, key = rng.choice(keys)
            new = text[:start] + f"{key}: {rng.choice(YAML_SCALARS + HUGE)}, " + text[start:]
        elif op == 7:
            copy = list(lines)
            i = rng.randrange(len(copy))
            line = copy[i]
            head, sep, _ = line.partition(":")
            if not sep or "{" in head:
                continue
            copy.insert(i + 1, f"{head}: {rng.choice(YAML_SCALARS + HUGE)}")
            new = "\n".join(copy)
        elif op == 1:
            copy = list(lines)
            del copy[rng.randrange(len(copy))]
            new = "\n".join(copy)
        elif op == 2:
            copy = list(lines)
            i = rng.randrange(len(copy))
            copy.insert(i, copy[rng.randrange(len(copy))])
            new = "\n".join(copy)
        elif op == 3:
            copy = list(lines)
            i = rng.randrange(len(copy))
            copy[i] = " " * rng.randint(0, 4) + copy[i].lstrip()
            new = "\n".join(copy)
        else:
            out[byte_mutations(text.encode(), rng, 1)[0]] = None
            continue
        if new != text:
            out[new.encode()] = None
    return list(out)


def duplicated_key(data: bytes) -> str | None:
    """A key given twice in one mapping of ``data`` (read with PyYAML's node tree, not with the
    loader under test), or None."""
    try:
        root = yaml.compose(data.decode("utf-8"))
    except Exception:  # noqa: BLE001 - not YAML at all: no duplicate to find
        return None
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    if key.value in seen:
                        return key.value
                    seen.add(key.value)
                stack += [key, value]
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value
    return None


def outcome(load: Callable[[], Any]) -> tuple[str, Any]:
    """('error', None) for a one-line ConfigError, ('loaded', result) otherwise; any other
    exception fails the test with its traceback."""
    try:
        result = load()
    except ConfigError as exc:
        assert "\n" not in str(exc) and str(exc), repr(str(exc))
        return "error", None
    return "loaded", result


# ------------------------------------------------------------------------ checkpoint metadata
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    cfg = RunConfig()
    cfg.model.vocab_size = 384
    rng = capture_rng(get_accelerator("cpu"))
    meta = {"consumed_samples": 56, "config": cfg.to_dict(), "rng": rng,
            "rng_per_rank": [rng], "layout": {"data_parallel_size": 1, "micro_batch_size": 4,
                                              "global_batch_size": 8,
                                              "chips": {"default": {"device": "cpu"}},
                                              "stages": [{"chip": "default",
                                                          "tensor_parallel_size": 1,
                                                          "num_layers": 4,
                                                          "recompute": "none"}]}}
    for it in (3, 7):
        save_checkpoint(root, it, {"w": torch.full((3, 2), float(it))},
                        {"w.exp_avg": torch.zeros(3, 2)}, meta)
    return root


def _load_like_training(root: Path, verify: bool) -> dict:
    """What pretrain_gpt does with a checkpoint's metadata before and while loading it."""
    cfg = RunConfig()
    cfg.model.vocab_size = 384
    iteration = find_latest_iteration(root)
    ckpt_dir = root / f"iter_{iteration:07d}"
    meta = read_metadata(ckpt_dir, verify)
    check_compatible(meta, cfg, ckpt_dir)
    check_rng_metadata(meta, ckpt_dir)
    saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        for state in meta.get("rng_per_rank", []):
            restore_rng(state, get_accelerator("cpu"))
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])
    loaded = load_checkpoint(root, verify=verify)
    return {"iteration": loaded.iteration, "meta": meta, "w": loaded.model["w"]}


@pytest.mark.parametrize("verify", [True, False])
def test_fuzz_checkpoint_metadata(checkpoint, tmp_path, verify):
    original = (checkpoint / "iter_0000007" / METADATA_FILE).read_bytes()
    rng = random.Random(11 + verify)
    cases = (byte_mutations(original, rng, CASES // 2)
             + json_mutations(json.loads(original), rng, CASES // 2))
    counts = {"error": 0, "loaded": 0}
    for index, data in enumerate(cases):
        root = tmp_path / str(index)
        shutil.copytree(checkpoint, root)
        (root / "iter_0000007" / METADATA_FILE).write_bytes(data)
        kind, result = outcome(lambda root=root: _load_like_training(root, verify))
        counts[kind] += 1
        if kind == "loaded":
            assert not verify, "a changed metadata file passed its checksum"
            said = json.loads(data)  # loaded: exactly what the file says, for iteration 7
            assert result["iteration"] == 7 == said["iteration"]
            assert result["meta"].get("consumed_samples") == said.get("consumed_samples")
            assert torch.equal(result["w"], torch.full((3, 2), 7.0))
        shutil.rmtree(root)
    assert len(cases) >= 100 and counts["error"] > 0, counts
    if verify:
        assert counts["loaded"] == 0


def test_fuzz_latest_file(checkpoint, tmp_path):
    rng = random.Random(5)
    cases = byte_mutations(b"7\n", rng, 60) + [
        s.encode() for s in ["3", "03\n", " 7 ", "7\r\n", "", "-7", "+7", "7.0", "1e1", "٧",
                             "７", "7\x00", "99999999999999999999", "iter_0000007", "release"]]
    cases += [bytes(rng.randrange(256) for _ in range(rng.randint(1, 12))) for _ in range(45)]
    loads = 0
    for index, data in enumerate(cases):
        root = tmp_path / str(index)
        shutil.copytree(checkpoint, root)
        (root / LATEST_FILE).write_bytes(data)
        kind, result = outcome(lambda root=root: _load_like_training(root, True))
        if kind == "loaded":
            loads += 1
            said = int(data.decode("ascii").strip())  # only plain ASCII digits may load
            assert result["iteration"] == said and torch.equal(result["w"],
                                                                torch.full((3, 2), float(said)))
        shutil.rmtree(root)
    assert len(cases) >= 100 and loads > 0


# ------------------------------------------------------------------------------------- .idx
def test_fuzz_index_file(corpus, tmp_path):
    original = IndexedDataset(corpus)
    sequences = [original[i].tolist() for i in range(len(original))]
    idx = Path(corpus + ".idx").read_bytes()
    rng = random.Random(3)
    header_heavy = [m for m in byte_mutations(idx[:200], rng, 60)]
    cases = [m + idx[200:] for m in header_heavy] + byte_mutations(idx, rng, 70)
    counts = {"error": 0, "loaded": 0}
    for index, data in enumerate(cases):
        prefix = tmp_path / f"d{index}"
        shutil.copy(corpus + ".bin", str(prefix) + ".bin")
        Path(str(prefix) + ".idx").write_bytes(data)

        def open_dataset(prefix=str(prefix)):
            check_token_ids(prefix, 257, str(tmp_path / "cache"))
            return IndexedDataset(prefix)

        kind, _ = outcome(open_dataset)
        counts[kind] += 1
        if kind == "loaded":  # every sequence training reads must be the original one
            dataset = IndexedDataset(str(prefix))
            assert [dataset[i].tolist() for i in range(len(dataset))] == sequences
    assert len(cases) >= 100 and counts["error"] > 0, counts


# ---------------------------------------------------------------------------- plan / cluster
PLAN = """# a plan as tools/plan.py writes it
data_parallel_size: 2
micro_batch_size: 2
global_batch_size: 16
chips:
  fast: {device: cpu}
  slow: {device: cpu, emulate_slowdown: 2.0}
stages:  # pipeline order
  - {chip: fast, tensor_parallel_size: 2, num_layers: 5}
  - {chip: slow, tensor_parallel_size: 1, num_layers: 3, recompute: full}
"""

CLUSTER = """chips:
  fast: {device: cpu, count: 4, chips_per_node: 4, tflops_bf16: 0.2, memory_gib: 0.05,
         intra_node_gb_per_s: 5, inter_node_gb_per_s: 1}
  slow: {device: cpu, count: 2, chips_per_node: 2, tflops_bf16: 0.2, memory_gib: 0.1,
         intra_node_gb_per_s: 5, inter_node_gb_per_s: 1, emulate_slowdown: 2.0}
cross_chip_gb_per_s: 1
"""


def _same_number(got, said) -> bool:
    if isinstance(said, bool) or not isinstance(said, (int, float)):
        return False
    return type(got) is type(said) and got == said or (isinstance(got, float) and
                                                         float(said) == got)


def _check_plan(plan: HeteroPlan, text: bytes) -> None:
    said = yaml.safe_load(text.decode())
    for key in ("data_parallel_size", "micro_batch_size", "global_batch_size"):
        assert type(getattr(plan, key)) is int and getattr(plan, key) == said[key]
    assert list(plan.chips) == [str(k) for k in said["chips"]]
    for name, chip in zip(plan.chips.values(), said["chips"].values()):
        assert name.device == chip["device"]
        assert _same_number(name.emulate_slowdown, chip.get("emulate_slowdown", 1.0))
    assert len(plan.stages) == len(said["stages"])
    for stage, raw in zip(plan.stages, said["stages"]):
        assert (stage.chip, stage.tensor_parallel_size, stage.num_layers, stage.recompute) == (
            raw["chip"], raw["tensor_parallel_size"], raw["num_layers"],
            raw.get("recompute", "none"))
        assert type(stage.tensor_parallel_size) is int and type(stage.num_layers) is int
    assert HeteroPlan.from_dict(plan.to_dict()) == plan
    for s in range(len(plan.stages)):
        plan.stage_ranks(s)
    plan.layer_ranges()


def _check_cluster(cluster: Cluster, text: bytes) -> None:
    said = yaml.safe_load(text.decode())
    assert cluster.names == [str(k) for k in said["chips"]]
    for chip, raw in zip(cluster.chips, said["chips"].values()):
        assert chip.device == raw["device"]
        for key in ("count", "chips_per_node"):
            assert type(getattr(chip, key)) is int and getattr(chip, key) == raw[key]
        for key in ("tflops_bf16", "memory_gib", "intra_node_gb_per_s", "inter_node_gb_per_s"):
            assert _same_number(getattr(chip, key), raw[key]) and math.isfinite(getattr(chip, key))
    assert Cluster.from_dict(cluster.to_dict()) == cluster


@pytest.mark.parametrize("text, loader, check", [(PLAN, HeteroPlan.from_yaml, _check_plan),
                                                 (CLUSTER, Cluster.from_yaml, _check_cluster)])
def test_fuzz_plan_and_cluster_yaml(tmp_path, text, loader, check):
    loader_ok = loader(_write(tmp_path / "orig.yaml", text.encode()))
    check(loader_ok, text.encode())
    cases = yaml_mutations(text, random.Random(len(text)), YAML_CASES)
    counts = {"error": 0, "loaded": 0, "duplicates": 0, "huge": 0}
    for index, data in enumerate(cases):
        path = _write(tmp_path / f"{index}.yaml", data)
        kind, result = outcome(lambda path=path: loader(path))
        counts[kind] += 1
        duplicate = duplicated_key(data)
        counts["duplicates"] += duplicate is not None
        counts["huge"] += any(h.encode() in data for h in HUGE)
        if kind == "loaded":
            assert duplicate is None, f"key {duplicate!r} given twice was accepted"
            check(result, data)
    assert len(cases) >= 200 and counts["error"] > 0 and counts["loaded"] > 0, counts
    assert counts["duplicates"] >= 30 and counts["huge"] >= 30, counts


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
