"""A plan stage's own expert parallelism: expert_model_parallel_size / expert_tensor_parallel_size
read, written back, and every bad value refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import HeteroPlan, StageSpec
from tests.unit.plan.test_hetero_plan import error_of, example_dict


def moe_dict(**first: object) -> dict:
    data = example_dict()  # stage 0: TP 2 x DP 2 = 4 ranks; stage 1: TP 1 x DP 2
    data["stages"][0].update(first)
    return data


def test_defaults_are_ep_1_and_the_stage_tp() -> None:
    plan = HeteroPlan.from_dict(example_dict())
    assert [s.expert_model_parallel_size for s in plan.stages] == [1, 1]
    assert [s.expert_tensor_parallel_size for s in plan.stages] == [None, None]
    assert [s.expert_tp for s in plan.stages] == [2, 1]
    assert "expert" not in str(plan.to_dict())


def test_per_stage_ep_and_etp_round_trip(tmp_path: Path) -> None:
    data = moe_dict(expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    data["stages"][1]["expert_model_parallel_size"] = 2
    plan = HeteroPlan.from_dict(data)
    assert plan.stages[0] == StageSpec("fast", 2, 3, expert_model_parallel_size=2,
                                       expert_tensor_parallel_size=1)
    assert plan.stages[1].expert_model_parallel_size == 2
    plan.validate(4, 4, num_experts=4, world_size=6)
    plan.to_yaml(tmp_path / "plan.yaml")
    assert HeteroPlan.from_yaml(tmp_path / "plan.yaml") == plan
    assert "expert_model_parallel_size: 2" in (tmp_path / "plan.yaml").read_text()


@pytest.mark.parametrize("first, expected", [
    ({"expert_model_parallel_size": 0}, "expert_model_parallel_size must be"),
    ({"expert_tensor_parallel_size": -1}, "expert_tensor_parallel_size must be"),
    ({"expert_model_parallel_size": 3}, "EP x ETP dividing 4"),
    ({"expert_model_parallel_size": 4}, "4 x expert_tensor_parallel_size 2 = 8 does not divide"),
    ({"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 4}, "dividing 4"),
])
def test_bad_expert_sizes_are_one_line(first: dict, expected: str) -> None:
    message = error_of(moe_dict(**first))
    assert "stage 0" in message and expected in message


def test_ep_must_divide_the_experts_and_needs_a_moe_model() -> None:
    plan = HeteroPlan.from_dict(moe_dict(expert_model_parallel_size=2,
                                         expert_tensor_parallel_size=1))
    plan.validate(4, 4, num_experts=8)
    with pytest.raises(ConfigError, match=r"stage 0: expert_model_parallel_size 2 does not "
                                          r"divide the 3 experts \(--num-experts\)"):
        plan.validate(4, 4, num_experts=3)
    with pytest.raises(ConfigError, match="stage 0: .*the model has no experts"):
        plan.validate(4, 4)
