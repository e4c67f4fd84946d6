"""--bf16 (bf16 weights, fp32 main weights and gradients) under TP / PP / DP, with multi-rank
runs (gloo, CPU), against one process with --bf16; bf16 checkpoints move between layouts and
load under fp32.

Tolerance 2e-4 relative, not fp32's 1e-5, and not bitwise: a layout changes the order of fp32
sums (DP gradient sums, TP partial products reduced in bf16, the tied embedding's gradient summed
over two stages instead of inside autograd), and bf16 weights turn those last-bit differences of
the fp32 main weights into occasional one-ulp flips of bf16 weights (2^-8 relative), which then
random-walk the losses. Measured over these 10 iterations: at most 9.5e-5 relative for every
layout tried (TP 2, PP 2, DP 2, ZeRO, TP 2 x PP 2, TP 2 x DP 2 with ZeRO and sequence
parallelism, PP 2 x DP 2 with overlap, bf16 gradient reduction; again for the layouts below,
with --overlap-param-gather among them), and at most 3.2e-6 for the params norm (the fp32 main
weights). Real faults are far outside:
the distributed optimizer refreshing its master shard from the bf16 weights (losing the fp32
main weights) drifts to 6.8e-4 by iteration 10, DP without the gradient sum to 3e-2.
"""

import pytest

from megatron_h2.training.main import main
from tests.e2e.test_parallel_training import _reference, figures
from tests.helpers.fork_run import fork_run
from tests.unit.training.test_parallel_training import MODEL

REL = 2e-4


def assert_bf16_close(got: dict[int, tuple], want: dict[int, tuple], fp32: dict[int, tuple],
                      first: int = 1) -> None:
    """Figures (:func:`figures`: loss, params norm, zeros) within REL of the bf16 reference,
    losses and params norms (--log-params-norm: the norm of the fp32 main weights, counted once
    over the layout), and losses not the fp32 ones (so it really ran in bf16)."""
    want = {k: v for k, v in want.items() if k >= first}
    assert sorted(got) == sorted(want)
    for it, value in want.items():
        for what in (0, 1):
            assert abs(got[it][what] - value[what]) <= REL * value[what], (it, got[it], value)
    assert max(abs(got[it][0] - fp32[it][0]) / fp32[it][0] for it in got) > 1e-5


@pytest.fixture(scope="module")
def fp32_reference(corpus, tmp_path_factory) -> dict[int, tuple]:
    return _reference(corpus, tmp_path_factory)


@pytest.fixture(scope="module")
def bf16_reference(corpus, tmp_path_factory) -> dict[int, tuple]:
    return _reference(corpus, tmp_path_factory, "--bf16")


@pytest.fixture(scope="module")
def bf16_reduce_reference(corpus, tmp_path_factory) -> dict[int, tuple]:
    return _reference(corpus, tmp_path_factory, "--bf16", "--grad-reduce-in-bf16")


LAYOUTS = {  # name: (processes, flags); (TP, PP, DP) in the name
    "tp2_pp2_dp1": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                        "2"]),
    "tp2_pp1_dp2_zero_sp": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                "--use-distributed-optimizer"]),
    "tp1_pp2_dp2_overlap": (4, ["--pipeline-model-parallel-size", "2",
                                "--overlap-grad-reduce"]),
    # the overlapped all-gather moves the rounded bf16 weights (bf16 gradient buckets too)
    "reduce_in_bf16_tp1_pp1_dp2_zero_overlap": (2, ["--grad-reduce-in-bf16",
                                                    "--use-distributed-optimizer",
                                                    "--overlap-grad-reduce",
                                                    "--overlap-param-gather"]),
    # the tied embedding's main_grad summed across the stages, ZeRO with the all-gather of
    # the updated bf16 weights during the next forward
    "tp1_pp2_dp2_zero_overlap_param_gather": (4, ["--pipeline-model-parallel-size", "2",
                                                  "--use-distributed-optimizer",
                                                  "--overlap-grad-reduce",
                                                  "--overlap-param-gather"]),
}


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_layout_matches_single_process(name, corpus, request, fp32_reference, tmp_path):
    nproc, flags = LAYOUTS[name]
    want = request.getfixturevalue("bf16_reduce_reference" if name.startswith("reduce")
                                   else "bf16_reference")
    out = tmp_path / "log.jsonl"
    proc = fork_run(nproc, [*MODEL, "--data-path", corpus, "--log-jsonl", str(out), "--bf16",
                            *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_bf16_close(figures(out), want, fp32_reference)


@pytest.mark.e2e
def test_bf16_checkpoint_moves_between_layouts_and_to_fp32(corpus, bf16_reference,
                                                           fp32_reference, tmp_path):
    """Saved with --bf16 at (TP, PP, DP) = (2, 2, 1) after 5 iterations; resumed with --bf16 at
    (1, 1, 1) and at (1, 2, 2) with the distributed optimizer (each rank takes its master shard
    of the saved fp32 weights): both continue the uninterrupted bf16 losses. Resumed in fp32 it
    continues within one bf16 rounding of them (the weights it starts from are the same)."""
    ckpt = tmp_path / "ckpt"
    first = fork_run(4, [*MODEL, "--data-path", corpus, "--bf16", "--tensor-model-parallel-size",
                         "2", "--pipeline-model-parallel-size", "2", "--save", str(ckpt),
                         "--exit-interval", "5", "--log-jsonl", str(tmp_path / "a.jsonl")])
    assert first.returncode == 0, first.stderr[-3000:]
    assert main([*MODEL, "--data-path", corpus, "--bf16", "--load", str(ckpt),
                 "--log-jsonl", str(tmp_path / "b.jsonl")]) == 0
    third = fork_run(4, [*MODEL, "--data-path", corpus, "--bf16",
                         "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                         "--load", str(ckpt), "--log-jsonl", str(tmp_path / "c.jsonl")])
    assert third.returncode == 0, third.stderr[-3000:]
    assert main([*MODEL, "--data-path", corpus, "--load", str(ckpt),
                 "--log-jsonl", str(tmp_path / "d.jsonl")]) == 0
    assert_bf16_close(figures(tmp_path / "a.jsonl"),
                      {k: v for k, v in bf16_reference.items() if k <= 5}, fp32_reference)
    assert_bf16_close(figures(tmp_path / "b.jsonl"), bf16_reference, fp32_reference, first=6)
    assert_bf16_close(figures(tmp_path / "c.jsonl"), bf16_reference, fp32_reference, first=6)
    in_fp32 = figures(tmp_path / "d.jsonl")
    assert sorted(in_fp32) == list(range(6, 11))
    assert abs(in_fp32[6][0] - bf16_reference[6][0]) <= 2**-9 * bf16_reference[6][0]
