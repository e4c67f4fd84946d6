"""Tokenizers with Megatron's names and semantics, and a SentencePiece training helper.

Every tokenizer exposes ``vocab_size``, ``eod`` (the id appended after each document),
``tokenize(text) -> list[int]`` and ``detokenize(ids) -> str``. Everything is read from local
files; nothing is downloaded. ``GPT2BPETokenizer`` and ``TikTokenizer`` live in
:mod:`megatron_h2.data.bpe_tokenizers`.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence

from megatron_h2.config import TOKENIZER_TYPES
from megatron_h2.errors import ConfigError

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


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron's Llama2Tokenizer: a SentencePiece model whose ``tokenize`` starts every text
    with the BOS id (text completion); ``eod`` is the EOS id (appended by ``--append-eod``)."""

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file)
        self.bos = int(self._processor.bos_id())
        if self.bos < 0:
            raise ConfigError(f"SentencePiece model {model_file} has no bos piece, which "
                              "Llama2Tokenizer puts first; use GPTSentencePieceTokenizer")

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *self._processor.encode(text)]


class HuggingFaceTokenizer(Tokenizer):
    """A local ``transformers`` tokenizer directory; ``eod`` is its ``eos_token_id``.

    As Megatron's, ``tokenize`` adds the tokenizer's special tokens (e.g. a BOS first) unless
    ``include_special_tokens`` is False (``--tokenizer-hf-no-include-special-tokens``);
    ``vocab_size`` is ``len(tokenizer)``, which includes added tokens.
    """

    def __init__(self, path: str, include_special_tokens: bool = True) -> None:
        from transformers import AutoTokenizer

        self.path = path
        self.include_special_tokens = include_special_tokens
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
        return list(self._tokenizer.encode(text, add_special_tokens=self.include_special_tokens))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    def __getstate__(self) -> tuple[str, bool]:
        return self.path, self.include_special_tokens

    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.__init__(*state)


class NullTokenizer(Tokenizer):
    """Text is whitespace-separated integer ids; for pre-tokenized data, mock data and tests.

    As Megatron's: ``NullTokenizer(N)`` has ``vocab_size == N`` (ids ``0..N-1``) and its eod is
    the last id, ``N - 1``, unless ``eod_id`` (``--null-tokenizer-eod-id``) says otherwise.
    """

    def __init__(self, vocab_size: int, eod_id: int | None = None) -> None:
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1 if eod_id is None else int(eod_id)
        if not 0 <= self.eod < self.vocab_size:
            raise ConfigError(f"--null-tokenizer-eod-id {self.eod} is outside the vocabulary "
                              f"[0, {self.vocab_size}) of --vocab-size {self.vocab_size}")

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
            if not 0 <= value < self.vocab_size:
                raise ConfigError(
                    f"NullTokenizer id {value} is outside [0, {self.vocab_size}); "
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
    tokenizer_type: str, tokenizer_model: str | None = None, vocab_size: int | None = None, *,
    vocab_file: str | None = None, merge_file: str | None = None,
    tiktoken_pattern: str | None = None, tiktoken_num_special_tokens: int = 1000,
    special_tokens: Sequence[str] | None = None, null_tokenizer_eod_id: int | None = None,
    hf_include_special_tokens: bool = True,
) -> Tokenizer:
    """Build a tokenizer by Megatron type name (the options are Megatron's tokenizer flags).

    Args:
        tokenizer_type: one of ``TOKENIZER_TYPES``.
        tokenizer_model: SentencePiece ``.model`` file, tiktoken ``.json`` vocabulary or
            Hugging Face tokenizer directory.
        vocab_size: NullTokenizer's vocabulary (required) and TikTokenizer's (default 131072);
            for the other tokenizers, if given, at least the model's vocabulary.
        vocab_file, merge_file: GPT2BPETokenizer's ``vocab.json`` and ``merges.txt``.
    """
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ConfigError(
            f"unknown tokenizer type {tokenizer_type!r}; valid: {', '.join(TOKENIZER_TYPES)}"
        )
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or int(vocab_size) < 1:
            raise ConfigError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        return NullTokenizer(int(vocab_size), null_tokenizer_eod_id)
    if tokenizer_type == "GPT2BPETokenizer":
        from megatron_h2.data.bpe_tokenizers import GPT2BPETokenizer

        tokenizer: Tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    elif tokenizer_type == "TikTokenizer":
        from megatron_h2.data.bpe_tokenizers import TikTokenizer

        return TikTokenizer(_require_path(tokenizer_type, tokenizer_model), tiktoken_pattern,
                            vocab_size, tiktoken_num_special_tokens, special_tokens)
    else:
        path = _require_path(tokenizer_type, tokenizer_model)
        if tokenizer_type == "HuggingFaceTokenizer":
            tokenizer = HuggingFaceTokenizer(path, hf_include_special_tokens)
        elif os.path.isdir(path):
            raise ConfigError(f"{tokenizer_type} needs a .model file, but {path} is a directory")
        else:
            kinds = {"GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
                     "Llama2Tokenizer": Llama2Tokenizer,
                     "SentencePieceTokenizer": SentencePieceTokenizer}
            tokenizer = kinds[tokenizer_type](path)
    if vocab_size is not None and int(vocab_size) < tokenizer.vocab_size:
        raise ConfigError(
            f"--vocab-size {vocab_size} is smaller than the vocabulary of the {tokenizer_type} "
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
