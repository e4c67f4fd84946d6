"""Continuing a Megatron-LM run (a fixture Megatron-Core saved at TP 2, with Adam's state, and
one its distributed optimizer saved at DP 2) for 5 iterations: under the saved layout
(forked ranks), in one process, and under a different plan (two pipeline stages on two chip types
through the bridge) the losses agree, and the iteration and consumed samples go on from the
checkpoint's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_h2.training.main import main
from tests.helpers.dist_utils import losses, write_counting_corpus
from tests.helpers.fork_run import fork_run
from tests.helpers.paths import ROOT
from tests.unit.pipeline.test_hetero_pp import write_plan

FIXTURES = ROOT / "tests" / "fixtures" / "megatron"
ARCH = {
    "gpt": ["--ffn-hidden-size", "64", "--no-bias-gelu-fusion"],
    "llama": ["--ffn-hidden-size", "32", "--swiglu", "--normalization", "RMSNorm",
              "--position-embedding-type", "rope", "--disable-bias-linear",
              "--untie-embeddings-and-output-weights", "--group-query-attention",
              "--num-query-groups", "2"],
}


def model_flags(arch: str, corpus: str, tmp: Path) -> list[str]:
    """The fixtures' model (generate.py) and a 5-iteration continuation of their schedule."""
    return ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
            "--seq-length", "8", "--max-position-embeddings", "8", "--hidden-dropout", "0",
            "--attention-dropout", "0", *ARCH[arch], "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "64", "--make-vocab-size-divisible-by", "64", "--lr", "1e-2",
            "--min-lr", "0", "--lr-decay-style", "constant", "--weight-decay", "0.01",
            "--use-checkpoint-opt-param-scheduler", "--train-iters", "7", "--log-interval",
            "1", "--eval-iters", "0", "--eval-interval", "1000", "--split", "90,10,0",
            "--data-path", corpus, "--data-cache-path", str(tmp / "cache")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """Counting documents within the fixtures' 64-token vocabulary (eod 63)."""
    return write_counting_corpus(tmp_path_factory.mktemp("corpus64"), 80, (12, 40), 64,
                                 modulo=63)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def close(got: dict[int, float], want: dict[int, float], rel: float) -> None:
    assert sorted(got) == sorted(want) == [3, 4, 5, 6, 7]
    for it, value in want.items():
        assert abs(got[it] - value) <= rel * abs(value), (it, got[it], value)


@pytest.mark.parametrize("arch, fmt", [("gpt", "torch_dist"), ("llama", "torch")])
def test_continue_under_another_plan(arch, fmt, corpus, tmp_path):
    load = str(FIXTURES / f"{arch}_tp2_pp1" / fmt)
    flags = [*model_flags(arch, corpus, tmp_path), "--load", load]
    one = tmp_path / "one.jsonl"
    assert main([*flags, "--micro-batch-size", "2", "--global-batch-size", "4",
                 "--log-jsonl", str(one)]) == 0
    rows = records(one)
    assert [r["iteration"] for r in rows] == [3, 4, 5, 6, 7]
    assert [r["consumed_samples"] for r in rows] == [12, 16, 20, 24, 28]  # 8 before
    saved = tmp_path / "saved.jsonl"
    proc = fork_run(2, [*flags, "--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
                        "--global-batch-size", "4", "--log-jsonl", str(saved)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    close(losses(saved), losses(one), 1e-5)
    plan = write_plan(tmp_path / "plan.yaml",
                      [{"chip": "fast", "tensor_parallel_size": 1, "num_layers": 1},
                       {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 1}],
                      micro=2, global_batch=4)
    other = tmp_path / "other.jsonl"
    proc = fork_run(2, [*flags, "--hetero-plan", plan, "--force-bridge",
                        "--log-jsonl", str(other)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Megatron-LM" in proc.stdout and "bridge" in proc.stdout
    close(losses(other), losses(saved), 1e-5)
    assert [r["consumed_samples"] for r in records(other)] == [12, 16, 20, 24, 28]


def test_continue_a_distributed_optimizer_run_saved_at_dp2(corpus, tmp_path):
    """Megatron-Core's DistributedOptimizer state saved by two data-parallel ranks
    (dp_reshardable): continued at DP 2 with our distributed optimizer, and under two pipeline
    stages on two chip types through the bridge, the losses agree (and differ from a start
    without the optimizer's state)."""
    load = str(FIXTURES / "gpt_distopt_dp2" / "dp_reshardable")
    flags = [*model_flags("gpt", corpus, tmp_path), "--load", load, "--micro-batch-size", "2",
             "--global-batch-size", "4"]
    saved = tmp_path / "saved.jsonl"
    proc = fork_run(2, [*flags, "--use-distributed-optimizer", "--log-jsonl", str(saved)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = write_plan(tmp_path / "plan.yaml",
                      [{"chip": "fast", "tensor_parallel_size": 1, "num_layers": 1},
                       {"chip": "slow", "tensor_parallel_size": 1, "num_layers": 1}],
                      micro=2, global_batch=4)
    other = tmp_path / "other.jsonl"
    proc = fork_run(2, [*model_flags("gpt", corpus, tmp_path), "--load", load, "--hetero-plan",
                        plan, "--force-bridge", "--log-jsonl", str(other)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    close(losses(other), losses(saved), 1e-5)
    assert [r["iteration"] for r in records(other)] == [3, 4, 5, 6, 7]
    assert [r["consumed_samples"] for r in records(saved)] == [12, 16, 20, 24, 28]  # 8 before
    # the state matters: without it (--no-load-optim) the losses go another way
    fresh = tmp_path / "fresh.jsonl"
    assert main([*flags, "--no-load-optim", "--log-jsonl", str(fresh)]) == 0
    assert abs(losses(fresh)[7] - losses(saved)[7]) > 1e-3 * abs(losses(saved)[7])


def test_model_mismatch_is_one_line_naming_the_flag(corpus, tmp_path, capsys):
    flags = model_flags("gpt", corpus, tmp_path)
    flags[flags.index("--hidden-size") + 1] = "32"
    assert main([*flags, "--micro-batch-size", "2", "--global-batch-size", "4", "--load",
                 str(FIXTURES / "gpt_tp1_pp1" / "torch_dist")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "hidden_size=16" in err and "--hidden-size" in err, err


def test_finetune_starts_at_zero(corpus, tmp_path):
    log = tmp_path / "log.jsonl"
    flags = model_flags("llama", corpus, tmp_path)
    flags[flags.index("--train-iters") + 1] = "2"
    assert main([*flags, "--micro-batch-size", "2", "--global-batch-size", "4", "--load",
                 str(FIXTURES / "llama_tp1_pp2" / "torch_dist"), "--finetune",
                 "--log-jsonl", str(log)]) == 0
    assert [r["iteration"] for r in records(log)] == [1, 2]


def test_use_checkpoint_args_takes_the_model_from_the_checkpoint(corpus, tmp_path, capsys):
    """Wrong shape flags and no architecture flags: --use-checkpoint-args takes the LLaMA's."""
    log = tmp_path / "log.jsonl"
    flags = model_flags("gpt", corpus, tmp_path)
    flags[flags.index("--hidden-size") + 1] = "32"
    flags[flags.index("--train-iters") + 1] = "3"
    load = ["--load", str(FIXTURES / "llama_tp1_pp2" / "torch")]
    assert main([*flags, "--micro-batch-size", "2", "--global-batch-size", "4", *load,
                 "--use-checkpoint-args", "--log-jsonl", str(log)]) == 0
    assert [r["iteration"] for r in records(log)] == [3]
    capsys.readouterr()
    assert main([*flags, "--micro-batch-size", "2", "--global-batch-size", "4",
                 "--use-checkpoint-args"]) == 2
    assert "--use-checkpoint-args needs --load" in capsys.readouterr().err
