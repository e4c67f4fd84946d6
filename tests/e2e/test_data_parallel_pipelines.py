"""Data-parallel pipelines trained by multi-rank runs (gloo, CPU, fp32, dropout 0): the
losses of 10 iterations equal one process's over the whole global batch within 1e-5, for
pipelines that shard the model differently (TP, stage boundaries, chip types through the
bridge, interleaving, ZeRO-1, uneven shares); a checkpoint saved with pipelines resumes in one
process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_h2.training.main import main
from tests.helpers.dist_utils import assert_losses_close as close
from tests.helpers.dist_utils import losses, tiny_model_flags
from tests.helpers.fork_run import fork_run

CHIPS = {"fast": {"device": "cpu"}, "slow": {"device": "cpu"}}


def stage(chip: str, tp: int, layers, dp: int | None = None) -> dict:
    out = {"chip": chip, "tensor_parallel_size": tp, "num_layers": layers}
    return out if dp is None else {**out, "data_parallel_size": dp}


def pipeline(share: int, *stages: dict, dp: int = 1) -> dict:
    return {"batch_share": share, "data_parallel_size": dp, "stages": list(stages)}


def write_plan(path: Path, global_batch: int, *pipelines: dict) -> str:
    path.write_text(yaml.safe_dump({"micro_batch_size": 2, "global_batch_size": global_batch,
                                    "chips": CHIPS, "pipelines": list(pipelines)}))
    return str(path)


def reference(corpus: str, folder: Path, global_batch: int, *extra: str) -> dict[int, float]:
    log = folder / "reference.jsonl"
    assert main([*tiny_model_flags(), "--data-path", corpus, "--micro-batch-size", "2",
                 "--global-batch-size", str(global_batch), "--log-jsonl", str(log),
                 *extra]) == 0
    return losses(log)


def train(corpus: str, folder: Path, plan: str, ranks: int, *extra: str):
    log = folder / "pipelines.jsonl"
    proc = fork_run(ranks, [*tiny_model_flags(), "--data-path", corpus, "--hetero-plan", plan,
                            "--log-jsonl", str(log), *extra], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return losses(log), proc


@pytest.fixture(scope="module")
def reference_16(corpus, tmp_path_factory) -> dict[int, float]:
    """One process, micro-batch 2, global batch 16 (8 micro-batches)."""
    return reference(corpus, tmp_path_factory.mktemp("ref16"), 16)


@pytest.mark.e2e
def test_tp_1_and_tp_2_with_the_same_boundaries(corpus, reference_16, tmp_path):
    plan = write_plan(tmp_path / "plan.yaml", 16,
                      pipeline(8, stage("fast", 1, 2), stage("fast", 1, 2)),
                      pipeline(8, stage("fast", 2, 2), stage("fast", 2, 2)))
    got, proc = train(corpus, tmp_path, plan, 6)
    close(got, reference_16)
    assert "data-parallel pipelines: 2 | batch shares 8 + 8 = 16 sequences" in proc.stdout
    assert "pipeline 1 stage 1: compute" in proc.stdout
    assert "gradients across pipelines" in proc.stdout


@pytest.mark.e2e
def test_other_pipeline_depth_and_chips_through_the_bridge_then_resume(corpus, reference_16,
                                                                       tmp_path):
    """One pipeline of one stage, one of two stages on two chip types (every boundary and the
    gradient exchange forced through the bridge); its checkpoint resumes in one process."""
    plan = write_plan(tmp_path / "plan.yaml", 16,
                      pipeline(8, stage("fast", 1, 4)),
                      pipeline(8, stage("fast", 1, 1), stage("slow", 1, 3)))
    ckpt = tmp_path / "ckpt"
    got, proc = train(corpus, tmp_path, plan, 3, "--force-bridge", "--save", str(ckpt),
                      "--save-interval", "5")
    close(got, reference_16)
    assert "over the bridge (gloo, host-staged, fp32)" in proc.stdout
    resumed = tmp_path / "resumed.jsonl"
    assert main([*tiny_model_flags(), "--data-path", corpus, "--micro-batch-size", "2",
                 "--global-batch-size", "16", "--load", str(ckpt), "--ckpt-step", "5",
                 "--log-jsonl", str(resumed)]) == 0
    close(losses(resumed), {k: v for k, v in reference_16.items() if k > 5})


@pytest.mark.e2e
def test_uneven_shares_6_and_2_micro_batches(corpus, reference_16, tmp_path):
    plan = write_plan(tmp_path / "plan.yaml", 16,
                      pipeline(12, stage("fast", 2, 4)),
                      pipeline(4, stage("slow", 1, 2), stage("slow", 1, 2)))
    got, _ = train(corpus, tmp_path, plan, 4)
    close(got, reference_16)


@pytest.mark.e2e
def test_zero_1_within_each_pipeline(corpus, tmp_path):
    """ZeRO-1 shards over each pipeline's own DP groups (DP 2 and per-stage DP 2 / 1)."""
    plan = write_plan(tmp_path / "plan.yaml", 16,
                      pipeline(8, stage("fast", 1, 4), dp=2),
                      pipeline(8, stage("slow", 1, 2, dp=2), stage("slow", 2, 2)))
    want = reference(corpus, tmp_path, 16, "--use-distributed-optimizer")
    got, _ = train(corpus, tmp_path, plan, 6, "--use-distributed-optimizer")
    close(got, want)


@pytest.mark.e2e
def test_interleaving_in_one_pipeline_with_a_timeline(corpus, reference_16, tmp_path):
    plan = write_plan(tmp_path / "plan.yaml", 16,
                      pipeline(8, stage("fast", 1, 4)),
                      pipeline(8, stage("slow", 1, [1, 1]), stage("slow", 1, [1, 1])))
    trace = tmp_path / "trace.json"
    got, proc = train(corpus, tmp_path, plan, 3, "--timeline-trace", str(trace))
    close(got, reference_16)
    rows = {e["pid"]: e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"]
            if e.get("name") == "process_name"}
    assert rows[0].startswith("pipeline 0 stage 0") and rows[2].startswith("pipeline 1 stage 1")
    assert "timeline pipeline 1 stage 1:" in proc.stdout


def _weights_worker(rank: int, world: int, argv: list[str]) -> dict:
    """Train in this process (one rank of the job), then every weight whole (gathered over
    TP), keyed by name: what this rank's pipeline holds."""
    from megatron_h2.distributed.topology import LaunchEnv
    from megatron_h2.parallel.sharding import gather_tp_tensor, get_tp_shard
    from megatron_h2.training import build_run, config_from_args, train

    cfg, launch = config_from_args(argv)
    run = build_run(cfg, launch, LaunchEnv(rank, world, rank))
    try:
        train(run)
    finally:
        run.close()
    tp = run.ckpt.tp
    out = {}
    for name, param in run.model.named_parameters():
        spec = get_tp_shard(param)
        whole = param.detach() if spec is None else gather_tp_tensor(param, spec, tp)
        out[name] = whole.numpy().copy()
    return {"pipeline": run.topo.pipeline, "weights": out}


@pytest.mark.e2e
def test_the_pipelines_weights_stay_bitwise_equal(corpus, tmp_path):
    """TP 1 against TP 2 over two stages, ZeRO-1, SwiGLU and RMSNorm (fused and replicated
    parameters): after 6 updates every weight of pipeline 1 equals pipeline 0's bit for bit."""
    from tests.helpers.dist_utils import run_distributed

    plan = write_plan(tmp_path / "plan.yaml", 8,
                      pipeline(4, stage("fast", 1, 4)),
                      pipeline(4, stage("fast", 2, 1), stage("slow", 2, 3)))
    argv = [*tiny_model_flags(train_iters=6), "--data-path", corpus, "--hetero-plan", plan,
            "--swiglu", "--normalization", "RMSNorm", "--use-distributed-optimizer",
            "--data-cache-path", str(tmp_path / "cache")]
    runs = run_distributed(_weights_worker, 5, argv, timeout=300)
    first = runs[0]["weights"]
    second = {k: v for r in runs if r["pipeline"] == 1 for k, v in r["weights"].items()}
    for name, value in first.items():
        assert (second[name] == value).all(), name
