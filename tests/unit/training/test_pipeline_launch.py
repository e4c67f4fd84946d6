"""A plan of data-parallel pipelines at launch, without processes: the checks against the model
and the batch schedule (one line naming the pipeline), what the start-up report and the
timeline say, and the topology of a rank of each pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron_h2.config import ModelConfig, ParallelConfig
from megatron_h2.errors import ConfigError
from megatron_h2.monitoring.timeline import Timeline, format_summary, summarize
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.training.layout import (
    batch_unit,
    check_plan_for_model,
    check_routing,
    describe_dp,
)
from megatron_h2.training.main import main
from megatron_h2.training.startup_report import pipeline_lines
from tests.helpers.tiny_runs import MODEL


def two_pipelines(**second) -> dict:
    return {"micro_batch_size": 2, "global_batch_size": 16,
            "chips": {"fast": {"device": "cpu"}, "slow": {"device": "cpu"}},
            "pipelines": [
                {"batch_share": 12, "stages": [
                    {"chip": "fast", "tensor_parallel_size": 2, "num_layers": 2}]},
                {"batch_share": 4, "data_parallel_size": 2, "stages": [
                    {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 1},
                    {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 1}], **second}]}


def model(**fields) -> ModelConfig:
    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "ffn_hidden_size": 128, "seq_length": 32, "max_position_embeddings": 32,
            "vocab_size": 256}
    return ModelConfig(**{**base, **fields})


def test_checks_name_the_pipeline():
    plan = HeteroPlan.from_dict(two_pipelines())
    check_plan_for_model(plan, model(), ParallelConfig(), 6)
    with pytest.raises(ConfigError, match="^pipeline 0: stage 0 tensor parallel size 2 does "
                                          "not divide --ffn-hidden-size 129$"):
        check_plan_for_model(plan, model(ffn_hidden_size=129), ParallelConfig(), 6)
    with pytest.raises(ConfigError, match="world size 6 .* 4 processes were launched"):
        check_plan_for_model(plan, model(), ParallelConfig(), 4)
    with pytest.raises(ConfigError, match="^pipeline 0: plan stages hold 3 = 3 layers but the "
                                          "model has 2"):
        three = two_pipelines()
        three["pipelines"][0]["stages"][0]["num_layers"] = 3
        three["pipelines"][1]["stages"][1]["num_layers"] = 2
        check_plan_for_model(HeteroPlan.from_dict(three), model(), ParallelConfig(), 6)


def test_one_global_batch_split_into_fixed_shares():
    plan = HeteroPlan.from_dict(two_pipelines())
    assert batch_unit(plan) == 1
    check_routing(plan, [16])
    with pytest.raises(ConfigError, match="splits its global batch 16 into fixed shares; the "
                                          "batch-size schedule asks for 8, 16: drop "
                                          "--rampup-batch-size"):
        check_routing(plan, [8, 16])
    with pytest.raises(ConfigError, match="^pipeline 1: the interleaved schedule with virtual "
                                          "stages needs the number of micro-batches per "
                                          "replica"):
        interleaved = two_pipelines(stages=[
            {"chip": "slow", "tensor_parallel_size": 1, "num_layers": [1, 1]},
            {"chip": "slow", "tensor_parallel_size": 1, "num_layers": [1, 1]}])
        interleaved["pipelines"][0]["stages"][0]["num_layers"] = 4
        check_routing(HeteroPlan.from_dict(interleaved), [16])


def test_a_conflicting_schedule_flag_is_one_line(corpus, tmp_path: Path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(two_pipelines(schedule="zero-bubble")))
    assert main([*MODEL, "--data-path", corpus, "--hetero-plan", str(path), "--train-iters",
                 "2", "--pipeline-schedule", "1f1b"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --pipeline-schedule 1f1b differs from the plan's schedule 1f1b / "
                   "zero-bubble; drop the flag or edit the plan")


def test_start_up_lines_and_timeline_rows():
    plan = HeteroPlan.from_dict(two_pipelines())
    assert describe_dp(plan) == "1 | 2 per pipeline"
    lines = pipeline_lines(plan)
    assert lines[0] == "data-parallel pipelines: 2 | batch shares 12 + 4 = 16 sequences"
    assert lines[1].startswith("pipeline 0 (ranks 0-1, 12 sequences): 1 stage(s) | schedule "
                               "1f1b | 6 micro-batches per replica")
    assert lines[3].startswith("pipeline 1 (ranks 2-5, 4 sequences): 2 stage(s)")
    assert lines[4].startswith("  stage 0: chip slow (cpu) | TP 1 | layers 0-0")
    rows = [Timeline.for_plan(plan, rank, enabled=True) for rank in (1, 2, 5)]
    assert [t.stage for t in rows] == [0, 1, 2]
    assert rows[2].label == "pipeline 1 stage 1 (chip slow, TP 1)"
    for timeline in rows:
        timeline.record("forward", 0, 1.0, 2.0)
    text = format_summary(summarize([t.events() for t in rows]))
    assert "timeline pipeline 1 stage 1: compute 1.000 s" in text
    assert "timeline pipeline 0 stage 0:" in text


def test_slurm_script_components_follow_the_pipelines():
    """The planner's SLURM script: one het-job component per run of stages on one chip type,
    pipeline after pipeline, naming the pipeline."""
    from megatron_h2.planner.cluster import Cluster
    from megatron_h2.planner.launch import _slurm, components

    gpu = {"count": 16, "chips_per_node": 8, "tflops_bf16": 400, "memory_gib": 80,
           "intra_node_gb_per_s": 300, "inter_node_gb_per_s": 25}
    cluster = Cluster.from_dict({"chips": {"fast": {"device": "cuda", **gpu},
                                           "slow": {"device": "npu", **gpu}},
                                 "cross_chip_gb_per_s": 20})
    data = two_pipelines()
    data["pipelines"][0]["stages"].append(
        {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 0})
    plan = HeteroPlan.from_dict(data)
    parts = components(plan)
    assert [(p.pipeline, p.chip, p.first_rank, p.ranks) for p in parts] == [
        (0, "fast", 0, 2), (0, "slow", 2, 1), (1, "slow", 3, 4)]
    script = _slurm(plan, cluster, "plan.yaml", "")
    assert "# component 2: slow (npu), pipeline 1, stages 0-1, ranks 3-6" in script
    assert "--chips fast,slow,slow" in script


def test_each_pipeline_sets_its_own_expert_parallelism():
    """EP 2 on the stages of a DP-2 pipeline beside an EP-1 one runs; an expert TP other than
    the stage's TP is refused in one line naming the pipeline."""
    moe = model(num_experts=4, moe_router_topk=2)
    ep2 = two_pipelines()
    for stage in ep2["pipelines"][1]["stages"]:
        stage["expert_model_parallel_size"] = 2
    check_plan_for_model(HeteroPlan.from_dict(ep2), moe, ParallelConfig(), 6)
    etp = two_pipelines()
    etp["pipelines"][0]["stages"][0]["expert_tensor_parallel_size"] = 1
    with pytest.raises(ConfigError, match="^pipeline 0 sets an expert tensor parallel size "
                                          "other than its stage's TP"):
        check_plan_for_model(HeteroPlan.from_dict(etp), moe, ParallelConfig(), 6)
