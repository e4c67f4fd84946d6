"""Plan and cluster files are read strictly: a key given twice anywhere is a one-line error
naming the key and its lines (YAML itself keeps the last silently), and every number is bounded
to what a cluster can hold before any arithmetic on it (a huge batch was an OverflowError or a
MemoryError deep in the micro-batch routing)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner.cluster import Cluster
from megatron_h2.training.main import main
from tests.helpers.tiny_runs import MODEL

MAX_COUNT = 2**24  # megatron_h2.plan.yaml_io.MAX_COUNT

PLAN = """data_parallel_size: 1
micro_batch_size: 2
global_batch_size: 8
chips:
  fast: {device: cpu}
stages:
  - {chip: fast, tensor_parallel_size: 1, num_layers: 1}
  - chip: fast
    tensor_parallel_size: 1
    num_layers: 1
"""

CLUSTER = """chips:
  fast: {device: cpu, count: 4, chips_per_node: 4, tflops_bf16: 0.2, memory_gib: 0.05,
         intra_node_gb_per_s: 5, inter_node_gb_per_s: 1}
"""


def _write(tmp_path: Path, text: str, name: str = "plan.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert message and "\n" not in message
    return message


def test_a_duplicated_top_level_key_is_named_with_its_lines(tmp_path):
    """Issue reproduction 3: appending ``global_batch_size: 16`` trained with 16."""
    path = _write(tmp_path, PLAN + "global_batch_size: 16\n")
    with pytest.raises(ConfigError) as exc:
        HeteroPlan.from_yaml(path)
    assert _one_line(exc) == (f"plan file '{path}' gives the key 'global_batch_size' twice "
                              "(lines 3 and 11); keep one (YAML would silently take the last)")


@pytest.mark.parametrize("text, key, lines", [
    (PLAN.replace("    num_layers: 1\n", "    num_layers: 1\n    num_layers: 1\n"),
     "num_layers", "lines 10 and 11"),
    (PLAN.replace("num_layers: 1}", "num_layers: 1, chip: fast}"), "chip", "line 7"),
    (PLAN.replace("  fast: {device: cpu}\n", "  fast: {device: cpu}\n  fast: {device: cpu}\n"),
     "fast", "lines 5 and 6"),
])
def test_a_duplicated_key_inside_a_stage_or_chip_is_an_error(tmp_path, text, key, lines):
    """A duplicated ``num_layers`` inside a stage was caught only by chance (the layer sum)."""
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        HeteroPlan.from_yaml(path)
    assert f"gives the key '{key}' twice ({lines})" in _one_line(exc)


def test_a_duplicated_key_in_a_cluster_is_an_error(tmp_path):
    path = _write(tmp_path, CLUSTER.replace("memory_gib: 0.05", "memory_gib: 0.05, count: 8"),
                  "cluster.yaml")
    with pytest.raises(ConfigError, match="gives the key 'count' twice"):
        Cluster.from_yaml(path)


@pytest.mark.parametrize("value", ["800000000000000000000000000", "80000000000",
                                   str(MAX_COUNT + 1)])
def test_a_huge_batch_in_a_plan_is_one_line(tmp_path, value):
    """Issue reproduction 4: an OverflowError / MemoryError in the micro-batch routing."""
    path = _write(tmp_path, PLAN.replace("global_batch_size: 8", f"global_batch_size: {value}"))
    with pytest.raises(ConfigError) as exc:
        HeteroPlan.from_yaml(path)
    assert _one_line(exc).startswith(f"global_batch_size must be at most {MAX_COUNT:,} (no "
                                     "cluster holds more), got ")


@pytest.mark.parametrize("key", ["data_parallel_size", "micro_batch_size"])
def test_other_huge_plan_numbers_are_one_line(tmp_path, key):
    path = _write(tmp_path, re.sub(f"{key}: \\d+", f"{key}: 1{'0' * 30}", PLAN))
    with pytest.raises(ConfigError, match=f"{key} must be at most .* got a 31-digit number"):
        HeteroPlan.from_yaml(path)


@pytest.mark.parametrize("old, new", [("count: 4", "count: 99999999999999999999"),
                                      ("memory_gib: 0.05", "memory_gib: 1.0e+300"),
                                      ("tflops_bf16: 0.2", "tflops_bf16: .inf")])
def test_huge_cluster_figures_are_one_line(tmp_path, old, new):
    path = _write(tmp_path, CLUSTER.replace(old, new), "cluster.yaml")
    with pytest.raises(ConfigError) as exc:
        Cluster.from_yaml(path)
    assert "must be" in _one_line(exc) and "at most" in str(exc.value)


def test_a_huge_plan_batch_stops_pretrain_gpt_in_one_line(corpus, tmp_path, capsys):
    path = _write(tmp_path, PLAN.replace("global_batch_size: 8",
                                         "global_batch_size: 800000000000000000000000000"))
    assert main([*MODEL, "--data-path", corpus, "--hetero-plan", str(path), "--train-iters",
                 "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "global_batch_size" in err, err
