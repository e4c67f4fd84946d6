"""Expert parallelism with multi-rank runs (gloo, CPU) against one process.

The two MoE command lines of tests/e2e/test_moe_training.py (Mixtral-like: softmax top-2, aux and
z losses, shared experts, a dense first layer, biases; DeepSeek-V3-like: sigmoid scores, expert
bias, sequence aux loss, capacity 1.0 with token dropping by position) under
``--expert-model-parallel-size`` (tokens all-to-all, experts split over EP ranks, expert
gradients summed over expert DP) and ``--expert-tensor-parallel-size`` (each expert split over
an expert-TP group of its own, the routed rows all-gathered over it and the outputs
reduce-scattered back): 10 iterations must reproduce the single-process losses, aux / z losses
and tokens per expert (so the same tokens are dropped) within 1e-5 relative.

Cost: the one-process references are computed once per module and every run in this process
(references and resumes) uses one thread, as each rank of a run does (two threads per process
on a shared machine spend most of a step waiting for each other).
"""

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from safetensors import safe_open

from megatron_h2.training.main import main
from tests.e2e.test_moe_training import ARCHS, assert_same_run, moe_references, records
from tests.helpers.fork_run import fork_run
from tests.unit.training.test_parallel_training import MODEL

EP2 = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]


@contextmanager
def one_thread() -> Iterator[None]:
    """Runs in this process on one intra-op thread (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory) -> dict[str, dict[int, dict]]:
    with one_thread():
        return moe_references(corpus, tmp_path_factory)


def check(name: str, got: dict[int, dict], want: dict[int, dict], norms: bool = False) -> None:
    """:func:`assert_same_run`, printing the largest deviations from the reference first;
    ``norms``: the gradient and parameter norms too (each shard counted once), within 1e-5
    relative."""
    common = [it for it in want if it in got]
    loss = max((abs(got[it]["lm_loss"] - want[it]["lm_loss"]) for it in common), default=0.0)
    aux = max((abs(got[it]["moe_losses"].get(k, float("inf")) - v) for it in common
               for k, v in want[it]["moe_losses"].items()), default=0.0)
    print(f"{name}: max |loss - reference| {loss:.3g}, max |aux loss - reference| {aux:.3g} "
          f"over iterations {min(want)}-{max(want)}")
    assert_same_run(got, want)
    for it, ref in want.items() if norms else ():
        for key in ("grad_norm", "params_norm"):
            assert abs(got[it][key] - ref[key]) <= 1e-5 * ref[key], (name, it, key)


def run(nproc: int, arch: str, corpus: str, out, *flags: str):
    proc = fork_run(nproc, [*MODEL, *ARCHS[arch], "--data-path", corpus, "--log-jsonl",
                            str(out), *flags], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_ep2_matches_single_process(corpus, references, tmp_path):
    """EP 2 over the two DP replicas: each rank holds two of the four experts (the DeepSeek-like
    line runs under EP 2 with ZeRO-1 below)."""
    proc = run(2, "mixtral", corpus, tmp_path / "log.jsonl", *EP2)
    assert "stage 0: chip default (cpu) | TP 1 | EP 2 (expert TP 1) |" in proc.stdout
    check("EP 2 (mixtral)", records(tmp_path / "log.jsonl"), references["mixtral"])


def test_zero1_with_ep2_and_its_checkpoint_resumes_under_ep1_and_ep4(corpus, references, tmp_path):
    """EP 2 with token dropping, ZeRO-1 over the DP group (dense) and the expert-DP group
    (experts); the checkpoint of iteration 5 (each EP rank's experts in a part of its own, keyed
    by global expert index) resumes in one process (EP 1) and under EP 4 with the uninterrupted
    losses."""
    ckpt = tmp_path / "ckpt"
    run(2, "deepseek", corpus, tmp_path / "a.jsonl", *EP2, "--use-distributed-optimizer",
        "--save", str(ckpt), "--save-interval", "5")
    check("EP 2 + ZeRO-1 (deepseek)", records(tmp_path / "a.jsonl"), references["deepseek"])
    stored = {}
    for part in ("model_00000", "model_01000"):
        with safe_open(str(ckpt / "iter_0000005" / f"{part}.safetensors"), "pt") as f:
            stored[part] = {k for k in f.keys() if ".local_experts." in k}
    assert {k.split(".local_experts.")[1][0] for k in stored["model_00000"]} == {"0", "1"}
    assert {k.split(".local_experts.")[1][0] for k in stored["model_01000"]} == {"2", "3"}
    with one_thread():
        assert main([*MODEL, *ARCHS["deepseek"], "--data-path", corpus, "--load", str(ckpt),
                     "--ckpt-step", "5", "--log-jsonl", str(tmp_path / "b.jsonl")]) == 0
    want = {k: v for k, v in references["deepseek"].items() if k > 5}
    check("EP 2 checkpoint resumed under EP 1", records(tmp_path / "b.jsonl"), want)
    # and under EP 4 (DP 4, one expert per rank, the replicated optimizer)
    run(4, "deepseek", corpus, tmp_path / "c.jsonl", "--expert-model-parallel-size", "4",
        "--load", str(ckpt), "--ckpt-step", "5")
    check("EP 2 checkpoint resumed under EP 4", records(tmp_path / "c.jsonl"), want)


def test_etp2_and_its_checkpoint_resumes_under_etp1(corpus, references, tmp_path):
    """ETP 2 on a stage of TP 1 (DP 4, EP 1; expert-TP groups [0, 1], [2, 3]): each rank holds
    half of every expert (linear_fc1 by columns, linear_fc2 by rows), two replicas' routed rows
    are all-gathered and the partial outputs reduce-scattered back; ZeRO-1 over DP (dense) and
    over the expert-DP groups [0, 2], [1, 3] (each expert shard's state split in two). The
    checkpoint of iteration 5 holds each expert whole under its global name and resumes in one
    process (ETP 1, EP 1) with the uninterrupted losses."""
    ckpt = tmp_path / "ckpt"
    proc = run(4, "mixtral", corpus, tmp_path / "a.jsonl", "--expert-tensor-parallel-size", "2",
               "--use-distributed-optimizer", "--save", str(ckpt), "--save-interval", "5")
    assert "stage 0: chip default (cpu) | TP 1 | EP 1 (expert TP 2) |" in proc.stdout
    check("ETP 2 (mixtral)", records(tmp_path / "a.jsonl"), references["mixtral"], norms=True)
    with safe_open(str(ckpt / "iter_0000005" / "model_00000.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()
                  if ".local_experts." in k}
    expert = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc{}.weight"
    for e in range(4):  # whole: [moe ffn, hidden] and [hidden, moe ffn]
        assert shapes[expert.format(e, 1)] == (64, 64) and shapes[expert.format(e, 2)] == (64, 64)
    with one_thread():
        assert main([*MODEL, *ARCHS["mixtral"], "--data-path", corpus, "--load", str(ckpt),
                     "--ckpt-step", "5", "--log-jsonl", str(tmp_path / "b.jsonl")]) == 0
    want = {k: v for k, v in references["mixtral"].items() if k > 5}
    check("ETP 2 checkpoint resumed under ETP 1", records(tmp_path / "b.jsonl"), want)


def test_ep2_times_etp2(corpus, references, tmp_path):
    """EP 2 x ETP 2 on four ranks of TP 1 (expert TP groups [0, 1], [2, 3]; EP groups [0, 2],
    [1, 3]), token dropping and Megatron's allgather dispatcher: each rank gathers its EP
    group's tokens, then its expert-TP group's rows for its two experts."""
    proc = run(4, "deepseek", corpus, tmp_path / "log.jsonl", "--expert-model-parallel-size",
               "2", "--expert-tensor-parallel-size", "2", "--moe-token-dispatcher-type",
               "allgather")
    assert "stage 0: chip default (cpu) | TP 1 | EP 2 (expert TP 2) |" in proc.stdout
    check("EP 2 x ETP 2 (deepseek)", records(tmp_path / "log.jsonl"), references["deepseek"],
          norms=True)


def test_tp2_with_etp1_and_ep2(corpus, references, tmp_path):
    """TP 2 with --sequence-parallel and the experts whole on every rank (ETP 1, EP 2 on four
    ranks: the EP groups are the TP groups): each TP rank dispatches its half of the routed
    tokens and the outputs are gathered over TP; the checkpoint holds EP rank 1's experts in a
    part of its own, written by TP rank 1."""
    ckpt = tmp_path / "ckpt"
    proc = run(4, "mixtral", corpus, tmp_path / "log.jsonl", "--tensor-model-parallel-size",
               "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1", *EP2,
               "--save", str(ckpt), "--save-interval", "10")
    assert "stage 0: chip default (cpu) | TP 2 | EP 2 (expert TP 1) |" in proc.stdout
    check("TP 2 + SP x ETP 1 x EP 2 (mixtral)", records(tmp_path / "log.jsonl"),
          references["mixtral"], norms=True)
    for part, experts in (("model_00000", {"0", "1"}), ("model_01000", {"2", "3"})):
        with safe_open(str(ckpt / "iter_0000010" / f"{part}.safetensors"), "pt") as f:
            assert {k.split(".local_experts.")[1][0] for k in f.keys()
                    if ".local_experts." in k} == experts


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
    check(f"EP 2 x TP 2 + SP ({arch}, {dispatcher})", records(tmp_path / "log.jsonl"),
          references[arch])


def test_tp2_with_sequence_parallelism(corpus, references, tmp_path):
    """MoE layers under TP 2 with --sequence-parallel, no expert parallelism (two ranks)."""
    run(2, "deepseek", corpus, tmp_path / "log.jsonl", "--tensor-model-parallel-size", "2",
        "--sequence-parallel")
    check("TP 2 + SP (deepseek)", records(tmp_path / "log.jsonl"), references["deepseek"])


def test_ep2_with_interleaved_pp2(corpus, references, tmp_path):
    """EP 2 on each of two pipeline stages (DP 2 each), two model chunks per stage, with
    Megatron's default allgather dispatcher: the MoE layers of every chunk gather the other
    replica's tokens in schedule order and sum the partial outputs back."""
    proc = run(4, "mixtral", corpus, tmp_path / "log.jsonl", "--expert-model-parallel-size",
               "2", "--pipeline-model-parallel-size", "2",
               "--virtual-pipeline-model-parallel-size", "2")
    assert "stage 1: chip default (cpu) | TP 1 | EP 2 (expert TP 1) |" in proc.stdout
    check("EP 2 x PP 2 interleaved (mixtral)", records(tmp_path / "log.jsonl"),
          references["mixtral"])


def test_two_chip_types_with_their_own_ep_and_etp(corpus, references, tmp_path):
    """A heterogeneous plan through the bridge: one MoE layer on chip type 'fast' with DP 2 and
    EP 2 (each rank two experts), three on 'slow' with TP 2, DP 1, EP 1 and ETP 1 (all four
    experts whole on both ranks, each dispatching half the tokens; their gradients summed over
    the two ranks)."""
    from tests.unit.pipeline.test_hetero_pp import write_plan

    plan = write_plan(tmp_path / "plan.yaml",
                      [{"chip": "fast", "tensor_parallel_size": 1, "num_layers": 1,
                        "data_parallel_size": 2, "expert_model_parallel_size": 2},
                       {"chip": "slow", "tensor_parallel_size": 2, "num_layers": 3,
                        "expert_tensor_parallel_size": 1}])
    proc = run(4, "deepseek", corpus, tmp_path / "log.jsonl", "--hetero-plan", plan,
               "--force-bridge", "--moe-token-dispatcher-type", "alltoall")
    assert "DP 2 | EP 2 (expert TP 1) | layers 0-0" in proc.stdout
    assert "TP 2 | DP 1 | EP 1 (expert TP 1) | layers 1-3" in proc.stdout
    check("two chip types, EP 2 / TP 2 x ETP 1 (deepseek)", records(tmp_path / "log.jsonl"),
          references["deepseek"], norms=True)
