"""Tiny tokenizer files made locally for tests (nothing is downloaded): GPT-2 BPE vocab.json /
merges.txt, a tiktoken .json vocabulary and a SentencePiece model."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()


def texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(count)]


def gpt2_files(folder: Path, vocab_size: int = 400) -> tuple[str, str]:
    """``vocab.json`` and ``merges.txt`` of a byte-level BPE trained on :func:`texts`, with
    ``<|endoftext|>`` (GPT-2's eod) as its one special token."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts(200), vocab_size=vocab_size, min_frequency=1,
                            special_tokens=["<|endoftext|>"])
    folder.mkdir(parents=True, exist_ok=True)
    bpe.save_model(str(folder))
    return str(folder / "vocab.json"), str(folder / "merges.txt")


def tiktoken_file(path: Path, extra: tuple[str, ...] = ("oW",)) -> tuple[str, int]:
    """A vocabulary in Megatron's tiktoken format: the 256 bytes, the ``extra`` tokens (merged
    first), then every prefix of the words (with and without a leading space) so BPE can build
    them. Returns the path and the number of tokens."""
    tokens = [bytes([i]) for i in range(256)]
    for word in [*extra, *WORDS, *(" " + w for w in WORDS), "Hello", "World"]:
        data = word.encode()
        for end in range(2, len(data) + 1):
            if data[:end] not in tokens:
                tokens.append(data[:end])
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                "token_str": t.decode("utf-8", "replace")} for i, t in enumerate(tokens)]
    path.write_text(json.dumps(entries))
    return str(path), len(tokens)


def sentencepiece_model(folder: Path) -> str:
    from megatron_h2.data.tokenizer import train_sentencepiece

    return train_sentencepiece(iter(texts(200)), str(folder / "tok"), 300)
