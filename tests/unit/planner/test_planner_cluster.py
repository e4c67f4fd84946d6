"""Cluster and model inputs: the examples load, and bad input is one clear line."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from megatron_h2.errors import ConfigError
from megatron_h2.planner.cluster import Cluster
from megatron_h2.planner.model_input import model_from_dict, model_from_yaml
from tests.helpers.paths import ROOT
from tests.helpers.planner_models import planner_model

ISSUE_CLUSTER = """\
chips:
  A: {device: cuda, count: 256, chips_per_node: 8, tflops_bf16: 989, memory_gib: 80,
      intra_node_gb_per_s: 450, inter_node_gb_per_s: 50}
  B: {device: npu,  count: 512, chips_per_node: 8, tflops_bf16: 320, memory_gib: 64,
      intra_node_gb_per_s: 196, inter_node_gb_per_s: 25}
cross_chip_gb_per_s: 25
"""


def test_the_issue_example_and_the_shipped_examples_load(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(ISSUE_CLUSTER)
    cluster = Cluster.from_yaml(path)
    assert cluster.names == ["A", "B"] and cluster.total_chips == 768
    assert cluster.chip("B").nodes == 64 and cluster.chip("A").memory_bytes == 80 * 2**30
    assert cluster.link_gb_per_s("A", "A") == 50 and cluster.link_gb_per_s("A", "B") == 25
    assert Cluster.from_dict(cluster.to_dict()) == cluster
    sizes = {}
    for name in ("hetero_1024", "hetero_10k_6types", "cpu_2types"):
        sizes[name] = Cluster.from_yaml(ROOT / f"examples/clusters/{name}.yaml").total_chips
    assert sizes == {"hetero_1024": 1024, "hetero_10k_6types": 10000, "cpu_2types": 6}
    emulated = Cluster.from_yaml(ROOT / "examples/clusters/cpu_2types.yaml")
    assert (
        emulated.chip("slow").emulate_slowdown == 2.0
        and emulated.chip("fast").emulate_slowdown == 1.0
    )


def test_tensor_parallel_options_stay_in_a_node_and_divide_heads() -> None:
    cluster = Cluster.from_dict(yaml.safe_load(ISSUE_CLUSTER))
    assert cluster.chip("A").tensor_parallel_options(72, 8) == [1, 2, 4, 8]
    assert cluster.chip("A").tensor_parallel_options(12, 6) == [1, 2]
    assert (
        cluster.subset(["B"]).names == ["B"] and cluster.subset(["B"]).cross_chip_gb_per_s is None
    )


def cluster_error(change) -> str:  # type: ignore[no-untyped-def]
    data = copy.deepcopy(yaml.safe_load(ISSUE_CLUSTER))
    change(data)
    with pytest.raises(ConfigError) as info:
        Cluster.from_dict(data)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: d["chips"]["A"].update(tflops_bf61=d["chips"]["A"].pop("tflops_bf16")),
            "unknown key 'tflops_bf61' in chip type 'A' of cluster (did you mean 'tflops_bf16'?)",
        ),
        (
            lambda d: d.update(cross_chip_gbps=d.pop("cross_chip_gb_per_s")),
            "did you mean 'cross_chip_gb_per_s'",
        ),
        (lambda d: d.pop("cross_chip_gb_per_s"), "missing key 'cross_chip_gb_per_s'"),
        (lambda d: d["chips"]["B"].update(count=0), "chip type 'B': count must be positive, got 0"),
        (
            lambda d: d["chips"]["A"].update(memory_gib=-80),
            "chip type 'A': memory_gib must be a finite number",
        ),
        (
            lambda d: d["chips"]["A"].pop("chips_per_node"),
            "missing key 'chips_per_node' in chip type 'A'",
        ),
        (lambda d: d.update(chips={}), "'chips' in cluster must map chip type names"),
    ],
)
def test_cluster_errors(change, message: str) -> None:  # type: ignore[no-untyped-def]
    assert message in cluster_error(change)


def test_model_checks() -> None:
    model = model_from_yaml(ROOT / "examples/models/llama_100b.yaml")
    assert (model.num_layers, model.hidden_size, model.ffn_hidden_size) == (96, 9216, 24576)
    assert model.kv_channels == 128 and model.max_position_embeddings == 4096
    assert planner_model(2, 64, 128, 4, 32, 100).num_query_groups == 4
    with pytest.raises(ConfigError, match="not divisible by --num-attention-heads 7"):
        planner_model(2, 64, 128, 7, 32, 100)
    with pytest.raises(ConfigError, match="--num-query-groups 3 does not divide"):
        planner_model(2, 64, 128, 4, 32, 100, num_query_groups=3)
    with pytest.raises(
        ConfigError, match=re.escape("--seq-length 64 exceeds --max-position-embeddings 32")
    ):
        planner_model(2, 64, 128, 4, 64, 100, max_position_embeddings=32)
    with pytest.raises(ConfigError, match="did you mean 'hidden_size'"):
        model_from_dict({"num_layers": 2, "hiden_size": 64})
