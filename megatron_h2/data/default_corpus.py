"""A small training corpus that exists on any machine: the Python standard library's sources.

:func:`ensure_default_corpus` picks a deterministic few-MB subset of the stdlib ``.py``
files, cuts them into documents at top-level statements, trains a SentencePiece tokenizer
on them and writes a Megatron dataset with an eod after every document. Everything is built
in a private staging folder that is renamed into place only after a done-marker was written,
so an interrupted build is never mistaken for a finished one. Processes that ask at the same
time (every rank of a job, several jobs sharing the cache) build it once: the first takes a
file lock and builds, the others wait and reuse it (:func:`megatron_h2.data.build_lock.build_once`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator

from megatron_h2.data.build_lock import build_once
from megatron_h2.data.preprocess import preprocess_jsonl
from megatron_h2.data.tokenizer import MIN_SENTENCEPIECE_VOCAB, train_sentencepiece
from megatron_h2.errors import ConfigError

CORPUS_FORMAT_VERSION = 1
DEFAULT_MAX_BYTES = 4_000_000
DONE_MARKER = "DONE.json"
TOKENIZER_TYPE = "GPTSentencePieceTokenizer"
"""The tokenizer type to pair with the returned SentencePiece model."""

_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
_DOCUMENT_TARGET_BYTES = 2048
_MIN_MAX_BYTES = 10_000


def stdlib_source_files(stdlib_dir: str | None = None) -> list[str]:
    """Relative paths of stdlib ``.py`` files outside test and site-packages folders, sorted."""
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    found = []
    for folder, subdirs, files in os.walk(root):
        subdirs[:] = sorted(
            d for d in subdirs if d not in _SKIP_DIRS and not d.startswith("config-")
        )
        relative = os.path.relpath(folder, root)
        for name in files:
            if name.endswith(".py") and not name.startswith("test_"):
                found.append(os.path.normpath(os.path.join(relative, name)))
    return sorted(found)


def _selection_order(relative_path: str) -> str:
    """Files are taken in hash order of their path: deterministic but spread over the tree."""
    return hashlib.sha1(relative_path.replace(os.sep, "/").encode("utf-8")).hexdigest()


def select_sources(root: str, files: list[str], max_bytes: int) -> list[tuple[str, str]]:
    """Deterministic subset ``[(relative_path, text)]`` of at most ``max_bytes`` UTF-8 bytes."""
    chosen, total = [], 0
    for relative in sorted(files, key=_selection_order):
        path = os.path.join(root, relative)
        size = os.path.getsize(path)
        if total + size > max_bytes:
            continue
        try:
            with open(path, encoding="utf-8") as stream:
                text = stream.read()
        except (UnicodeDecodeError, OSError):
            continue
        chosen.append((relative.replace(os.sep, "/"), text))
        total += len(text.encode("utf-8"))
    return chosen


def split_documents(text: str, target_bytes: int = _DOCUMENT_TARGET_BYTES) -> Iterator[str]:
    """Cut source text into documents of at least ``target_bytes`` at top-level lines."""
    current: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        top_level = line[:1] not in ("", " ", "\t", "\n", "\r", "#", ")", "]", "}")
        if size >= target_bytes and top_level:
            yield "".join(current)
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current and "".join(current).strip():
        yield "".join(current)


def _corpus_dir(cache_dir: str, vocab_size: int, max_bytes: int) -> str:
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    name = f"stdlib-{version}-v{vocab_size}-b{max_bytes}-f{CORPUS_FORMAT_VERSION}"
    return os.path.join(cache_dir, name)


def _paths(folder: str) -> tuple[str, str]:
    return os.path.join(folder, "stdlib_text_document"), os.path.join(folder, "tokenizer.model")


def _write_jsonl(path: str, sources: list[tuple[str, str]]) -> int:
    documents = 0
    with open(path, "w", encoding="utf-8") as stream:
        for relative, text in sources:
            for document in split_documents(text):
                stream.write(json.dumps({"text": document, "path": relative}) + "\n")
                documents += 1
    return documents


def _build(staging: str, vocab_size: int, max_bytes: int) -> dict[str, object]:
    """Build the corpus in ``staging``; return the done-marker content."""
    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_source_files(root) if os.path.isdir(root) else []
    sources = select_sources(root, files, max_bytes)
    if not sources:
        raise ConfigError(
            f"no Python standard library sources found under {root}; pass --data-path and a "
            f"tokenizer instead of the default corpus"
        )
    nbytes = sum(len(text.encode("utf-8")) for _, text in sources)
    print(f"building default corpus: {len(sources)} files, {nbytes / 1e6:.1f} MB from {root}",
          flush=True)
    jsonl = os.path.join(staging, "stdlib.jsonl")
    documents = _write_jsonl(jsonl, sources)
    started = time.perf_counter()
    model = train_sentencepiece(
        (text for _, text in sources), os.path.join(staging, "tokenizer"), vocab_size
    )
    elapsed = time.perf_counter() - started
    print(f"trained {vocab_size}-piece SentencePiece tokenizer in {elapsed:.1f} s", flush=True)
    started = time.perf_counter()
    preprocess_jsonl(jsonl, os.path.join(staging, "stdlib"), TOKENIZER_TYPE, model,
                     append_eod=True, verbose=False)
    print(f"tokenized {documents} documents in {time.perf_counter() - started:.1f} s", flush=True)
    os.unlink(jsonl)
    fingerprint = hashlib.sha256()
    for relative, text in sources:
        fingerprint.update(relative.encode("utf-8") + b"\0" + text.encode("utf-8") + b"\0")
    return {
        "files": len(sources),
        "bytes": nbytes,
        "documents": documents,
        "vocab_size": vocab_size,
        "source_sha256": fingerprint.hexdigest(),
        "python": sys.version.split()[0],
    }


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"default corpus {name} must be an integer >= {minimum}, got {value!r}")


def ensure_default_corpus(
    cache_dir: str, vocab_size: int = 4096, max_bytes: int = DEFAULT_MAX_BYTES
) -> tuple[str, str]:
    """Build (once) the stdlib corpus; return ``(data_prefix, sentencepiece_model_path)``.

    Use the model with tokenizer type ``GPTSentencePieceTokenizer``. A second call with the
    same arguments only checks the done-marker. ``max_bytes`` bounds the source text used.
    """
    _check_int("vocab_size", vocab_size, MIN_SENTENCEPIECE_VOCAB)
    _check_int("max_bytes", max_bytes, _MIN_MAX_BYTES)
    final = _corpus_dir(cache_dir, vocab_size, max_bytes)
    marker = os.path.join(final, DONE_MARKER)
    if os.path.isfile(marker):
        return _paths(final)
    parent = os.path.dirname(final)
    try:
        os.makedirs(parent, exist_ok=True)
        built = build_once(f"{final}.lock", lambda: os.path.isfile(marker),
                           lambda: _build_into(final, vocab_size, max_bytes), "the default corpus")
    except OSError as error:
        raise ConfigError(
            f"cannot create the default corpus cache in {parent} ({error});"
            " pass a writable cache dir"
        ) from None
    if built:
        print(f"default corpus ready: {_paths(final)[0]}", flush=True)
    return _paths(final)


def _build_into(final: str, vocab_size: int, max_bytes: int) -> None:
    """Build in a staging folder and rename it to ``final`` (the caller holds the lock)."""
    parent, prefix = os.path.dirname(final), f".staging-{os.path.basename(final)}-"
    for name in os.listdir(parent):  # left by a builder that crashed: nobody else builds now
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    staging = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        info = _build(staging, vocab_size, max_bytes)
        with open(os.path.join(staging, DONE_MARKER), "w", encoding="utf-8") as stream:
            json.dump(info, stream, indent=2)
        os.chmod(staging, 0o755)  # mkdtemp makes it private; the cache may be shared
        if os.path.isdir(final):
            shutil.rmtree(final, ignore_errors=True)  # leftover without a marker: never finished
        os.rename(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
