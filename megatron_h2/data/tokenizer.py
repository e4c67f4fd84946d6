"""Tokenizers with Megatron's names, and a SentencePiece training helper.

Every tokenizer exposes ``vocab_size``, ``eod`` (the id appended after each document),
``tokenize(text) -> list[int]`` and ``detokenize(ids) -> str``.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence

from megatron_h2.errors import ConfigError

TOKENIZER_TYPES = (
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
)
MIN_SENTENCEPIECE_VOCAB = 260  # 256 byte pieces + unk/bos/eos + at least one merge
_MAX_TRAIN_LINE_CHARS = 4096


def _one_line(error: BaseException) -> str:
    """An exception message squeezed onto one line."""
    return " ".join(str(error).split()) or type(error).__name__


class Tokenizer(ABC):
    """Common interface: ``vocab_size``, ``eod``, ``tokenize`` and ``detokenize``."""

    vocab_size: int
    eod: int

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of a sequence of token ids."""


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file; ``eod`` is the model's eos id.

    Unlike Megatron's SentencePieceTokenizer no extra special tokens are appended to the
    vocabulary, so it behaves like GPTSentencePieceTokenizer.
    """

    def __init__(self, model_file: str) -> None:
        import sentencepiece

        self.model_file = model_file
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as error:
            raise ConfigError(
                f"cannot load {model_file} as a SentencePiece model ({_one_line(error)}); "
                f"pass a .model file made by tools/train_tokenizer.py"
            ) from None
        self.vocab_size = int(self._processor.get_piece_size())
        self.eod = int(self._processor.eos_id())
        if self.eod < 0:
            raise ConfigError(
                f"SentencePiece model {model_file} has no eos piece; retrain it with an eos id "
                f"(tools/train_tokenizer.py does)"
            )

    def tokenize(self, text: str) -> list[int]:
        return list(self._processor.encode(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._processor.decode([int(i) for i in ids])

    def __getstate__(self) -> str:
        return self.model_file

    def __setstate__(self, state: str) -> None:
        self.__init__(state)


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron's GPT flavour of :class:`SentencePieceTokenizer` (eod = eos id, no extras)."""


class HuggingFaceTokenizer(Tokenizer):
    """A local ``transformers`` tokenizer directory; ``eod`` is its ``eos_token_id``.

    ``tokenize`` does not add special tokens (no BOS); ``vocab_size`` is ``len(tokenizer)``,
    which includes added tokens.
    """

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.path = path
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as error:
            raise ConfigError(
                f"cannot load a Hugging Face tokenizer from {path} ({_one_line(error)[:300]}); "
                f"pass a directory written by save_pretrained"
            ) from None
        eos = self._tokenizer.eos_token_id
        if eos is None:
            raise ConfigError(
                f"Hugging Face tokenizer {path} has no eos_token; set eos_token in its "
                f"tokenizer_config.json so documents can be separated"
            )
        self.eod = int(eos)
        self.vocab_size = len(self._tokenizer)

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    def __getstate__(self) -> str:
        return self.path

    def __setstate__(self, state: str) -> None:
        self.__init__(state)


class NullTokenizer(Tokenizer):
    """Text is whitespace-separated integer ids; for pre-tokenized data and tests.

    Like Megatron, ``NullTokenizer(V)`` accepts ids ``0..V-1`` and reserves ``V`` as the
    eod id, so ``vocab_size == V + 1`` and ``eod == vocab_size - 1``.
    """

    def __init__(self, vocab_size: int) -> None:
        self._max_id = int(vocab_size)
        self.vocab_size = self._max_id + 1
        self.eod = self._max_id

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in text.split():
            try:
                value = int(word)
            except ValueError:
                raise ConfigError(
                    f"NullTokenizer expects whitespace-separated integers, got {word[:40]!r}; "
                    f"pre-tokenize the text or use another --tokenizer-type"
                ) from None
            if not 0 <= value < self._max_id:
                raise ConfigError(
                    f"NullTokenizer id {value} is outside [0, {self._max_id}); "
                    f"raise --vocab-size above the largest id"
                )
            ids.append(value)
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def _require_path(tokenizer_type: str, tokenizer_model: str | None) -> str:
    if not tokenizer_model:
        raise ConfigError(f"{tokenizer_type} needs --tokenizer-model (path to the model)")
    if not os.path.exists(tokenizer_model):
        raise ConfigError(
            f"tokenizer model {tokenizer_model} not found; check --tokenizer-model or train one "
            f"with tools/train_tokenizer.py"
        )
    return tokenizer_model


def build_tokenizer(
    tokenizer_type: str, tokenizer_model: str | None = None, vocab_size: int | None = None
) -> Tokenizer:
    """Build a tokenizer by Megatron type name.

    Args:
        tokenizer_type: one of ``TOKENIZER_TYPES``.
        tokenizer_model: SentencePiece ``.model`` file or Hugging Face tokenizer directory.
        vocab_size: required for NullTokenizer (ids must be below it). For model-based
            tokenizers it is optional; if given it must be at least the model's vocab size.
    """
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ConfigError(
            f"unknown tokenizer type {tokenizer_type!r}; valid: {', '.join(TOKENIZER_TYPES)}"
        )
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or int(vocab_size) < 1:
            raise ConfigError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        return NullTokenizer(int(vocab_size))
    path = _require_path(tokenizer_type, tokenizer_model)
    tokenizer: Tokenizer
    if tokenizer_type == "HuggingFaceTokenizer":
        tokenizer = HuggingFaceTokenizer(path)
    elif os.path.isdir(path):
        raise ConfigError(f"{tokenizer_type} needs a .model file, but {path} is a directory")
    elif tokenizer_type == "GPTSentencePieceTokenizer":
        tokenizer = GPTSentencePieceTokenizer(path)
    else:
        tokenizer = SentencePieceTokenizer(path)
    if vocab_size is not None and int(vocab_size) < tokenizer.vocab_size:
        raise ConfigError(
            f"--vocab-size {vocab_size} is smaller than the vocab of {path} "
            f"({tokenizer.vocab_size}); drop --vocab-size or raise it"
        )
    return tokenizer


def iter_input_texts(
    paths: Sequence[str | os.PathLike[str]], json_keys: Sequence[str]
) -> Iterator[str]:
    """Yield texts from ``.jsonl``/``.json`` files (values of ``json_keys``) or plain text files."""
    for path in paths:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(f"tokenizer training input {path} not found; check --input")
        is_json = path.endswith((".jsonl", ".json"))
        with open(path, encoding="utf-8") as stream:
            if not is_json:
                yield stream.read()
                continue
            for number, line in enumerate(stream, start=1):
                if line.strip():
                    yield from _json_line_texts(path, number, line, json_keys)


def parse_json_object(line: str, where: str) -> dict:
    """One line of a JSON-lines input as a dict; ``where`` (``path:line``) leads any error."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{where}: not valid JSON ({error.msg}); each line of --input must be "
                          "one JSON object") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def _json_line_texts(path: str, number: int, line: str, json_keys: Sequence[str]) -> Iterator[str]:
    record = parse_json_object(line, f"{path}:{number}")
    for key in json_keys:
        if not isinstance(record.get(key), str):
            raise ConfigError(
                f"{path}:{number}: no string value for key {key!r} (keys: {sorted(record)[:8]}); "
                f"pass the right --json-keys"
            )
        yield record[key]


def _training_lines(texts: Iterable[str], max_lines: int | None) -> Iterator[str]:
    """Split documents into non-blank lines (long lines chunked), at most ``max_lines``."""
    emitted = 0
    for text in texts:
        for line in text.splitlines():
            if not line.strip():
                continue
            for start in range(0, len(line), _MAX_TRAIN_LINE_CHARS):
                if max_lines is not None and emitted >= max_lines:
                    return
                yield line[start : start + _MAX_TRAIN_LINE_CHARS]
                emitted += 1


def train_sentencepiece(
    source: Sequence[str | os.PathLike[str]] | Iterator[str],
    model_prefix: str,
    vocab_size: int,
    *,
    model_type: str = "bpe",
    json_keys: Sequence[str] = ("text",),
    max_lines: int | None = 2_000_000,
    num_threads: int | None = None,
) -> str:
    """Train a byte-fallback SentencePiece model and return the ``.model`` path.

    Args:
        source: a list/tuple of input files (``.jsonl``/``.json`` read via ``json_keys``,
            anything else as plain text), or an iterator/generator of document texts.
        model_prefix: output path without extension; writes ``.model`` and ``.vocab``.
        vocab_size: number of pieces (at least ``MIN_SENTENCEPIECE_VOCAB``).
        model_type: ``"bpe"`` or ``"unigram"``.
        max_lines: cap on training lines (the first ones, deterministic); None for all.
        num_threads: trainer threads (default: CPU count).

    The model uses identity normalisation and keeps whitespace, so ``detokenize(tokenize(t))``
    returns ``t`` for any text; unk=0, bos=1, eos=2 (the eod id), no pad.
    """
    import sentencepiece

    if model_type not in ("bpe", "unigram"):
        raise ConfigError(
            f"unknown SentencePiece model type {model_type!r}; use 'bpe' or 'unigram'"
        )
    if int(vocab_size) < MIN_SENTENCEPIECE_VOCAB:
        raise ConfigError(
            f"--vocab-size {vocab_size} is too small for a byte-fallback SentencePiece model; "
            f"use at least {MIN_SENTENCEPIECE_VOCAB}"
        )
    if isinstance(source, (str, os.PathLike)):
        source = [source]
    texts = source if isinstance(source, Iterator) else iter_input_texts(source, json_keys)
    lines = list(_training_lines(texts, max_lines))
    if not lines:
        raise ConfigError("no text to train the tokenizer on; check --input and --json-keys")
    parent = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(parent, exist_ok=True)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_prefix=model_prefix,
            vocab_size=int(vocab_size),
            model_type=model_type,
            byte_fallback=True,
            character_coverage=1.0,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            input_sentence_size=0,
            max_sentence_length=4 * _MAX_TRAIN_LINE_CHARS,
            num_threads=num_threads or os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as error:
        message = _one_line(error)
        hint = "lower --vocab-size or give more text"
        if "smaller than" in message:
            hint = "raise --vocab-size"
        raise ConfigError(f"SentencePiece training failed ({message[-300:]}); {hint}") from None
    return model_prefix + ".model"
