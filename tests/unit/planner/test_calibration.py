"""Calibrating the planner to a machine (megatron_h2.planner.calibration)."""

import json

import pytest
import yaml

from megatron_h2.errors import ConfigError
from megatron_h2.planner.calibration import (
    LinkTimes,
    calibrated_cluster,
    fitted_gb_per_s,
    steady_step_ms,
)
from megatron_h2.planner.cluster import Cluster
from megatron_h2.planner.cost_model import CostConfig, CostModel
from megatron_h2.planner.model_input import model_from_dict

CLUSTER = {"chips": {"fast": {"device": "cpu", "count": 2, "chips_per_node": 2,
                              "tflops_bf16": 1, "memory_gib": 1, "intra_node_gb_per_s": 5,
                              "inter_node_gb_per_s": 1},
                     "slow": {"device": "cpu", "count": 1, "chips_per_node": 1,
                              "tflops_bf16": 1, "memory_gib": 1, "intra_node_gb_per_s": 5,
                              "inter_node_gb_per_s": 1, "emulate_slowdown": 2.0}},
           "cross_chip_gb_per_s": 1}
SHAPE = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
         "seq_length": 32, "max_position_embeddings": 32, "vocab_size": 256}
MODEL = model_from_dict(SHAPE)


def test_fitted_bandwidths_make_the_cost_model_give_the_measured_times():
    links = LinkTimes(allreduce_s=0.040, allreduce_bytes=32 << 20, p2p_s=0.0004,
                      p2p_bytes=256 << 10)
    data = calibrated_cluster(CLUSTER, links)
    cost = CostModel(Cluster.from_dict(data), MODEL, CostConfig())
    bandwidth = data["chips"]["fast"]["intra_node_gb_per_s"]
    assert cost.allreduce_s(links.allreduce_bytes, 2, bandwidth) == pytest.approx(
        links.allreduce_s, rel=1e-3)
    # a point-to-point transfer of the bf16 bytes the model counts = the fp32 one measured
    seq_hidden = links.p2p_bytes // 4
    model = model_from_dict(dict(SHAPE, hidden_size=seq_hidden // 32))
    cost = CostModel(Cluster.from_dict(data), model, CostConfig())
    assert cost.link_s("slow", "fast", 1) == pytest.approx(links.p2p_s, rel=1e-3)
    assert fitted_gb_per_s(links) == (data["chips"]["slow"]["inter_node_gb_per_s"],
                                      data["cross_chip_gb_per_s"])


def test_calibrated_cluster_keeps_everything_else():
    links = LinkTimes(0.01, 1 << 20, 0.001, 1 << 16)
    data = calibrated_cluster(CLUSTER, links)
    assert CLUSTER["chips"]["fast"]["intra_node_gb_per_s"] == 5  # the input is not changed
    for name in ("fast", "slow"):
        assert data["chips"][name]["chips_per_node"] == 1  # no TP between processes
        changed = ("chips_per_node", "intra_node_gb_per_s", "inter_node_gb_per_s")
        kept = {k: v for k, v in data["chips"][name].items() if k not in changed}
        assert kept == {k: v for k, v in CLUSTER["chips"][name].items() if k not in changed}
    assert Cluster.from_dict(yaml.safe_load(yaml.safe_dump(data))).chip("slow").count == 1
    with pytest.raises(ConfigError, match="chips"):
        calibrated_cluster({"cross_chip_gb_per_s": 1}, links)


def test_steady_step_leaves_out_warm_up_and_validation(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"iteration": i, "iteration_ms": 100.0 * i} for i in range(1, 7)]
    rows[-1]["val_loss"] = 3.0
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert steady_step_ms(path, 2) == [300.0, 400.0, 500.0]
    assert steady_step_ms(path, 6) == []
