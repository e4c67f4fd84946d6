"""Tiny runs in the test process on the shared corpus (tests/conftest.py): :func:`flags` of a
whole run and what its ``--log-jsonl`` file :func:`records`; and :data:`MODEL`, a model with no
batch, length or schedule flags, which :func:`run` trains with the flags a test gives."""

import json
from pathlib import Path

from megatron_h2.training.main import main

VOCAB = 256  # NullTokenizer ids 0..255 (eod = 255); the corpus documents use 0..249


def flags(corpus: str, tmp: Path, *extra: str) -> list[str]:
    """pretrain_gpt.py flags of a 2-layer model on ``corpus``, logging JSON lines into ``tmp``;
    ``extra`` flags come last (they override)."""
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "20",
            "--lr-decay-iters", "100",
            "--ffn-hidden-size", "128", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "4",
            "--global-batch-size", "8", "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-warmup-iters", "5", "--data-path", corpus, "--split", "90,10,0",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--seed", "11",
            "--data-cache-path", str(tmp / "idx_cache"), "--log-jsonl", str(tmp / "log.jsonl"),
            *extra]


def records(tmp: Path, key: str = "lm_loss") -> dict[int, float]:
    """``{iteration: key}`` from the ``--log-jsonl`` file that :func:`flags` names."""
    lines = [json.loads(x) for x in (tmp / "log.jsonl").read_text().splitlines()]
    return {r["iteration"]: r[key] for r in lines if key in r}


MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--num-query-groups", "2",
         "--ffn-hidden-size", "128", "--seq-length", "32", "--max-position-embeddings", "32",
         "--micro-batch-size", "2", "--lr", "3e-3", "--seed", "11", "--log-interval", "1",
         "--eval-interval", "1000", "--eval-iters", "0", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "256", "--split", "90,10,0"]


def run(corpus: str, tmp: Path, *extra: str) -> list[dict]:
    """Train in this process; returns the --log-jsonl records."""
    log = tmp / "log.jsonl"
    if log.exists():
        log.unlink()
    assert main([*MODEL, "--data-path", corpus, "--data-cache-path", str(tmp / "cache"),
                 "--log-jsonl", str(log), *extra]) == 0
    return [json.loads(line) for line in log.read_text().splitlines()]


def run_error(corpus: str, tmp: Path, capsys, *extra: str) -> str:
    """Train in this process expecting a start-up error; returns its one line."""
    assert main([*MODEL, "--data-path", corpus, "--data-cache-path", str(tmp / "cache"),
                 *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err
