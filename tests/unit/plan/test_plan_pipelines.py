"""Plans of several data-parallel pipelines: the file, the rank layout and every one-line error."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec

EXAMPLE = """\
micro_batch_size: 1
global_batch_size: 8
chips:
  fast: {device: cpu}
  slow: {device: cpu, emulate_slowdown: 2.0}
pipelines:
  - batch_share: 6
    stages:
      - {chip: fast, tensor_parallel_size: 2, num_layers: 4}
  - batch_share: 2
    data_parallel_size: 2
    stages:
      - {chip: slow, tensor_parallel_size: 1, num_layers: 3}
      - {chip: slow, tensor_parallel_size: 1, num_layers: 1}
"""


def two_pipelines() -> dict:
    return {
        "micro_batch_size": 1,
        "global_batch_size": 8,
        "chips": {"fast": {"device": "cpu"}, "slow": {"device": "cpu", "emulate_slowdown": 2.0}},
        "pipelines": [
            {"batch_share": 6, "stages": [
                {"chip": "fast", "tensor_parallel_size": 2, "num_layers": 4}]},
            {"batch_share": 2, "data_parallel_size": 2, "stages": [
                {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 3},
                {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 1}]},
        ],
    }


def error_of(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        HeteroPlan.from_dict(data, source="plan 'p.yaml'")
    message = str(info.value)
    assert "\n" not in message
    return message


def test_reads_the_documented_example(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(EXAMPLE)
    plan = HeteroPlan.from_yaml(path)
    assert plan.num_pipelines == 2 and plan.stages == ()
    first, second = plan.pipelines
    assert first.global_batch_size == 6 and second.global_batch_size == 2
    assert first.stages == (StageSpec("fast", 2, 4),)
    assert second.data_parallel_size == 2 and second.schedule == "1f1b"
    assert second.chips["slow"] == ChipSpec("cpu", 2.0)
    assert plan.world_size == 2 + 4
    assert plan.num_layers == 4
    plan.validate(num_layers=4, num_attention_heads=4, num_query_groups=2, world_size=6)


def test_rank_layout_over_pipelines() -> None:
    plan = HeteroPlan.from_dict(two_pipelines())
    first, second = plan.pipelines
    assert (first.first_rank, second.first_rank) == (0, 2)
    assert first.stage_ranks(0) == range(0, 2)
    assert second.stage_ranks(0) == range(2, 4) and second.stage_ranks(1) == range(4, 6)
    assert second.rank_coordinates(3) == (0, 1, 0)
    assert second.rank_coordinates(5) == (1, 1, 0)
    assert [plan.pipeline_of_rank(r) for r in range(6)] == [0, 0, 1, 1, 1, 1]
    assert [plan.rank_chip(r) for r in range(6)] == ["fast"] * 2 + ["slow"] * 4
    assert plan.chips_in_use() == {"fast": 2, "slow": 4}
    assert plan.pipeline_samples(0) == range(0, 6) and plan.pipeline_samples(1) == range(6, 8)
    with pytest.raises(ConfigError, match="out of range 2..5"):
        second.rank_coordinates(1)


def test_one_pipeline_plan_is_unchanged() -> None:
    plan = HeteroPlan.from_dict({
        "data_parallel_size": 2, "micro_batch_size": 1, "global_batch_size": 8,
        "chips": {"fast": {"device": "cpu"}},
        "stages": [{"chip": "fast", "tensor_parallel_size": 1, "num_layers": 2}]})
    assert plan.pipeline_plans == (plan,) and plan.num_pipelines == 1
    assert plan.pipeline_of_rank(1) == 0 and plan.rank_chip(1) == "fast"
    assert plan.pipeline_samples(0) == range(0, 8)
    assert "pipelines" not in plan.to_dict()


def test_a_pipelines_list_of_one_is_that_pipeline() -> None:
    data = two_pipelines()
    data["pipelines"] = data["pipelines"][:1]
    data["global_batch_size"] = 6
    plan = HeteroPlan.from_dict(data)
    assert plan.pipelines == () and plan.world_size == 2 and plan.global_batch_size == 6


def test_yaml_round_trip(tmp_path: Path) -> None:
    data = two_pipelines()
    data["pipelines"][1]["schedule"] = "zero-bubble"
    data["transports"] = [{"chips": ["fast", "slow"], "transport": "gloo"}]
    plan = HeteroPlan.from_dict(data)
    path = tmp_path / "out.yaml"
    plan.to_yaml(path, header="predicted step 1.0 s")
    assert path.read_text().startswith("# predicted step 1.0 s\n")
    assert HeteroPlan.from_yaml(path) == plan
    assert HeteroPlan.from_dict(plan.to_dict()) == plan
    assert hash(HeteroPlan.from_yaml(path)) == hash(plan)


def test_of_pipelines_combines_plans_of_one_pipeline() -> None:
    plan = HeteroPlan.from_dict(two_pipelines())
    alone = [HeteroPlan.from_dict(p.to_dict()) for p in plan.pipelines]
    assert [p.first_rank for p in alone] == [0, 0]
    assert HeteroPlan.of_pipelines(alone) == plan
    assert HeteroPlan.of_pipelines(alone[:1]) is alone[0]


def test_interleaving_in_one_pipeline_only() -> None:
    data = two_pipelines()
    data["pipelines"][1]["stages"] = [
        {"chip": "slow", "tensor_parallel_size": 1, "num_layers": [1, 1]},
        {"chip": "slow", "tensor_parallel_size": 1, "num_layers": [1, 1]}]
    plan = HeteroPlan.from_dict(data)
    assert plan.pipelines[0].virtual_pipeline_size == 1
    assert plan.pipelines[1].virtual_pipeline_size == 2
    assert plan.pipelines[1].schedule == "interleaved"


def test_per_pipeline_questions_name_the_pipelines() -> None:
    plan = HeteroPlan.from_dict(two_pipelines())
    for ask in (lambda: plan.stage_ranks(0), lambda: plan.rank_coordinates(0),
                lambda: plan.layer_ranges(), lambda: plan.pipeline_parallel_size,
                lambda: plan.virtual_pipeline_size, lambda: plan.stage_dp(0)):
        with pytest.raises(ConfigError, match=r"plan.pipelines\[k\]"):
            ask()


@pytest.mark.parametrize("edit, expected", [
    (lambda d: (d.update(micro_batch_size=2), d["pipelines"][0].update(batch_share=5)),
     "pipeline 0 of plan 'p.yaml': batch_share 5 is not a whole number of micro-batches of 2 "
     "sequences"),
    (lambda d: d.update(micro_batch_size=2),
     "pipeline 1 of plan 'p.yaml': batch_share 2 does not split into whole micro-batches over "
     "stage 0's 2 data-parallel replicas"),
    (lambda d: d["pipelines"][0].update(batch_share=4),
     "the pipelines' batch shares 4 + 2 = 6 do not add up to global_batch_size 8"),
    (lambda d: d["pipelines"][1]["stages"][0].update(num_layers=2),
     "pipeline 1 holds 3 layers but pipeline 0 holds 4; every pipeline holds every layer"),
    (lambda d: d["pipelines"][0]["stages"][0].update(chip="fats"),
     "pipeline 0 of plan 'p.yaml': stage 0 uses unknown chip 'fats' (did you mean 'fast'?)"),
    (lambda d: d.update(stages=[]), "lists both 'stages' and 'pipelines'"),
    (lambda d: d.update(pipelines=[]), "'pipelines' in plan 'p.yaml' must be a non-empty list"),
    (lambda d: d["pipelines"][0].update(batch_shares=6), "unknown key 'batch_shares' in "
     "pipeline 0 of plan 'p.yaml' (did you mean 'batch_share'?)"),
    (lambda d: d["pipelines"][1].pop("batch_share"), "missing key 'batch_share' in pipeline 1"),
    (lambda d: d["pipelines"][1].update(schedule="interleaved"),
     "pipeline 1 of plan 'p.yaml': the interleaved schedule needs virtual pipeline stages"),
])
def test_bad_pipelines_get_one_line(edit, expected: str) -> None:
    data = copy.deepcopy(two_pipelines())
    edit(data)
    assert expected in error_of(data)


def test_validate_names_the_pipeline_and_the_world() -> None:
    plan = HeteroPlan.from_dict(two_pipelines())
    with pytest.raises(ConfigError, match="pipeline 0: plan stages hold 4 = 4 layers but the "
                                          "model has 5"):
        plan.validate(num_layers=5, num_attention_heads=4)
    with pytest.raises(ConfigError, match="pipeline 0: stage 0 tensor_parallel_size 2 does not "
                                          "divide the 3 attention heads"):
        plan.validate(num_layers=4, num_attention_heads=3)
    with pytest.raises(ConfigError, match="needs world size 6 .* and pipelines.* launch 6"):
        plan.validate(num_layers=4, num_attention_heads=4, world_size=4)


def test_constructor_checks_pipelines() -> None:
    plan = HeteroPlan.from_dict(two_pipelines())
    first, second = plan.pipelines
    chips = dict(plan.chips)
    with pytest.raises(ConfigError, match="pipelines lists one pipeline"):
        HeteroPlan(1, 1, 6, chips, (), pipelines=[first])
    with pytest.raises(ConfigError, match="keeps its stages in its pipelines"):
        HeteroPlan(1, 1, 8, chips, first.stages, pipelines=[first, second])
    other = HeteroPlan(1, 2, 6, chips, first.stages)
    with pytest.raises(ConfigError, match="pipeline 0 has micro_batch_size 2 but the plan 1"):
        HeteroPlan(1, 1, 8, chips, (), pipelines=[other, second])
    with pytest.raises(ConfigError, match="pipeline 0 uses unknown chip 'fast'"):
        HeteroPlan(1, 1, 8, {"slow": chips["slow"]}, (), pipelines=[first, second])
    with pytest.raises(ConfigError, match="describes chip 'fast' otherwise"):
        HeteroPlan(1, 1, 8, {**chips, "fast": ChipSpec("cpu", 3.0)}, (),
                   pipelines=[first, second])


def test_chips_of_every_pipeline_must_fit_the_cluster() -> None:
    plan = HeteroPlan.from_dict(two_pipelines())
    plan.check_fits({"fast": 2, "slow": 4}, "cluster 'c.yaml'")
    with pytest.raises(ConfigError, match=r"^the plan needs 4 'slow' chips \(pipeline 1: 4; "
                                          r"pipelines never share chips\) but cluster 'c.yaml' "
                                          r"has 3; use fewer or give the cluster more$"):
        plan.check_fits({"fast": 2, "slow": 3}, "cluster 'c.yaml'")
    with pytest.raises(ConfigError, match="needs 2 'fast' chips but the cluster has 0"):
        plan.pipelines[0].check_fits({}, "the cluster")


def test_the_example_plan_fits_the_default_model() -> None:
    """examples/hetero/cpu_two_pipelines.yaml: pretrain_gpt.py's default model, 4 ranks."""
    from tests.helpers.paths import ROOT

    plan = HeteroPlan.from_yaml(ROOT / "examples" / "hetero" / "cpu_two_pipelines.yaml")
    plan.validate(num_layers=4, num_attention_heads=8, world_size=4)
    assert [p.global_batch_size for p in plan.pipelines] == [6, 2]
