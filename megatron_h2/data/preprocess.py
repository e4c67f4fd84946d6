"""Tokenize a jsonl corpus into Megatron ``{prefix}_{key}_document.bin/.idx`` files.

The input is cut into ``workers`` contiguous line ranges; each worker process writes a
partial dataset and the parts are merged in order with ``IndexedDatasetBuilder.add_index``,
so the output is byte-identical for any worker count.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_h2.data.indexed_dataset import (
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
    optimal_dtype,
)
from megatron_h2.data.tokenizer import Tokenizer, build_tokenizer, parse_json_object
from megatron_h2.errors import ConfigError

_COUNT_BLOCK = 1 << 24


@dataclass(frozen=True)
class _Job:
    """One worker's share of the input: bytes ``[start, end)`` beginning at line ``first_line``."""

    input_path: str
    start: int
    end: int
    first_line: int
    part_prefix: str
    json_keys: tuple[str, ...]
    tokenizer_type: str
    tokenizer_model: str | None
    vocab_size: int | None
    tokenizer_options: dict
    append_eod: bool
    dtype: str
    log_interval: int
    worker: int | None


@dataclass
class _JobResult:
    lines: int = 0
    documents: int = 0
    empty: int = 0
    tokens: int = 0


def output_prefix_for_key(output_prefix: str, key: str) -> str:
    """Megatron's output naming: ``{output_prefix}_{key}_document``."""
    return f"{output_prefix}_{key}_document"


def _split_ranges(path: str, parts: int) -> list[tuple[int, int, int]]:
    """Cut a file into ``parts`` byte ranges on line starts: ``(start, end, first_line)``."""
    size = os.path.getsize(path)
    cuts = [0]
    with open(path, "rb") as stream:
        for k in range(1, parts):
            target = max(size * k // parts, cuts[-1])
            if target > 0:
                stream.seek(target - 1)
                stream.readline()
                target = stream.tell()
            cuts.append(max(target, cuts[-1]))
        cuts.append(size)
        first_lines, position, newlines = [], 0, 0
        for cut in cuts[:-1]:
            stream.seek(position)
            while position < cut:
                block = stream.read(min(_COUNT_BLOCK, cut - position))
                newlines += block.count(b"\n")
                position += len(block)
            first_lines.append(newlines + 1)
    return [(cuts[i], cuts[i + 1], first_lines[i]) for i in range(parts)]


def _document_texts(job: _Job, number: int, raw: bytes) -> dict[str, str] | None:
    """Texts per json key of one input line, or None for a blank line."""
    where = f"{job.input_path}:{number}"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(
            f"{where}: line is not valid UTF-8; re-encode the input as UTF-8"
        ) from None
    if not line.strip():
        return None
    record = parse_json_object(line, where)
    texts = {}
    for key in job.json_keys:
        if key not in record:
            raise ConfigError(
                f"{where}: JSON object has no key {key!r} (keys: {sorted(record)[:8]}); "
                f"pass the right --json-keys"
            )
        if not isinstance(record[key], str):
            kind = type(record[key]).__name__
            raise ConfigError(f"{where}: value of {key!r} is {kind}, expected a string")
        texts[key] = record[key]
    return texts


def _log_progress(job: _Job, count: int, started: float, nbytes: int) -> None:
    elapsed = max(time.perf_counter() - started, 1e-9)
    tag = "" if job.worker is None else f"[worker {job.worker}] "
    print(
        f"{tag}processed {count} documents ({count / elapsed:.1f} docs/s, "
        f"{nbytes / elapsed / 2**20:.2f} MB/s)",
        file=sys.stderr,
        flush=True,
    )


def _encode(tokenizer: Tokenizer, text: str, append_eod: bool) -> list[int]:
    ids = tokenizer.tokenize(text)
    if ids and append_eod:
        ids.append(tokenizer.eod)
    return ids


def _run_job(job: _Job) -> _JobResult:
    """Tokenize one byte range into ``{part_prefix}_{key}_document`` files."""
    tokenizer = build_tokenizer(job.tokenizer_type, job.tokenizer_model, job.vocab_size,
                                **job.tokenizer_options)
    builders = {
        key: IndexedDatasetBuilder(
            get_bin_path(output_prefix_for_key(job.part_prefix, key)), np.dtype(job.dtype)
        )
        for key in job.json_keys
    }
    try:
        result = _tokenize_range(job, tokenizer, builders)
    except BaseException:
        for builder in builders.values():
            builder.close()
        raise
    for key, builder in builders.items():
        builder.finalize(get_idx_path(output_prefix_for_key(job.part_prefix, key)))
    return result


def _tokenize_range(
    job: _Job, tokenizer: Tokenizer, builders: dict[str, IndexedDatasetBuilder]
) -> _JobResult:
    """Feed the documents of the job's byte range into the builders."""
    result, started, position, number = _JobResult(), time.perf_counter(), job.start, job.first_line
    with open(job.input_path, "rb") as stream:
        stream.seek(job.start)
        while position < job.end:
            raw = stream.readline()
            if not raw:
                break
            texts = _document_texts(job, number, raw)
            position, number = position + len(raw), number + 1
            if texts is None:
                continue
            for key, text in texts.items():
                ids = _encode(tokenizer, text, job.append_eod)
                if not ids:
                    result.empty += 1
                    continue
                builders[key].add_item(ids)
                builders[key].end_document()
                result.documents += 1
                result.tokens += len(ids)
            result.lines += 1
            if job.log_interval and result.lines % job.log_interval == 0:
                _log_progress(job, result.lines, started, position - job.start)
    return result


def _validate(input_path: str, json_keys: Sequence[str], workers: int, log_interval: int) -> None:
    if not os.path.isfile(input_path):
        raise ConfigError(
            f"--input {input_path} not found; pass a jsonl file with one JSON object per line"
        )
    if not json_keys or any(not isinstance(k, str) or not k for k in json_keys):
        raise ConfigError(
            f"--json-keys {list(json_keys)} is invalid; pass one or more key names, e.g. text"
        )
    if len(set(json_keys)) != len(json_keys):
        raise ConfigError(f"--json-keys {list(json_keys)} repeats a key; list each key once")
    if int(workers) < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    if int(log_interval) < 0:
        raise ConfigError(f"--log-interval must be >= 0, got {log_interval}")


def _merge_parts(
    jobs: list[_Job], key: str, dtype: np.dtype, output_prefix: str, scratch: str
) -> str:
    """Merge the per-worker parts of one key in order; atomically move into place."""
    final = output_prefix_for_key(output_prefix, key)
    parts = [output_prefix_for_key(job.part_prefix, key) for job in jobs]
    merged = parts[0]
    if len(parts) > 1:
        merged = os.path.join(scratch, f"merged_{key}_document")
        builder = IndexedDatasetBuilder(get_bin_path(merged), dtype)
        for part in parts:
            builder.add_index(part)
        builder.finalize(get_idx_path(merged))
    os.replace(get_bin_path(merged), get_bin_path(final))
    os.replace(get_idx_path(merged), get_idx_path(final))
    return final


def preprocess_jsonl(
    input_path: str,
    output_prefix: str,
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    log_interval: int = 1000,
    verbose: bool = True,
    tokenizer_options: dict | None = None,
) -> dict[str, str]:
    """Tokenize ``input_path`` (jsonl) into one Megatron dataset per json key.

    Returns ``{key: dataset_prefix}`` with prefixes ``{output_prefix}_{key}_document``.
    Documents that tokenize to nothing are skipped (no empty sequences are written). With
    ``append_eod`` the tokenizer's eod id ends every document. Token dtype follows Megatron
    (uint16 below 65500 ids, else int32). Errors in the input raise a one-line ConfigError
    naming the line number; no output files are left behind. ``tokenizer_options`` are the
    further keyword arguments of :func:`build_tokenizer` (``vocab_file``, ``merge_file``, ...).
    """
    json_keys = tuple(json_keys)
    tokenizer_options = dict(tokenizer_options or {})
    _validate(input_path, json_keys, workers, log_interval)
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model, vocab_size, **tokenizer_options)
    dtype = np.dtype(optimal_dtype(tokenizer.vocab_size))
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".preprocess-", dir=out_dir)
    started = time.perf_counter()
    try:
        jobs = [
            _Job(input_path, start, end, first, os.path.join(scratch, f"part{i:05d}"), json_keys,
                 tokenizer_type, tokenizer_model, vocab_size, tokenizer_options, append_eod,
                 dtype.name,
                 log_interval if verbose else 0, None if workers == 1 else i)
            for i, (start, end, first) in enumerate(_split_ranges(input_path, int(workers)))
        ]
        if len(jobs) == 1:
            results = [_run_job(jobs[0])]
        else:
            with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
                results = pool.map(_run_job, jobs, chunksize=1)
        outputs = {key: _merge_parts(jobs, key, dtype, output_prefix, scratch) for key in json_keys}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if verbose:
        lines = sum(r.lines for r in results)
        documents = sum(r.documents for r in results)
        tokens = sum(r.tokens for r in results)
        empty = sum(r.empty for r in results)
        skipped = f", {empty} empty skipped" if empty else ""
        names = ", ".join(f"{p}.bin/.idx" for p in outputs.values())
        print(
            f"wrote {names}: {lines} lines -> {documents} documents{skipped}, {tokens} tokens "
            f"({dtype.name}) in {time.perf_counter() - started:.1f} s",
            flush=True,
        )
    return outputs
