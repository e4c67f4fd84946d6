"""The planner does not model mixture-of-experts layers yet: a MoE model (from a model file or
the command line) is refused in one line instead of being planned as a dense model."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_h2.config import ModelConfig
from megatron_h2.errors import ConfigError
from megatron_h2.planner import CostModel
from megatron_h2.planner.cluster import Cluster
from tests.e2e.test_planner_cli_main import CPU_CLUSTER, TINY, error_line


def test_cost_model_refuses_moe():
    model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                        vocab_size=64, num_experts=4)
    with pytest.raises(ConfigError, match="does not model mixture-of-experts layers"):
        CostModel(Cluster.from_yaml(CPU_CLUSTER), model)


def test_plan_cli_refuses_a_moe_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    line = error_line(["--cluster", CPU_CLUSTER, "--model", TINY, "--num-experts", "8",
                       "--output", str(tmp_path / "p.yaml")], capsys)
    assert "the planner does not model mixture-of-experts layers yet" in line
    assert not (tmp_path / "p.yaml").exists()
