"""The tiny single-process run most in-process training tests start from: its flags on the
shared corpus (tests/conftest.py) and what its ``--log-jsonl`` file records."""

import json
from pathlib import Path

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
