"""The plan file: schema, rank layout, layer ranges and every one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec

EXAMPLE = """\
data_parallel_size: 1
micro_batch_size: 1
global_batch_size: 8
chips:
  fast: {device: cpu}
  slow: {device: cpu, emulate_slowdown: 2.0}
stages:   # pipeline order; stage 0 holds the embedding, the last the head
  - {chip: fast, tensor_parallel_size: 2, num_layers: 3}
  - {chip: slow, tensor_parallel_size: 1, num_layers: 1, recompute: full}
"""


def example_dict() -> dict:
    return {
        "data_parallel_size": 2,
        "micro_batch_size": 1,
        "global_batch_size": 8,
        "chips": {"fast": {"device": "cpu"}, "slow": {"device": "cpu", "emulate_slowdown": 2.0}},
        "stages": [
            {"chip": "fast", "tensor_parallel_size": 2, "num_layers": 3},
            {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 1, "recompute": "full"},
        ],
    }


def error_of(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        HeteroPlan.from_dict(data)
    message = str(info.value)
    assert "\n" not in message
    assert isinstance(info.value, ValueError)
    return message


def test_reads_the_documented_example(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(EXAMPLE)
    plan = HeteroPlan.from_yaml(path)
    assert plan.chips["slow"] == ChipSpec("cpu", 2.0)
    assert plan.stages[1] == StageSpec("slow", 1, 1, "full")
    assert plan.stages[0].recompute == "none"
    assert plan.world_size == 3
    assert plan.pipeline_parallel_size == 2
    assert plan.num_micro_batches == 8
    plan.validate(num_layers=4, num_attention_heads=4, num_query_groups=2, world_size=3)


def test_yaml_round_trip_with_header(tmp_path: Path) -> None:
    plan = HeteroPlan.from_dict(example_dict())
    path = tmp_path / "out.yaml"
    plan.to_yaml(path, header="predicted step 1.0 s\nsecond line")
    text = path.read_text()
    assert text.startswith("# predicted step 1.0 s\n# second line\n")
    assert HeteroPlan.from_yaml(path) == plan
    assert HeteroPlan.from_dict(plan.to_dict()) == plan


def test_rank_layout_and_layer_ranges() -> None:
    plan = HeteroPlan.from_dict(example_dict())  # DP 2: stage 0 has 2 x 2 ranks, stage 1 has 1 x 2
    assert plan.world_size == 6
    assert plan.stage_ranks(0) == range(0, 4)
    assert plan.stage_ranks(1) == range(4, 6)
    assert plan.rank_coordinates(0) == (0, 0, 0)
    assert plan.rank_coordinates(1) == (0, 0, 1)  # TP groups are consecutive ranks
    assert plan.rank_coordinates(2) == (0, 1, 0)
    assert plan.rank_coordinates(5) == (1, 1, 0)
    assert plan.layer_ranges() == [range(0, 3), range(3, 4)]
    with pytest.raises(ConfigError):
        plan.stage_ranks(2)
    with pytest.raises(ConfigError):
        plan.rank_coordinates(6)


def test_edge_stages_may_hold_no_layer() -> None:
    data = example_dict()
    data["stages"] = [
        {"chip": "fast", "tensor_parallel_size": 1, "num_layers": 0},
        {"chip": "fast", "tensor_parallel_size": 1, "num_layers": 4},
        {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 0},
    ]
    plan = HeteroPlan.from_dict(data)
    assert plan.layer_ranges() == [range(0, 0), range(0, 4), range(4, 4)]


def test_layers_must_sum_to_the_model() -> None:
    plan = HeteroPlan.from_dict(example_dict())
    with pytest.raises(ConfigError, match=r"3\+1 = 4 layers but the model has 30"):
        plan.validate(num_layers=30, num_attention_heads=4, num_query_groups=2)


def test_world_size_must_match() -> None:
    plan = HeteroPlan.from_dict(example_dict())
    with pytest.raises(ConfigError, match="world size 6 .* but 8 processes"):
        plan.validate(4, 4, 2, world_size=8)


def test_tp_must_divide_heads_and_groups() -> None:
    plan = HeteroPlan.from_dict(example_dict())
    with pytest.raises(ConfigError, match="does not divide the 3 attention heads"):
        plan.validate(4, 3, 3)
    with pytest.raises(ConfigError, match="does not divide the 1 query groups"):
        plan.validate(4, 4, 1)


def test_unknown_chip_in_a_stage() -> None:
    data = example_dict()
    data["stages"][1]["chip"] = "slwo"
    assert "unknown chip 'slwo' (did you mean 'slow'?)" in error_of(data)


@pytest.mark.parametrize(
    ("where", "bad", "good"),
    [
        ("top", "data_paralel_size", "data_parallel_size"),
        ("stage", "tensor_paralel_size", "tensor_parallel_size"),
        ("chip", "emulate_slowdwn", "emulate_slowdown"),
    ],
)
def test_misspelt_keys_suggest_the_closest(where: str, bad: str, good: str) -> None:
    data = example_dict()
    target = {"top": data, "stage": data["stages"][0], "chip": data["chips"]["slow"]}[where]
    target[bad] = target.pop(good)
    message = error_of(data)
    assert f"unknown key '{bad}'" in message and f"did you mean '{good}'" in message


def test_missing_key() -> None:
    data = example_dict()
    del data["stages"][0]["num_layers"]
    assert "missing key 'num_layers' in stage 0" in error_of(data)


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (("data_parallel_size",), 0, "data_parallel_size must be positive"),
        (("micro_batch_size",), -1, "micro_batch_size must be positive"),
        (("stages", 0, "tensor_parallel_size"), 0, "tensor_parallel_size must be positive"),
        (("stages", 0, "num_layers"), -2, "num_layers must be at least 0"),
        (("global_batch_size",), True, "must be an integer"),
        (
            ("chips", "slow", "emulate_slowdown"),
            0.5,
            "emulate_slowdown must be a finite number at least 1.0",
        ),
    ],
)
def test_sizes_must_be_positive(path: tuple, value: object, expected: str) -> None:
    data = example_dict()
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    assert expected in error_of(data)


def test_global_batch_divisible_by_micro_batch_times_dp() -> None:
    data = example_dict()
    data["global_batch_size"] = 7
    assert "not divisible by micro_batch_size x data_parallel_size = 2" in error_of(data)


def test_middle_stage_without_layers() -> None:
    data = example_dict()
    data["stages"].insert(1, {"chip": "fast", "tensor_parallel_size": 1, "num_layers": 0})
    assert "stage 1 has no layer and holds neither the embedding" in error_of(data)


def test_bad_recompute_value() -> None:
    data = example_dict()
    data["stages"][1]["recompute"] = "ful"
    message = error_of(data)
    assert "recompute must be one of none, selective, full" in message
    assert "did you mean 'full'" in message


def test_empty_stages_and_file_errors(tmp_path: Path) -> None:
    data = example_dict()
    data["stages"] = []
    assert "non-empty list" in error_of(data)
    with pytest.raises(ConfigError, match="cannot read plan file"):
        HeteroPlan.from_yaml(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("stages: [\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        HeteroPlan.from_yaml(broken)


def interleaved_dict(first: list, second: list, **extra) -> dict:
    data = example_dict()
    data["stages"][0]["num_layers"] = first
    data["stages"][1]["num_layers"] = second
    data.update(extra)
    return data


def test_virtual_stages_are_numbered_chunk_major(tmp_path: Path) -> None:
    plan = HeteroPlan.from_dict(interleaved_dict([2, 1], [1, 2]))
    assert plan.virtual_pipeline_size == 2 and plan.schedule == "interleaved"
    assert plan.num_layers == 6 and [s.num_layers for s in plan.stages] == [3, 3]
    # chunk 0 of stage 0, chunk 0 of stage 1, chunk 1 of stage 0, chunk 1 of stage 1
    assert plan.chunk_layer_ranges() == [[range(0, 2), range(3, 4)], [range(2, 3), range(4, 6)]]
    plan.validate(6, 4, 2, world_size=6)
    plan.to_yaml(tmp_path / "plan.yaml")
    assert HeteroPlan.from_yaml(tmp_path / "plan.yaml") == plan
    assert "num_layers: [2, 1]" in (tmp_path / "plan.yaml").read_text()
    one = HeteroPlan.from_dict(example_dict())
    assert one.schedule == "1f1b" and one.chunk_layer_ranges() == [[r] for r in one.layer_ranges()]
    with pytest.raises(ConfigError, match="chunk_layer_ranges"):
        plan.layer_ranges()


@pytest.mark.parametrize("first, second, extra, expected", [
    ([2, 1], 3, {}, "same number of model chunks, got 2, 1"),
    ([2, 1], [0, 3], {}, "chunk 0 of stage 1 has no layer"),
    ([], [1, 2], {}, "num_layers is an empty list"),
    ([2, "x"], [1, 2], {}, "num_layers of a chunk must be an integer"),
    ([2, 1], [1, 2], {"schedule": "1f1b"}, "use schedule: interleaved"),
    (3, 1, {"schedule": "interleaved"}, "needs virtual pipeline stages"),
    (3, 1, {"schedule": "zero-bubbl"}, "did you mean 'zero-bubble'"),
])
def test_bad_virtual_stages_are_one_line(first, second, extra, expected) -> None:
    message = error_of(interleaved_dict(first, second, **extra))
    assert expected in message and "\n" not in message


def test_empty_edge_chunks_and_zero_bubble_schedule(tmp_path: Path) -> None:
    plan = HeteroPlan.from_dict(interleaved_dict([0, 2], [2, 0]))
    assert plan.chunk_layer_ranges() == [[range(0, 0), range(2, 4)], [range(0, 2), range(4, 4)]]
    zb = HeteroPlan.from_dict(interleaved_dict(3, 1, schedule="zero-bubble"))
    assert zb.schedule == "zero-bubble"
    zb.to_yaml(tmp_path / "zb.yaml")
    assert HeteroPlan.from_yaml(tmp_path / "zb.yaml") == zb


def test_stages_may_set_their_own_data_parallel_size(tmp_path: Path) -> None:
    data = example_dict()  # plan DP 2, global batch 8, micro-batch 1
    data["stages"][1]["data_parallel_size"] = 4
    plan = HeteroPlan.from_dict(data)
    assert [plan.stage_dp(s) for s in (0, 1)] == [2, 4] and not plan.uniform_dp
    assert plan.world_size == 2 * 2 + 1 * 4
    assert plan.stage_ranks(0) == range(0, 4) and plan.stage_ranks(1) == range(4, 8)
    assert plan.rank_coordinates(7) == (1, 3, 0) and plan.rank_coordinates(3) == (0, 1, 1)
    assert plan.total_micro_batches == 8
    assert [plan.stage_micro_batches(s) for s in (0, 1)] == [4, 2]
    with pytest.raises(ConfigError, match="stage_micro_batches"):
        _ = plan.num_micro_batches
    plan.to_yaml(tmp_path / "plan.yaml")
    assert HeteroPlan.from_yaml(tmp_path / "plan.yaml") == plan
    data["stages"][1]["data_parallel_size"] = 3
    assert "stage 1's data_parallel_size 3 = 3" in error_of(data)
    data["stages"][1]["data_parallel_size"] = 0
    assert "data_parallel_size must be positive" in error_of(data)
