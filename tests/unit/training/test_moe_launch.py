"""A MoE launch whose plan and flags disagree is refused in one line at start-up, before any
process group starts."""

from __future__ import annotations

import torch.distributed as dist

from megatron_h2.training.main import main
from tests.unit.pipeline.test_hetero_pp import GOOD, MODEL, write_plan


def test_plan_stage_ep_conflicts_with_the_flag(corpus, tmp_path, monkeypatch, capsys):
    plan = write_plan(tmp_path / "plan.yaml", GOOD)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert main([*MODEL, "--data-path", corpus, "--hetero-plan", plan, "--num-experts", "4",
                 "--expert-model-parallel-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert "--expert-model-parallel-size conflicts with --hetero-plan" in err
    assert not dist.is_initialized()
