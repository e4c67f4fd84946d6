"""Interleaved (virtual-stage) 1F1B and zero-bubble schedules in real torchrun launches (gloo,
CPU), uniform and heterogeneous, against one process; checkpoints across virtual layouts; bad
input as one line before any process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from megatron_h2.training.main import main
from tests.helpers.dist_utils import assert_losses_close as close
from tests.helpers.dist_utils import losses, run_distributed, torchrun

# 8 layers: 2 chunks x 2 stages, 2 chunks x 3 stages (uneven) and 4 stages all divide them;
# 12 samples of micro-batch 2 = 6 micro-batches, a multiple of 2 and 3 (interleaved needs it)
MODEL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
         "--hidden-dropout", "0", "--attention-dropout", "0",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32",
         "--max-position-embeddings", "32", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--seed", "11", "--train-iters", "10", "--log-interval", "1", "--eval-interval",
         "1000", "--eval-iters", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size",
         "256", "--split", "90,10,0"]
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "12"]
HETERO_STAGES = [{"chip": "fast", "tensor_parallel_size": 2, "num_layers": [2, 1]},
                 {"chip": "slow", "tensor_parallel_size": 1, "num_layers": [1, 1]},
                 {"chip": "fast", "tensor_parallel_size": 2, "num_layers": [1, 2],
                  "recompute": "selective"}]


def write_plan(path: Path, stages: list[dict], global_batch: int = 12, **extra) -> str:
    plan = {"data_parallel_size": 1, "micro_batch_size": 2, "global_batch_size": global_batch,
            "chips": {"fast": {"device": "cpu"}, "slow": {"device": "cpu"}}, "stages": stages,
            **extra}
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return str(path)


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
    proc = torchrun(nproc, [*MODEL, *BATCH, "--data-path", corpus, "--log-jsonl", str(out),
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
    proc = torchrun(5, [*MODEL, "--data-path", corpus, "--hetero-plan", plan, "--force-bridge",
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
    third = torchrun(2, [*MODEL, *BATCH, "--data-path", corpus, "--load", str(ckpt2),
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


def _plan_case(tmp_path: Path, case: str) -> tuple[list[str], int]:
    if case == "hetero_micro_batches":  # 3 stages, V = 2, 4 micro-batches
        return ["--hetero-plan", write_plan(tmp_path / "p.yaml", HETERO_STAGES, 8)], 5
    plan = write_plan(tmp_path / "p.yaml", HETERO_STAGES)
    flag = {"hetero_schedule": ["--pipeline-schedule", "zero-bubble"],
            "hetero_v_flag": ["--virtual-pipeline-model-parallel-size", "2"]}[case]
    return ["--hetero-plan", plan, *flag], 5


@pytest.mark.parametrize("world, flags, fragment", [
    (4, ["--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "2",
         "--num-layers", "8"], "(global batch / (micro-batch x DP) = 6) to be a multiple of the "
                               "pipeline size 4"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "3,1/2,1"],
     "--pipeline-layer-split 3,1/2,1 adds up to 7 layers but --num-layers is 8"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "3,1/4"],
     "has 1 counts in chunk 1 but --pipeline-model-parallel-size is 2"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "3,x/2,2"],
     "--pipeline-layer-split expects layer counts per stage separated by ','"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "2,2/0,4"],
     "chunk 1 of stage 0 has no layer"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "2,2/2,2",
         "--virtual-pipeline-model-parallel-size", "3"], "gives 2 model chunks but"),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
     "the 4 layers of each pipeline stage are not divisible by "
     "--num-layers-per-virtual-pipeline-stage 3"),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "7",
         "--num-layers-per-virtual-pipeline-stage", "1"],
     "needs --num-layers 7 divisible by --pipeline-model-parallel-size 2"),
    (2, ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "3"],
     "stage 0 has 4 layers, which do not split into --virtual-pipeline-model-parallel-size 3"),
    (2, ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
         "--num-layers-per-virtual-pipeline-stage", "2"], "give either"),
    (1, ["--virtual-pipeline-model-parallel-size", "2"], "need at least 2 pipeline stages"),
    (2, ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
         "--pipeline-schedule", "1f1b"], "the 1f1b schedule runs one model chunk per stage"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved"],
     "the interleaved schedule needs virtual pipeline stages"),
    (5, "hetero_micro_batches", "(global batch / (micro-batch x DP) = 4) to be a multiple of "
                                "the pipeline size 3"),
    (5, "hetero_schedule", "--pipeline-schedule zero-bubble differs from the plan's schedule "
                           "interleaved"),
    (5, "hetero_v_flag", "--virtual-pipeline-model-parallel-size conflicts with --hetero-plan"),
])
def test_bad_virtual_layout_is_one_line_before_any_process_group(world, flags, fragment, corpus,
                                                                 tmp_path, monkeypatch, capsys):
    if isinstance(flags, str):
        flags, world = _plan_case(tmp_path, flags)
        args = [*MODEL, *flags]
    else:
        args = [*MODEL, *BATCH, *flags]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert main([*args, "--data-path", corpus]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and fragment in err, err
    assert not dist.is_initialized()
