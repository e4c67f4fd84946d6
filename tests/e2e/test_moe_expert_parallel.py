"""Expert parallelism with real torchrun launches (gloo, CPU) against one process.

The two MoE command lines of tests/e2e/test_moe_training.py (Mixtral-like: softmax top-2, aux and
z losses, shared experts, a dense first layer; DeepSeek-V3-like: sigmoid scores, expert bias,
sequence aux loss, capacity 1.0 with token dropping by position) under
``--expert-model-parallel-size`` (tokens all-to-all, experts split over EP ranks, expert
gradients summed over expert DP): 10 iterations must reproduce the single-process losses, aux /
z losses and tokens per expert (so the same tokens are dropped) within 1e-5 relative.
"""

import pytest
from safetensors import safe_open

from megatron_h2.training.main import main
from tests.e2e.test_moe_training import ARCHS, assert_same_run, moe_references, records
from tests.helpers.dist_utils import torchrun
from tests.unit.training.test_parallel_training import MODEL

EP2 = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory) -> dict[str, dict[int, dict]]:
    return moe_references(corpus, tmp_path_factory)


def run(nproc: int, arch: str, corpus: str, out, *flags: str):
    proc = torchrun(nproc, [*MODEL, *ARCHS[arch], "--data-path", corpus, "--log-jsonl",
                            str(out), *flags], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("arch", list(ARCHS))
def test_ep2_matches_single_process(arch, corpus, references, tmp_path):
    """EP 2 over the two DP replicas: each rank holds two of the four experts."""
    proc = run(2, arch, corpus, tmp_path / "log.jsonl", *EP2)
    assert "stage 0: chip default (cpu) | TP 1 | EP 2 (expert TP 1) |" in proc.stdout
    assert_same_run(records(tmp_path / "log.jsonl"), references[arch])


def test_zero1_with_ep2_and_its_checkpoint_resumes_under_ep1_and_ep4(corpus, references, tmp_path):
    """ZeRO-1 over the DP group (dense) and the expert-DP group (experts) under EP 2; the
    checkpoint of iteration 5 (each EP rank's experts in a part of its own, keyed by global
    expert index) resumes in one process (EP 1) and under EP 4 with the uninterrupted
    losses."""
    ckpt = tmp_path / "ckpt"
    run(2, "deepseek", corpus, tmp_path / "a.jsonl", *EP2, "--use-distributed-optimizer",
        "--save", str(ckpt), "--save-interval", "5")
    assert_same_run(records(tmp_path / "a.jsonl"), references["deepseek"])
    stored = {}
    for part in ("model_00000", "model_01000"):
        with safe_open(str(ckpt / "iter_0000005" / f"{part}.safetensors"), "pt") as f:
            stored[part] = {k for k in f.keys() if ".local_experts." in k}
    assert {k.split(".local_experts.")[1][0] for k in stored["model_00000"]} == {"0", "1"}
    assert {k.split(".local_experts.")[1][0] for k in stored["model_01000"]} == {"2", "3"}
    assert main([*MODEL, *ARCHS["deepseek"], "--data-path", corpus, "--load", str(ckpt),
                 "--ckpt-step", "5", "--log-jsonl", str(tmp_path / "b.jsonl")]) == 0
    want = {k: v for k, v in references["deepseek"].items() if k > 5}
    assert_same_run(records(tmp_path / "b.jsonl"), want)
    # and under EP 4 (DP 4, one expert per rank, the replicated optimizer)
    run(4, "deepseek", corpus, tmp_path / "c.jsonl", "--expert-model-parallel-size", "4",
        "--load", str(ckpt), "--ckpt-step", "5")
    assert_same_run(records(tmp_path / "c.jsonl"), want)


@pytest.mark.parametrize("arch,dispatcher", [("mixtral", "alltoall"), ("deepseek", "allgather")])
def test_ep2_tp2_with_sequence_parallelism(arch, dispatcher, corpus, references, tmp_path):
    """EP 2 x TP 2 with --sequence-parallel (four ranks: DP 2, TP 2): each MoE block gathers
    its TP group's sequence chunks, routes, dispatches over EP and keeps its own chunk of the
    output; losses, aux / z losses and tokens per expert (token dropping included) as in one
    process."""
    proc = run(4, arch, corpus, tmp_path / "log.jsonl", "--expert-model-parallel-size", "2",
               "--moe-token-dispatcher-type", dispatcher, "--tensor-model-parallel-size", "2",
               "--sequence-parallel")
    assert "stage 0: chip default (cpu) | TP 2 | EP 2 (expert TP 2) |" in proc.stdout
    assert_same_run(records(tmp_path / "log.jsonl"), references[arch])


def test_tp2_with_sequence_parallelism(corpus, references, tmp_path):
    """MoE layers under TP 2 with --sequence-parallel, no expert parallelism (two ranks)."""
    run(2, "deepseek", corpus, tmp_path / "log.jsonl", "--tensor-model-parallel-size", "2",
        "--sequence-parallel")
    assert_same_run(records(tmp_path / "log.jsonl"), references["deepseek"])


def test_ep2_with_interleaved_pp2(corpus, references, tmp_path):
    """EP 2 on each of two pipeline stages (DP 2 each), two model chunks per stage, with
    Megatron's default allgather dispatcher: the MoE layers of every chunk gather the other
    replica's tokens in schedule order and sum the partial outputs back."""
    proc = run(4, "mixtral", corpus, tmp_path / "log.jsonl", "--expert-model-parallel-size",
               "2", "--pipeline-model-parallel-size", "2",
               "--virtual-pipeline-model-parallel-size", "2")
    assert "stage 1: chip default (cpu) | TP 1 | EP 2 (expert TP 1) |" in proc.stdout
    assert_same_run(records(tmp_path / "log.jsonl"), references["mixtral"])


def test_two_chip_types_with_their_own_ep(corpus, references, tmp_path):
    """A heterogeneous plan through the bridge: one MoE layer on chip type 'fast' with DP 2 and
    EP 2 (each rank two experts), three on 'slow' with DP 1 and EP 1 (all four experts)."""
    from tests.unit.pipeline.test_hetero_pp import write_plan

    plan = write_plan(tmp_path / "plan.yaml",
                      [{"chip": "fast", "tensor_parallel_size": 1, "num_layers": 1,
                        "data_parallel_size": 2, "expert_model_parallel_size": 2},
                       {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 3}])
    proc = run(3, "deepseek", corpus, tmp_path / "log.jsonl", "--hetero-plan", plan,
               "--force-bridge", "--moe-token-dispatcher-type", "alltoall")
    assert "DP 2 | EP 2 (expert TP 1) | layers 0-0" in proc.stdout
    assert_same_run(records(tmp_path / "log.jsonl"), references["deepseek"])
