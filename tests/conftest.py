"""Shared fixtures: a tiny learnable corpus in Megatron's format, made by the real tool."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256  # NullTokenizer ids 0..255 (eod = 255); the documents use 0..249


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """Counting sequences (each token is the previous plus one), so a tiny model learns fast."""
    d = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    with open(d / "docs.jsonl", "w") as fh:
        for _ in range(300):
            start, n = rng.randrange(250), rng.randrange(40, 120)
            fh.write(json.dumps({"text": " ".join(str((start + i) % 250) for i in range(n))})
                     + "\n")
    subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input",
                    str(d / "docs.jsonl"), "--output-prefix", str(d / "count"),
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
                    "--append-eod", "--workers", "1"], check=True, capture_output=True)
    return str(d / "count_text_document")


@pytest.fixture(scope="session")
def tiny_reference(corpus, tmp_path_factory) -> dict[int, float]:
    """``{iteration: loss}`` of one process training ``dist_utils.tiny_model_flags()`` with
    micro-batch 2 and global batch 8: what multi-process runs of that model must reproduce."""
    from megatron_h2.training.main import main
    from tests.dist_utils import losses, tiny_model_flags

    log = tmp_path_factory.mktemp("tiny_reference") / "log.jsonl"
    assert main([*tiny_model_flags(), "--data-path", corpus, "--micro-batch-size", "2",
                 "--global-batch-size", "8", "--log-jsonl", str(log)]) == 0
    return losses(log)
