"""Per-stage data parallelism across processes: stages with different DP (and TP) degrees.

Multi-process tests check the tied embedding's exact sum; multi-rank runs (gloo, CPU)
compare 10 iterations with one process, one shared reference run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec
from megatron_h2.training.main import main
from tests.helpers.dist_utils import assert_losses_close as close
from tests.helpers.dist_utils import losses, run_distributed
from tests.helpers.fork_run import fork_run
from tests.unit.distributed.test_stage_data_parallel import MODEL, dp_2_1, write_plan

# ------------------------------------------------------------------ tied embedding sum
TIED_CASES = ((False, torch.float32), (True, torch.float32), (False, torch.bfloat16),
              (True, torch.bfloat16))  # (ZeRO-1, the weight's dtype); buckets always fp32


def _tied_worker(rank: int, world: int) -> list[dict]:
    """DP 2 x TP 1 first stage (ranks 0, 1), DP 1 x TP 2 last stage (ranks 2, 3): each rank's
    tied-weight gradient is a known tensor; after the DP sums and the exchange every copy must
    be the sum over all four ranks, bitwise equal on both ends (replicated and ZeRO-1; fp32
    weights, and bf16 weights whose gradients accumulate in the fp32 buckets' main_grad)."""
    from megatron_h2.distributed.grad_sync import GradBuckets
    from megatron_h2.distributed.tied_embedding import TiedEmbeddingSync
    from megatron_h2.distributed.topology import build_topology

    vocab, hidden = 8, 3
    plan = HeteroPlan(data_parallel_size=1, micro_batch_size=1, global_batch_size=4,
                      chips={"c": ChipSpec(device="cpu")},
                      stages=[StageSpec("c", 1, 1, data_parallel_size=2),
                              StageSpec("c", 2, 1)])
    topo = build_topology(plan, rank, world)
    rows = vocab // topo.tp_size
    full = torch.arange(vocab * hidden, dtype=torch.float32).view(vocab, hidden) / 7
    start = topo.tp_rank * rows
    out = []
    for sharded, dtype in TIED_CASES:
        weight = torch.nn.Parameter(torch.zeros(rows, hidden, dtype=dtype))
        other = torch.nn.Parameter(torch.zeros(2, dtype=dtype))
        buckets = GradBuckets([other, weight], topo.dp_group, reduce_scatter=sharded,
                              deferred=[weight], grad_dtype=torch.float32)
        upstream = (full[start:start + rows] * (rank + 1) + 0.1 * rank).to(dtype)
        (weight * upstream).sum().backward()
        (other * 1.0).sum().backward()
        buckets.finish_sync(combine=TiedEmbeddingSync(topo, weight, vocab).sum_grads)
        bucket = buckets.buckets[-1]
        shard = None if bucket.shard_grad is None else bucket.shard_grad.numpy().copy()
        out.append({"grad": weight.main_grad.numpy().copy(), "rows": (start, start + rows),
                    "shard": shard, "shard_range": bucket.shard_range(buckets.dp_rank),
                    "freed": weight.grad is None})
    return out  # numpy arrays: pickled by value


@pytest.mark.e2e
def test_tied_embedding_sum_is_exact_across_dp_and_tp():
    runs = run_distributed(_tied_worker, 4)
    vocab, hidden = 8, 3
    full = torch.arange(vocab * hidden, dtype=torch.float32).view(vocab, hidden) / 7
    for case, (sharded, dtype) in enumerate(TIED_CASES):
        # each rank's gradient is its upstream in the weight's dtype; summed in fp32
        part = [(full * (r + 1) + 0.1 * r).to(dtype).float() for r in range(4)]
        # each row: both first-stage replicas (ranks 0, 1 hold every row) and the one
        # last-stage TP rank holding it (rank 2: rows 0-3, rank 3: rows 4-7)
        want = part[0] + part[1] + torch.cat([part[2][:4], part[3][4:]])
        results = [{k: torch.from_numpy(v) if k in ("grad", "shard") and v is not None else v
                    for k, v in per_rank[case].items()} for per_rank in runs]
        for res in results:
            lo, hi = res["rows"]
            torch.testing.assert_close(res["grad"], want[lo:hi], rtol=1e-6, atol=1e-6)
            # bf16 weights: the gradient lives in main_grad only (autograd's .grad freed)
            assert res["freed"] == (dtype != torch.float32)
            if sharded:  # the optimizer's shard is taken after the sum across the ends
                s0, s1 = res["shard_range"]
                flat = torch.cat([res["grad"].reshape(-1), torch.zeros(s1)])[s0:s1]
                assert torch.equal(res["shard"], flat)
        last = torch.cat([res["grad"] for res in results[2:]])
        for first in results[:2]:  # the copies stay bitwise equal
            assert torch.equal(first["grad"], last)


# ---------------------------------------------------------------- real training runs
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "8"]  # 4 micro-batches


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("ref") / "log.jsonl"
    assert main([*MODEL, *BATCH, "--data-path", corpus, "--log-jsonl", str(out)]) == 0
    return losses(out)


@pytest.mark.e2e
def test_dp_2_1_matches_one_process_and_resumes_uniform(corpus, reference, tmp_path):
    """DP 2 / 1 with TP 1 / 2 (the tied embedding summed across both), traced per rank; its
    checkpoint resumes in one process with the uninterrupted losses."""
    plan = write_plan(tmp_path / "plan.yaml", dp_2_1())
    out, trace, ckpt = tmp_path / "a.jsonl", tmp_path / "trace.json", tmp_path / "ckpt"
    proc = fork_run(4, [*MODEL, "--data-path", corpus, "--hetero-plan", plan,
                        "--log-jsonl", str(out), "--timeline-trace", str(trace),
                        "--save", str(ckpt), "--save-interval", "5"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    close(losses(out), reference)
    assert "DP 2/1 per stage" in proc.stdout and "2/4 micro-batches per replica" in proc.stdout
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert {e["tid"] for e in spans} == {0, 1, 2, 3}
    first = min(e["args"]["iteration"] for e in spans)
    forwards = {rank: sorted(e["args"]["micro_batch"] for e in spans if e["tid"] == rank
                             and e["cat"] == "forward" and e["args"]["iteration"] == first)
                for rank in range(4)}
    assert forwards[0] == [0, 2] and forwards[1] == [1, 3] and forwards[2] == [0, 1, 2, 3]
    assert main([*MODEL, *BATCH, "--data-path", corpus, "--load", str(ckpt), "--ckpt-step", "5",
                 "--log-jsonl", str(tmp_path / "b.jsonl")]) == 0
    close(losses(tmp_path / "b.jsonl"), {k: v for k, v in reference.items() if k > 5})


THREE = [{"chip": "fast", "tensor_parallel_size": 2, "num_layers": 1},
         {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 2, "data_parallel_size": 2,
          "recompute": "full"},
         {"chip": "fast", "tensor_parallel_size": 1, "num_layers": 1}]

RUNS = {  # name: (processes, stages, plan extras, flags)
    # DP 1 / 2 / 1 with TP 2 / 1 / 1, sequence parallel, zero-bubble
    "dp_1_2_1_zero_bubble_sp": (5, THREE, {"schedule": "zero-bubble"}, ["--sequence-parallel"]),
    # ZeRO-1 within each stage's DP group, gradient buckets reduced during backward
    "dp_2_1_zero1": (4, dp_2_1(), {}, ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                       "--ddp-bucket-size", "20000"]),
    # interleaved, two chunks per stage, every boundary (wrap-around included) on the bridge
    "dp_2_1_interleaved_bridge": (4, dp_2_1([1, 1]), {}, ["--force-bridge"]),
}


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(RUNS))
def test_per_stage_dp_matches_one_process(name, corpus, reference, tmp_path):
    nproc, stages, extra, flags = RUNS[name]
    plan = write_plan(tmp_path / "plan.yaml", stages, **extra)
    out = tmp_path / "log.jsonl"
    proc = fork_run(nproc, [*MODEL, "--data-path", corpus, "--hetero-plan", plan,
                            "--log-jsonl", str(out), *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    close(losses(out), reference)
    if "bridge" in name:
        assert "bridge 0.00 MiB/it" not in proc.stdout


NORMS = ["--log-params-norm"]


@pytest.fixture(scope="module")
def bf16_reference(corpus, tmp_path_factory) -> dict[int, tuple[float, float]]:
    out = tmp_path_factory.mktemp("ref_bf16") / "log.jsonl"
    assert main([*MODEL, *BATCH, *NORMS, "--bf16", "--data-path", corpus,
                 "--log-jsonl", str(out)]) == 0
    return loss_and_norm(out)


def loss_and_norm(path: Path) -> dict[int, tuple[float, float]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["iteration"]: (r["lm_loss"], r["params_norm"]) for r in rows if "lm_loss" in r}


@pytest.mark.e2e
def test_per_stage_dp_with_bf16_matches_one_process(corpus, reference, bf16_reference,
                                                    tmp_path):
    """--bf16 with DP 2 / 1 and TP 1 / 2: the tied embedding's fp32 main_grad (bf16 weights)
    summed over stage 0's replicas and then across the ends, ZeRO-1 within stage 0 with its
    fp32 master shards and the all-gather of the rounded bf16 weights during the next forward
    (--overlap-param-gather). Losses and --log-params-norm (the fp32 main weights, each counted
    once although the stages have different DP degrees) within bf16's tolerance of one process
    with --bf16 (see test_bf16_layouts); losses not the fp32 ones."""
    plan = write_plan(tmp_path / "plan.yaml", dp_2_1())
    out = tmp_path / "log.jsonl"
    proc = fork_run(4, [*MODEL, *NORMS, "--data-path", corpus, "--hetero-plan", plan, "--bf16",
                        "--use-distributed-optimizer", "--overlap-grad-reduce",
                        "--overlap-param-gather", "--log-jsonl", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = loss_and_norm(out)
    assert sorted(got) == sorted(bf16_reference)
    for it, want in bf16_reference.items():
        for what in (0, 1):
            assert abs(got[it][what] - want[what]) <= 2e-4 * want[what], (it, got[it], want)
    assert max(abs(got[it][0] - reference[it]) / reference[it] for it in got) > 1e-5
