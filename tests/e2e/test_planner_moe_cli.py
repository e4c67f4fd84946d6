"""``tools/plan.py`` on a mixture-of-experts model: the plan is written with each stage's EP
degree, the "why" lines cover the MoE layers and the dispatch, ``--compare-homogeneous`` prints
its ratio, and a MoE model's bad flags get one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_h2.plan.schema import HeteroPlan
from tests.e2e.test_planner_cli_main import CPU_CLUSTER, TINY, error_line, run


def test_plans_a_moe_model_with_its_layer_pattern(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.yaml"
    status, text, _ = run(["--cluster", CPU_CLUSTER, "--model", TINY, "--num-experts", "4",
                           "--moe-layer-freq", "([0]*2+[1]*6)", "--output", str(out),
                           "--compare-homogeneous"], capsys)
    assert status == 0
    assert "4 experts (top-2, softmax) in 6 of 8 layers" in text
    assert "MoE dispatch: the all-to-all takes" in text
    assert "MoE on " in text and "ratio heterogeneous / sum of homogeneous = " in text
    assert "expert-parallel degree dividing its DP degree" in text
    plan = HeteroPlan.from_yaml(out)
    assert plan.num_layers == 8 and plan.schedule != "interleaved"


def test_a_moe_layer_pattern_of_the_wrong_length_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = error_line(["--cluster", CPU_CLUSTER, "--model", TINY, "--num-experts", "4",
                       "--moe-layer-freq", "([0]*1+[1]*3)", "--output",
                       str(tmp_path / "p.yaml")], capsys)
    assert "--moe-layer-freq lists 4 layers but --num-layers is 8" in line
