"""Expert parallelism in plans of several data-parallel pipelines (multi-rank runs, gloo,
CPU, fp32, dropout 0) against one process.

Each pipeline sets its own EP: pipeline 0 holds two of the four experts per rank (DP 2, EP 2),
pipeline 1 all four (EP 1). The gradient sum across pipelines matches each expert's gradient
by its global name, whichever EP rank holds it, so 10 iterations must reproduce the
single-process losses, aux / z losses and tokens per expert (token dropping included) within
1e-5 relative, under the replicated optimizer and under ZeRO-1 (the experts' buckets sharded
over their own expert-DP group).
"""

from __future__ import annotations

import pytest
import yaml

from tests.e2e.test_moe_training import ARCHS, assert_same_run, moe_references, records
from tests.helpers.fork_run import fork_run
from tests.unit.training.test_parallel_training import MODEL

CHIPS = {"fast": {"device": "cpu"}, "slow": {"device": "cpu"}}


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory) -> dict[str, dict[int, dict]]:
    return moe_references(corpus, tmp_path_factory)


def stage(chip: str, layers: int, ep: int = 1) -> dict:
    return {"chip": chip, "tensor_parallel_size": 1, "num_layers": layers,
            "expert_model_parallel_size": ep}


def write_plan(path, *pipelines: tuple[int, int, list[dict]]) -> str:
    """``pipelines``: (batch share, DP, stages) each; micro-batch 2, global batch 8 as MODEL."""
    path.write_text(yaml.safe_dump({
        "micro_batch_size": 2, "global_batch_size": 8, "chips": CHIPS,
        "pipelines": [{"batch_share": share, "data_parallel_size": dp, "stages": stages}
                      for share, dp, stages in pipelines]}))
    return str(path)


def train(ranks: int, arch: str, corpus: str, plan: str, out, *flags: str):
    proc = fork_run(ranks, [*MODEL, *ARCHS[arch], "--data-path", corpus, "--hetero-plan", plan,
                            "--moe-token-dispatcher-type", "alltoall", "--log-jsonl", str(out),
                            *flags], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.e2e
def test_ep2_pipeline_and_ep1_pipeline(corpus, references, tmp_path):
    """Pipeline 0: one stage, DP 2, EP 2 (ranks 0-1); pipeline 1: one rank with every expert
    (the Mixtral-like model: aux and z losses, shared experts, a dense first layer)."""
    plan = write_plan(tmp_path / "plan.yaml", (4, 2, [stage("fast", 4, ep=2)]),
                      (4, 1, [stage("slow", 4)]))
    proc = train(3, "mixtral", corpus, plan, tmp_path / "log.jsonl")
    assert "data-parallel pipelines: 2 | batch shares 4 + 4 = 8 sequences" in proc.stdout
    assert "EP 2 (expert TP 1) | layers 0-3" in proc.stdout
    assert_same_run(records(tmp_path / "log.jsonl"), references["mixtral"])


@pytest.mark.e2e
def test_ep2_pipeline_and_two_stage_ep1_pipeline_under_zero1(corpus, references, tmp_path):
    """ZeRO-1: pipeline 0 (DP 2, EP 2: the experts' buckets on an expert-DP group of one rank,
    the dense ones sharded over DP 2) and pipeline 1 of two stages, EP 1 (the DeepSeek-like
    model: expert bias, sequence aux loss, capacity with token dropping)."""
    plan = write_plan(tmp_path / "plan.yaml", (4, 2, [stage("fast", 4, ep=2)]),
                      (4, 1, [stage("slow", 2), stage("slow", 2)]))
    train(4, "deepseek", corpus, plan, tmp_path / "log.jsonl", "--use-distributed-optimizer")
    assert_same_run(records(tmp_path / "log.jsonl"), references["deepseek"])
