"""Byte-level BPE tokenizers with Megatron's names: ``GPT2BPETokenizer`` (``--vocab-file`` /
``--merge-file``, read with Hugging Face ``tokenizers``) and ``TikTokenizer`` (a local tiktoken
``.json`` vocabulary, encoded with ``tiktoken``). Nothing is downloaded.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Sequence
from pathlib import Path

from megatron_h2.data.tokenizer import Tokenizer, _one_line
from megatron_h2.errors import ConfigError

GPT2_EOD = "<|endoftext|>"
# Megatron's TikTokenizer pre-tokenization patterns (--tiktoken-pattern v1 | v2).
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}"
          "\\p{M}]+|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}"
          "\\p{Lo}\\p{M}]*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
}
TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
TIKTOKEN_DEFAULT_VOCAB = 2**17


def _existing(path: str | None, flag: str, what: str) -> str:
    if not path:
        raise ConfigError(f"{what} needs {flag}")
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path} not found")
    return path


class GPT2BPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE from ``vocab.json`` and ``merges.txt``, as Megatron's
    GPT2BPETokenizer: ``vocab_size`` is the size of ``vocab.json``, ``eod`` the id of
    ``<|endoftext|>``, and the text is encoded without special-token parsing."""

    def __init__(self, vocab_file: str | None, merge_file: str | None) -> None:
        from tokenizers import ByteLevelBPETokenizer

        what = "GPT2BPETokenizer (the default --tokenizer-type)"
        self.vocab_file = _existing(vocab_file, "--vocab-file", what)
        self.merge_file = _existing(merge_file, "--merge-file", what)
        try:
            self._bpe = ByteLevelBPETokenizer.from_file(self.vocab_file, self.merge_file)
        except Exception as error:  # noqa: BLE001 - the library raises plain Exceptions
            raise ConfigError(f"cannot read GPT-2 BPE files {vocab_file} / {merge_file} "
                              f"({_one_line(error)[:200]}); pass vocab.json and merges.txt"
                              ) from None
        vocab = self._bpe.get_vocab()
        if GPT2_EOD not in vocab:
            raise ConfigError(f"--vocab-file {vocab_file} has no {GPT2_EOD} token, which "
                              "GPT2BPETokenizer uses as eod")
        self.vocab_size = self._bpe.get_vocab_size()
        self.eod = int(vocab[GPT2_EOD])

    def tokenize(self, text: str) -> list[int]:
        return list(self._bpe.encode(text).ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._bpe.decode([int(i) for i in ids])

    def __getstate__(self) -> tuple[str, str]:
        return self.vocab_file, self.merge_file

    def __setstate__(self, state: tuple[str, str]) -> None:
        self.__init__(*state)


def load_tiktoken_ranks(path: str, max_vocab: int, shift: int) -> dict[bytes, int]:
    """Megatron's tiktoken vocabulary: a JSON list of ``{"rank", "token_bytes" (base64),
    "token_str"}`` in rank order, the first 256 the single bytes; the first ``max_vocab``
    entries, their ids shifted by ``shift`` (the special tokens come first)."""
    if not path.endswith(".json"):
        raise ConfigError(f"TikTokenizer needs a .json vocabulary, got --tokenizer-model {path}")
    try:
        with open(path, encoding="utf-8") as stream:
            entries = json.load(stream)
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read tiktoken vocabulary {path} ({_one_line(error)})") from None
    if not isinstance(entries, list):
        raise ConfigError(f"tiktoken vocabulary {path} must be a JSON list of tokens")
    ranks: dict[bytes, int] = {}
    for i, entry in enumerate(entries[:max_vocab]):
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
            ok = entry["rank"] == i and (i >= 256 or token == bytes([i])) and token not in ranks
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ConfigError(f"tiktoken vocabulary {path}: entry {i} is not {{\"rank\": {i}, "
                              "\"token_bytes\": base64, \"token_str\"}} (the first 256 are the "
                              "single bytes)")
        ranks[token] = i + shift
    return ranks


class TikTokenizer(Tokenizer):
    """Megatron's TikTokenizer: ``num_special_tokens`` special tokens (ids ``0..S-1``: the given
    ones, by default ``<unk> <s> </s> <mask> <pad> <cls> <sep>``, then ``<SPECIAL_i>`` fillers),
    followed by the first ``vocab_size - S`` tokens of the vocabulary file; ``eod`` is ``</s>``.
    Special-token strings in the text are encoded as those tokens, as Megatron does."""

    def __init__(self, path: str, pattern: str | None = None, vocab_size: int | None = None,
                 num_special_tokens: int = 1000,
                 special_tokens: Sequence[str] | None = None) -> None:
        try:
            import tiktoken
        except ImportError:
            raise ConfigError("TikTokenizer needs the tiktoken package (pip install "
                              "tiktoken)") from None
        self._args = (path, pattern, vocab_size, num_special_tokens, special_tokens)
        self.vocab_size = int(vocab_size or TIKTOKEN_DEFAULT_VOCAB)
        special = list(special_tokens or TIKTOKEN_SPECIAL_TOKENS)
        missing = [t for t in TIKTOKEN_SPECIAL_TOKENS if t not in special]
        if missing or len(set(special)) != len(special):
            raise ConfigError("--tokenizer-special-tokens must list each token once and include "
                              f"{' '.join(TIKTOKEN_SPECIAL_TOKENS)}")
        if not len(special) <= num_special_tokens < self.vocab_size:
            raise ConfigError(f"--tiktoken-num-special-tokens {num_special_tokens} must be at "
                              f"least the {len(special)} special tokens and below the vocabulary "
                              f"size {self.vocab_size} (--vocab-size)")
        special += [f"<SPECIAL_{i}>" for i in range(len(special), num_special_tokens)]
        inner = self.vocab_size - num_special_tokens
        ranks = load_tiktoken_ranks(path, inner, num_special_tokens)
        if len(ranks) < inner:
            raise ConfigError(
                f"tiktoken vocabulary {path} has {len(ranks)} tokens but --vocab-size "
                f"{self.vocab_size} minus {num_special_tokens} special tokens needs {inner}; "
                "lower --vocab-size")
        self.eod = special.index("</s>")
        self.bos = special.index("<s>")
        self._encoding = tiktoken.Encoding(
            name=Path(path).parent.name or "tiktoken", pat_str=TIKTOKEN_PATTERNS[pattern or "v2"],
            mergeable_ranks=ranks, special_tokens={t: i for i, t in enumerate(special)})

    def tokenize(self, text: str) -> list[int]:
        return self._encoding.encode(text, allowed_special="all")

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._encoding.decode([int(i) for i in ids])

    def __getstate__(self) -> tuple:
        return self._args

    def __setstate__(self, state: tuple) -> None:
        self.__init__(*state)


__all__ = ["GPT2BPETokenizer", "TIKTOKEN_PATTERNS", "TikTokenizer", "load_tiktoken_ranks"]
