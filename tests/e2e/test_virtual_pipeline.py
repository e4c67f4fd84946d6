"""Interleaved (virtual-stage) 1F1B and zero-bubble schedules in multi-rank runs (gloo,
CPU), uniform and heterogeneous, against one process; gradient buckets armed per chunk;
checkpoints across virtual layouts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from megatron_h2.training.main import main
from tests.helpers.dist_utils import assert_losses_close as close
from tests.helpers.dist_utils import losses, run_distributed
from tests.helpers.fork_run import fork_run
from tests.unit.pipeline.test_virtual_pipeline import BATCH, HETERO_STAGES, MODEL, write_plan


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("ref") / "log.jsonl"
    assert main([*MODEL, *BATCH, "--data-path", corpus, "--log-jsonl", str(out)]) == 0
    return losses(out)


LAYOUTS = {  # name: (processes, flags)
    "pp2_v2": (2, ["--pipeline-model-parallel-size", "2",
                   "--virtual-pipeline-model-parallel-size", "2"]),
    # uneven chunks (stage 0: 3 + 2 layers, stage 1: 1 + 2) under interleaved zero-bubble
    "pp2_v2_uneven_zero_bubble": (2, ["--pipeline-model-parallel-size", "2",
                                      "--pipeline-layer-split", "3,1/2,2",
                                      "--pipeline-schedule", "zero-bubble"]),
    "tp2_pp2_v2_sp": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                          "2", "--num-layers-per-virtual-pipeline-stage", "2",
                          "--sequence-parallel"]),
    # DP 2: weight gradients of W passes feed small ZeRO-1 buckets armed per chunk
    "zero_bubble_pp2_dp2": (4, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                "zero-bubble", "--ddp-bucket-size", "13107",
                                "--overlap-grad-reduce", "--use-distributed-optimizer"]),
    "zero_bubble_pp4": (4, ["--pipeline-model-parallel-size", "4", "--pipeline-schedule",
                            "zero-bubble"]),
}


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_schedule_matches_single_process(name, corpus, reference, tmp_path):
    nproc, flags = LAYOUTS[name]
    out, trace = tmp_path / "log.jsonl", tmp_path / "trace.json"
    extra = ["--timeline-trace", str(trace)] if name.startswith("pp2_v2_uneven") else []
    proc = fork_run(nproc, [*MODEL, *BATCH, "--data-path", corpus, "--log-jsonl", str(out),
                            *flags, *extra])
    assert proc.returncode == 0, proc.stderr[-3000:]
    close(losses(out), reference)
    if extra:
        spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
        compute = {(e["cat"], e["args"]["chunk"]) for e in spans
                   if e["cat"].startswith(("forward", "backward"))}
        assert compute == {(k, c) for k in ("forward", "backward_input", "backward_weight")
                           for c in (0, 1)}
        assert any(e["name"] == "W5 c1" for e in spans)


@pytest.mark.e2e
def test_heterogeneous_virtual_stages_through_the_bridge_and_checkpoints(corpus, reference,
                                                                          tmp_path):
    """3 stages (TP 2 / 1 / 2) with 2 chunks each, every boundary (the wrap-around one
    included) through the bridge; its checkpoint resumes in one process (V = 1), whose own
    checkpoint resumes under PP 2 x V 2: all with the uninterrupted losses."""
    plan = write_plan(tmp_path / "plan.yaml", HETERO_STAGES)
    ckpt, ckpt2 = tmp_path / "ckpt", tmp_path / "ckpt2"
    proc = fork_run(5, [*MODEL, "--data-path", corpus, "--hetero-plan", plan, "--force-bridge",
                        "--save", str(ckpt), "--save-interval", "5",
                        "--log-jsonl", str(tmp_path / "a.jsonl")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "schedule interleaved" in proc.stdout and "layers 0-1, 4-4" in proc.stdout
    assert "bridge 0.00 MiB/it" not in proc.stdout
    close(losses(tmp_path / "a.jsonl"), reference)
    assert main([*MODEL, *BATCH, "--data-path", corpus, "--load", str(ckpt), "--ckpt-step", "5",
                 "--save", str(ckpt2), "--save-interval", "7",
                 "--log-jsonl", str(tmp_path / "b.jsonl")]) == 0
    close(losses(tmp_path / "b.jsonl"), {k: v for k, v in reference.items() if k > 5})
    third = fork_run(2, [*MODEL, *BATCH, "--data-path", corpus, "--load", str(ckpt2),
                         "--ckpt-step", "7", "--pipeline-model-parallel-size", "2",
                         "--virtual-pipeline-model-parallel-size", "2",
                         "--log-jsonl", str(tmp_path / "c.jsonl")])
    assert third.returncode == 0, third.stderr[-3000:]
    close(losses(tmp_path / "c.jsonl"), {k: v for k, v in reference.items() if k > 7})


def _arming_worker(rank: int, world: int) -> dict:
    """Two 'chunks' of parameters in shared buckets; chunk 1's last backward runs before
    chunk 0's, as in an interleaved schedule's cool-down."""
    from megatron_h2.distributed.grad_sync import GradBuckets

    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(64)) for _ in range(4)]  # chunk 0
    b = [torch.nn.Parameter(torch.randn(64)) for _ in range(4)]  # chunk 1
    buckets = GradBuckets(a + b, dist.group.WORLD, bucket_size_mb=600 / 2**20)
    launched = []

    def backward(params, scale):
        sum((p * scale * (rank + 1)).sum() for p in params).backward()
        launched.append(sum(bk.launched for bk in buckets.buckets))

    backward(a, 1.0)
    backward(b, 1.0)
    buckets.start_sync(b)
    backward(b, 2.0)  # chunk 1's last backward: only its own buckets may launch
    buckets.start_sync(a)
    backward(a, 2.0)  # chunk 0's last backward: the rest
    buckets.finish_sync()
    return {"launched": launched, "grads": [p.grad.tolist()[:2] for p in a + b],
            "buckets": [[id(s.param) in {id(p) for p in b} for s in bk.slots]
                        for bk in buckets.buckets]}


@pytest.mark.e2e
def test_buckets_armed_per_chunk_launch_during_each_chunks_last_backward():
    results = run_distributed(_arming_worker, 2)
    r = results[0]
    only_b = sum(all(bk) for bk in r["buckets"])
    assert 0 < only_b < len(r["buckets"])  # some buckets hold chunk 1 alone, others not
    assert r["launched"] == [0, 0, only_b, len(r["buckets"])]
    # summed over both ranks: (1 + 2) x (1 + 2) for every element
    assert all(g == pytest.approx(9.0) for grads in r["grads"] for g in grads)
