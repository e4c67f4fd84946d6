"""Synthetic GPT data without files (``--mock-data``), as Megatron-Core's ``MockGPTDataset``.

The low-level dataset holds 100000 documents whose lengths are drawn once (NumPy generator,
seed 0) between 1 and 4095 tokens; document ``i`` of length ``n`` is ``1, 2, ..., n - 1``
(modulo the vocabulary) followed by the tokenizer's eod. The samples are then cut, split
(Megatron uses ``1,1,1`` for mock data) and shuffled by the ordinary :class:`GPTDataset`, with
the run's seed. Indices are cached only when ``--data-cache-path`` is given.
"""

from __future__ import annotations

import numpy as np

from megatron_h2.config import MOCK_SPLIT
from megatron_h2.data.gpt_dataset import (
    SPLIT_NAMES,
    GPTDataset,
    Splits,
    parse_split,
    split_document_ranges,
)
from megatron_h2.errors import ConfigError


class MockLowLevelDataset:
    """Megatron's ``MockGPTLowLevelDataset``: the document store that :class:`GPTDataset`
    reads (``sequence_lengths``, ``get``, ``len``), computed instead of read."""

    seed = 0
    size = 100_000
    max_sequence_length = 4096
    path_prefix = None  # no files

    def __init__(self, vocab_size: int, eod: int) -> None:
        self.vocab_size, self.eod = int(vocab_size), int(eod)
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length, size=self.size,
                                             dtype=np.int32)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        length = int(self.sequence_lengths[idx])
        return np.concatenate([(np.arange(length - 1, dtype=np.int64) + 1) % self.vocab_size,
                               np.array([self.eod], dtype=np.int64)])

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``idx`` (to its end if None)."""
        document = self[idx]
        return document[offset:] if length is None else document[offset:offset + length]

    @property
    def fingerprint(self) -> str:
        """What the cached indices depend on (there is no index file to hash)."""
        return (f"mock-{self.seed}-{self.size}-{self.max_sequence_length}-{self.vocab_size}-"
                f"{self.eod}")


def build_mock_gpt_datasets(vocab_size: int, eod: int, seq_length: int, seed: int,
                            num_samples: tuple[int, int, int],
                            cache_dir: str | None = None) -> Splits:
    """train / valid / test mock datasets (None where no samples are asked for)."""
    if not 0 <= eod < vocab_size:
        raise ConfigError(f"the tokenizer's eod {eod} is outside its vocabulary {vocab_size}")
    documents = MockLowLevelDataset(vocab_size, eod)
    ranges = split_document_ranges(parse_split(MOCK_SPLIT), len(documents))
    return tuple(
        GPTDataset(documents, ranges[i], seq_length, seed, count, name, cache_dir,
                   documents.fingerprint) if count else None
        for i, (name, count) in enumerate(zip(SPLIT_NAMES, num_samples)))


__all__ = ["MockLowLevelDataset", "build_mock_gpt_datasets"]
