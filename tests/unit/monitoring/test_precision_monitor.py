"""--precision-check-interval: a periodic operator check of each stage that leaves training
exactly as it would be without it."""

import json
from pathlib import Path

import pytest

from megatron_h2.errors import ConfigError
from megatron_h2.training.arguments import config_from_args
from megatron_h2.training.main import main


def _flags(corpus: str, tmp: Path, *extra: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "4",
            "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "2",
            "--data-path", corpus, "--split", "90,10,0", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "256", "--seed", "7", "--train-iters", "4", "--log-interval", "1",
            "--eval-interval", "1000", "--eval-iters", "0", "--hidden-dropout", "0.1",
            "--data-cache-path", str(tmp / "idx"), "--log-jsonl", str(tmp / "log.jsonl"),
            *extra]


def _losses(tmp: Path) -> list[float]:
    return [json.loads(x)["lm_loss"] for x in (tmp / "log.jsonl").read_text().splitlines()]


def test_check_logs_each_stage_and_leaves_training_unchanged(corpus, tmp_path, capsys):
    plain, checked = tmp_path / "plain", tmp_path / "checked"
    assert main(_flags(corpus, plain)) == 0
    capsys.readouterr()
    assert main(_flags(corpus, checked, "--precision-check-interval", "2")) == 0
    out = capsys.readouterr().out
    assert _losses(checked) == _losses(plain)  # dropout on: the check used no training RNG
    for it in (2, 4):
        assert f"precision check at iteration {it} " in out
    lines = [x for x in out.splitlines() if x.strip().startswith("stage 0 (chip default, cpu)")]
    assert len(lines) == 2 and "0 of " in lines[0] and "worst (rank 0): #" in lines[0]


def test_interval_must_be_positive():
    with pytest.raises(ConfigError, match="--precision-check-interval must be a positive"):
        config_from_args(["--precision-check-interval", "0"])
