"""GPT pretraining samples over Megatron indexed datasets, with splits and blending.

Semantics follow Megatron-Core's ``GPTDataset``: the split's documents (sequences of the
indexed dataset) are repeated for as many epochs as ``num_samples`` needs, the token stream
is cut into samples of ``seq_length + 1`` tokens that overlap by one token and cross document
boundaries, and samples are served in a shuffled order. Differences from Megatron: each
epoch is a separate permutation of the documents (Megatron shuffles all but a short final
epoch together), the final epoch's samples are always shuffled separately, and ``len`` is
exactly ``num_samples``.

The three index arrays are cached as ``.npy`` files (see :func:`cached_arrays`) under
``cache/`` next to the data prefix unless ``cache_dir`` says otherwise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron_h2.data.blended_dataset import (
    CACHE_FORMAT_VERSION,
    BlendedDataset,
    atomic_write,
    cache_write_error,
    cached_arrays,
    check_index_array,
    component_sizes,
    description_hash,
)
from megatron_h2.data.indexed_dataset import (
    IndexedDataset,
    check_data_prefix,
    get_bin_path,
    get_idx_path,
)
from megatron_h2.errors import ConfigError

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
_MAX_SEED = 2**32 - 1


def parse_split(split: str) -> list[float]:
    """Parse ``"949,50,1"``-style weights into three normalised shares (missing ones are 0).

    As Megatron's parser, only the numbers count: ``'99,1,0'`` arriving with its quotes, or
    ``"969, 30, 1"`` with spaces, are read alike; a minus sign is an error.
    """
    hint = "use up to three comma-separated non-negative weights like '949,50,1'"
    if not isinstance(split, str) or not split.strip():
        raise ConfigError(f"--split {split!r} is empty; {hint}")
    if "-" in split:
        raise ConfigError(f"--split {split!r} has a negative weight; {hint}")
    parts = re.findall(r"[.0-9]+", split)
    if not parts or re.sub(r"[.0-9\s,'\"/:]", "", split):
        raise ConfigError(f"--split {split!r} is not a list of numbers; {hint}")
    if len(parts) > 3:
        raise ConfigError(f"--split {split!r} has {len(parts)} parts (3 at most); {hint}")
    try:
        values = [float(part) for part in parts]
    except ValueError:
        raise ConfigError(f"--split {split!r} is not a list of numbers; {hint}") from None
    if any(not math.isfinite(v) for v in values) or sum(values) <= 0:
        raise ConfigError(
            f"--split {split!r} needs non-negative weights with a positive sum; {hint}"
        )
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_document_ranges(
    shares: Sequence[float], num_documents: int
) -> list[tuple[int, int] | None]:
    """Megatron's book-ends: split ``i`` gets ``[round(lo * N), round(hi * N))``.

    None for a split whose share is 0.
    """
    ranges: list[tuple[int, int] | None] = []
    low = 0.0
    for share in shares:
        high = low + share
        if share <= 0:
            ranges.append(None)
        else:
            ranges.append((int(round(low * num_documents)), int(round(high * num_documents))))
        low = high
    return ranges


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_data_path(data_path: Sequence[str]) -> list[tuple[float, str]]:
    """Parse Megatron's ``--data-path`` list into ``[(normalised_weight, prefix), ...]``.

    Accepts ``["prefixA", "prefixB"]`` (equal weights here; the datasets weigh them by size, see
    :func:`weights_given`) or ``["0.3", "prefixA", "0.7", "prefixB"]``.
    """
    hint = "use 'PREFIX [PREFIX ...]' or 'WEIGHT PREFIX [WEIGHT PREFIX ...]'"
    if isinstance(data_path, str) or not data_path:
        raise ConfigError(f"--data-path {data_path!r} must be a non-empty list; {hint}")
    items = [str(item).strip() for item in data_path]
    if any(not item for item in items):
        raise ConfigError(f"--data-path {list(data_path)} has an empty entry; {hint}")
    numeric = [_is_number(item) for item in items]
    if not any(numeric):
        return [(1.0 / len(items), item) for item in items]
    pairs_ok = len(items) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2])
    if not pairs_ok:
        raise ConfigError(f"--data-path {items} mixes weights and prefixes out of order; {hint}")
    weights = [float(item) for item in items[0::2]]
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ConfigError(f"--data-path weights {weights} must be positive numbers; {hint}")
    total = sum(weights)
    return [(w / total, prefix) for w, prefix in zip(weights, items[1::2])]


def weights_given(data_path: Sequence[str]) -> bool:
    """Whether a ``--data-path``-style list gives weights; without them Megatron blends the
    prefixes by their sizes (the samples of one epoch of each prefix's split)."""
    return any(_is_number(str(item).strip()) for item in data_path)


def index_fingerprint(path_prefix: str) -> str:
    """Hash of the ``.idx`` file; GPT indices depend only on it (lengths), not on the tokens."""
    digest = hashlib.blake2b(digest_size=16)
    with open(get_idx_path(path_prefix), "rb") as stream:
        for block in iter(lambda: stream.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _default_cache_dir(prefix: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")


def check_token_ids(prefix: str, vocab_size: int, cache_dir: str | None = None,
                    tokenizer: str = "the tokenizer") -> None:
    """Fail with one line if ``prefix``'s ``.bin`` holds a token id outside ``[0, vocab_size)``.

    The scan (a vectorised min / max over the memory map) runs once per corpus: its result is
    cached beside the dataset indices, keyed by the ``.idx`` fingerprint and the ``.bin`` size and
    modification time.
    """
    bin_path = get_bin_path(prefix)
    stat = os.stat(bin_path)
    key = {"class": "TokenRange", "prefix": os.path.basename(prefix),
           "index_fingerprint": index_fingerprint(prefix), "bin_bytes": stat.st_size,
           "bin_mtime_ns": stat.st_mtime_ns}
    folder = cache_dir or _default_cache_dir(prefix)
    path = os.path.join(folder, f"{description_hash(key)}-token_range.json")
    found = None
    try:
        with open(path) as stream:
            cached = json.load(stream)
        if cached.get("key") == key and all(
                isinstance(cached.get(k), int) for k in ("low", "high")):
            found = (cached["low"], cached["high"])
    except (OSError, ValueError, AttributeError):
        pass
    if found is None:
        dataset = IndexedDataset(prefix)
        found = dataset.token_range() or (0, -1)
        dataset.close()
        text = json.dumps({"key": key, "low": found[0], "high": found[1]})
        try:
            os.makedirs(folder, exist_ok=True)
            atomic_write(path, lambda stream: stream.write(text), mode="w")
        except OSError as error:
            raise cache_write_error(folder, error) from None
    low, high = found
    if low < 0:
        raise ConfigError(f"dataset {prefix} holds the negative token id {low}; the data is "
                          f"corrupt, regenerate it with tools/preprocess_data.py")
    if high >= vocab_size:
        raise ConfigError(
            f"dataset {prefix} holds token id {high} but {tokenizer} has {vocab_size} ids "
            f"(0..{vocab_size - 1}); preprocess the data with this tokenizer, or pass the "
            f"tokenizer (--tokenizer-model / --vocab-size) it was made with"
        )


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState
) -> np.ndarray:
    """Documents of every epoch in order, each epoch an independent permutation (int32)."""
    epochs = [rng.permutation(documents) for _ in range(num_epochs)]
    return np.concatenate(epochs).astype(np.int32)


def build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int
) -> np.ndarray:
    """``(num_samples + 1, 2)`` int64 rows ``(document_index position, token offset)``.

    Row ``j`` is where sample ``j`` starts, i.e. stream position ``j * seq_length``; sample
    ``j`` ends with (and includes) the token at row ``j + 1``.
    """
    lengths = sequence_lengths[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    positions = np.searchsorted(ends, starts, side="right")
    offsets = starts - (ends[positions] - lengths[positions])
    return np.stack([positions.astype(np.int64), offsets], axis=1)


def build_shuffle_index(first_block: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of ``[0, first_block)`` followed by a permutation of ``[first_block, total)``."""
    head = rng.permutation(np.arange(first_block, dtype=np.int64))
    tail = rng.permutation(np.arange(first_block, total, dtype=np.int64))
    return np.concatenate([head, tail])


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{name} must be {bound}, got {value}")
    return int(value)


class GPTDataset:
    """Shuffled ``seq_length + 1`` token samples from a document range of an IndexedDataset.

    ``dataset[i]`` is a ``numpy.int64`` array of shape ``(seq_length + 1,)``; inputs are
    ``[:-1]`` and labels ``[1:]``. ``built_from_cache`` says whether the indices were loaded.

    Args:
        indexed_dataset: the tokens.
        document_range: ``(begin, end)`` sequence indices of this split.
        seq_length: tokens per training sample (each sample holds one more).
        seed: seed of the numpy RandomState that shuffles documents and samples.
        num_samples: number of samples (``len``); documents repeat as needed.
        split_name: "train", "valid" or "test" (part of the cache key and messages).
        cache_dir: index cache folder; default ``cache/`` beside the data prefix (none for a
            dataset without files, whose ``path_prefix`` is None: the indices stay in memory).
        fingerprint: precomputed :func:`index_fingerprint` of the data (optional).
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        document_range: tuple[int, int],
        seq_length: int,
        seed: int,
        num_samples: int,
        split_name: str = "train",
        cache_dir: str | None = None,
        fingerprint: str | None = None,
    ) -> None:
        self.indexed_dataset = indexed_dataset
        self.seq_length = _check_int("seq_length", seq_length, 1)
        self.seed = _check_int("seed", seed, 0, _MAX_SEED)
        self.num_samples = _check_int("num_samples", num_samples, 1)
        self.split_name = split_name
        prefix = indexed_dataset.path_prefix
        begin, end = (int(x) for x in document_range)
        if not 0 <= begin < end <= len(indexed_dataset):
            raise ConfigError(
                f"the {split_name} split of {prefix} has documents [{begin}, {end}) out of "
                f"{len(indexed_dataset)}; give the split a larger share or use more documents"
            )
        self.document_range = (begin, end)
        self.tokens_per_epoch = int(indexed_dataset.sequence_lengths[begin:end].sum(dtype=np.int64))
        if self.tokens_per_epoch < 1:
            raise ConfigError(
                f"the {split_name} split of {prefix} has no tokens; check the data or the split"
            )
        needed = self.num_samples * self.seq_length + 1
        self.num_epochs = -(-needed // self.tokens_per_epoch)
        self.cache_dir = cache_dir or (None if prefix is None else _default_cache_dir(prefix))
        self.description = {
            "class": "GPTDataset",
            "format": CACHE_FORMAT_VERSION,
            "prefix": os.path.basename(prefix or "mock"),
            "index_fingerprint": fingerprint or index_fingerprint(prefix),
            "split": split_name,
            "document_range": [begin, end],
            "seq_length": self.seq_length,
            "seed": self.seed,
            "num_samples": self.num_samples,
        }
        started = time.perf_counter()
        arrays, self.built_from_cache = cached_arrays(
            self.cache_dir, f"GPTDataset-{split_name}", self.description,
            ("document_index", "sample_index", "shuffle_index"), self._build_indices,
            self._check_indices,
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        logger.info(
            "%s GPTDataset %s indices for %s: %d samples, %d epochs (%.2f s)",
            "loaded" if self.built_from_cache else "built", split_name, prefix,
            self.num_samples, self.num_epochs, time.perf_counter() - started,
        )

    def _build_indices(self) -> dict[str, np.ndarray]:
        rng = np.random.RandomState(self.seed)
        documents = np.arange(*self.document_range, dtype=np.int32)
        document_index = build_document_index(documents, self.num_epochs, rng)
        stream_tokens = self.num_epochs * self.tokens_per_epoch
        num_built = (stream_tokens - 1) // self.seq_length
        sample_index = build_sample_index(
            self.indexed_dataset.sequence_lengths, document_index, self.seq_length, num_built
        )
        first_block = 0
        if self.num_epochs > 1:
            first_block = ((self.num_epochs - 1) * self.tokens_per_epoch - 1) // self.seq_length
        shuffle_index = build_shuffle_index(first_block, num_built, rng)[: self.num_samples]
        return {
            "document_index": document_index,
            "sample_index": sample_index,
            "shuffle_index": shuffle_index,
        }

    def _check_indices(self, arrays: dict[str, np.ndarray]) -> None:
        """ValueError unless cached indices fit this split (shapes, dtypes, value ranges), so a
        damaged cache is rebuilt instead of serving out-of-range samples."""
        begin, end = self.document_range
        documents, samples = arrays["document_index"], arrays["sample_index"]
        check_index_array("document_index", documents, None, end)
        if documents.size and int(documents.min()) < begin:
            raise ValueError(f"document_index has documents outside [{begin}, {end})")
        check_index_array("sample_index", samples, None, None, ndim=2)
        if samples.shape[1] != 2 or len(samples) < 2 or np.any(np.diff(samples[:, 0]) < 0):
            raise ValueError("sample_index rows are not increasing (position, offset) pairs")
        check_index_array("sample_index positions", samples[:, 0], None, len(documents))
        lengths = self.indexed_dataset.sequence_lengths[documents[samples[:, 0]]]
        if np.any(samples[:, 1] >= np.maximum(lengths, 1)):
            raise ValueError("sample_index has offsets beyond their documents")
        check_index_array("shuffle_index", arrays["shuffle_index"], self.num_samples,
                          len(samples) - 1)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> np.ndarray:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} samples")
        sample = int(self.shuffle_index[idx])
        first_pos, first_offset = (int(x) for x in self.sample_index[sample])
        last_pos, last_offset = (int(x) for x in self.sample_index[sample + 1])
        get = self.indexed_dataset.get
        if first_pos == last_pos:
            document = int(self.document_index[first_pos])
            return get(document, first_offset, last_offset - first_offset + 1).astype(np.int64)
        parts = [get(int(self.document_index[first_pos]), first_offset)]
        parts += [get(int(self.document_index[p])) for p in range(first_pos + 1, last_pos)]
        parts.append(get(int(self.document_index[last_pos]), 0, last_offset + 1))
        return np.concatenate(parts).astype(np.int64)


def _check_num_samples(num_samples: Sequence[int]) -> tuple[int, int, int]:
    if isinstance(num_samples, (str, bytes)) or len(num_samples) != 3:
        raise ConfigError(
            f"num_samples must be (train, valid, test) sample counts, got {num_samples!r}"
        )
    train, valid, test = (_check_int(f"{name} num_samples", n, 0)
                          for name, n in zip(SPLIT_NAMES, num_samples))
    return train, valid, test


def _checked(seq_length: int, seed: int, num_samples: Sequence[int]
             ) -> tuple[int, int, tuple[int, int, int]]:
    return (_check_int("seq_length", seq_length, 1), _check_int("seed", seed, 0, _MAX_SEED),
            _check_num_samples(num_samples))


Splits = tuple[GPTDataset | BlendedDataset | None, GPTDataset | BlendedDataset | None,
               GPTDataset | BlendedDataset | None]


def _open_blend(data_path: Sequence[str], mmap_bin_files: bool
                ) -> tuple[list[tuple[float, str]], dict[str, tuple[IndexedDataset, str]]]:
    """The blend of a ``--data-path``-style list and each prefix's dataset and fingerprint."""
    blend = parse_data_path(data_path)
    for _, prefix in blend:
        check_data_prefix(prefix)
    return blend, {prefix: (IndexedDataset(prefix, mmap=mmap_bin_files),
                            index_fingerprint(prefix)) for _, prefix in blend}


def _split_dataset(blend: list[tuple[float, str]],
                   opened: dict[str, tuple[IndexedDataset, str]],
                   ranges: dict[str, tuple[int, int]], name: str, count: int, seq_length: int,
                   seed: int, cache_dir: str | None, by_size: bool) -> GPTDataset | BlendedDataset:
    """One split: a GPTDataset per prefix over its document range, blended by weight, or with
    ``by_size`` by the samples one epoch of each prefix's range holds (Megatron's blend of
    prefixes given without weights)."""
    weights = [w for w, _ in blend]
    if by_size and len(blend) > 1:
        samples = [max(1, (int(opened[prefix][0].sequence_lengths[slice(*ranges[prefix])]
                                .sum(dtype=np.int64)) - 1) // seq_length) for _, prefix in blend]
        weights = [n / sum(samples) for n in samples]
    sizes = [count] if len(blend) == 1 else component_sizes(weights, count)
    parts = [GPTDataset(opened[prefix][0], ranges[prefix], seq_length, seed, size, name,
                        cache_dir, opened[prefix][1])
             for (_, prefix), size in zip(blend, sizes)]
    return parts[0] if len(parts) == 1 else BlendedDataset(parts, weights, count, cache_dir)


def build_gpt_datasets(
    data_path: list[str],
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | None = None,
    mmap_bin_files: bool = True,
) -> Splits:
    """train/valid/test; None where the split share or num_samples is 0.

    ``data_path`` is Megatron's ``--data-path`` list (see :func:`parse_data_path`); with
    several prefixes every split is a :class:`BlendedDataset` of per-prefix GPTDatasets
    cut by the same ``split``. All inputs are validated (one-line ConfigError) before any
    index is built, including a split that is requested (samples > 0, share > 0) but whose
    share rounds to 0 documents of some prefix. ``mmap_bin_files=False`` reads the ``.bin``
    files without memory maps (``--no-mmap-bin-files``).
    """
    shares = parse_split(split)
    seq_length, seed, counts = _checked(seq_length, seed, num_samples)
    blend, opened = _open_blend(data_path, mmap_bin_files)
    ranges = {prefix: split_document_ranges(shares, len(ds)) for prefix, (ds, _) in opened.items()}
    for i, name in enumerate(SPLIT_NAMES):
        if counts[i] and shares[i] > 0:
            for prefix, per_split in ranges.items():
                begin, end = per_split[i]
                if end <= begin:
                    raise ConfigError(
                        f"--split {split!r} leaves the {name} split of {prefix} with 0 of its "
                        f"{len(opened[prefix][0])} documents; give {name} a larger share or "
                        f"request 0 {name} samples"
                    )
    return tuple(
        _split_dataset(blend, opened, {p: r[i] for p, r in ranges.items()}, name, counts[i],
                       seq_length, seed, cache_dir, not weights_given(data_path))
        if counts[i] and shares[i] > 0 else None
        for i, name in enumerate(SPLIT_NAMES))


def build_per_split_datasets(
    paths: Sequence[Sequence[str]],
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | None = None,
    mmap_bin_files: bool = True,
) -> Splits:
    """Megatron's ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``: each
    split is its own blend (the ``--data-path`` format) of whole datasets, no ``--split``;
    None where a split has no path or no samples."""
    seq_length, seed, counts = _checked(seq_length, seed, num_samples)
    results: list[GPTDataset | BlendedDataset | None] = []
    for path, count, name in zip(paths, counts, SPLIT_NAMES):
        if not path or not count:
            results.append(None)
            continue
        blend, opened = _open_blend(path, mmap_bin_files)
        whole = {prefix: (0, len(ds)) for prefix, (ds, _) in opened.items()}
        results.append(_split_dataset(blend, opened, whole, name, count, seq_length, seed,
                                      cache_dir, not weights_given(path)))
    return results[0], results[1], results[2]
