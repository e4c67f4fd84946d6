"""Blend several GPT datasets by weight, plus the on-disk cache shared by all index arrays.

The blend follows Megatron-Core's ``build_blending_indices`` rule: sample ``i`` comes from
the dataset whose share is most behind, i.e. ``argmax_k(w_k * max(i, 1) - count_k)`` with
ties going to the lowest ``k``. The result is deterministic and needs no RNG.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from megatron_h2.errors import ConfigError

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
MID_LEVEL_SURPLUS = 0.005
"""Extra share of samples each blended component builds (Megatron's 0.5% margin)."""


class SampleDataset(Protocol):
    """What a blended component provides."""

    description: dict[str, Any]
    cache_dir: str

    def __len__(self) -> int: ...

    def __getitem__(self, idx: int) -> np.ndarray: ...


def description_hash(description: dict[str, Any]) -> str:
    """Stable short hash of a JSON-able description."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _atomic_write(path: str, write: Callable[[Any], None], mode: str = "wb") -> None:
    """Write via a temp file in the same folder and rename it over ``path``."""
    folder = os.path.dirname(path)
    handle, temp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=folder)
    try:
        with os.fdopen(handle, mode) as stream:
            write(stream)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise


def cached_arrays(
    cache_dir: str | None,
    stem: str,
    description: dict[str, Any],
    names: Sequence[str],
    build: Callable[[], dict[str, np.ndarray]],
) -> tuple[dict[str, np.ndarray], bool]:
    """Load named arrays from ``cache_dir`` or build and save them; return (arrays, cache_hit).

    Files are ``{hash}-{stem}-{name}.npy`` plus ``{hash}-{stem}-description.json``, where the
    hash covers ``description``. Every file is written atomically and the description is
    written last, so a crash never leaves something that looks like a finished cache. Without
    a ``cache_dir`` the arrays are built and kept in memory only.
    """
    if cache_dir is None:
        return build(), False
    base = os.path.join(cache_dir, f"{description_hash(description)}-{stem}")
    marker = f"{base}-description.json"
    paths = {name: f"{base}-{name}.npy" for name in names}
    if os.path.isfile(marker) and all(os.path.isfile(p) for p in paths.values()):
        try:
            return {name: np.load(path, mmap_mode="r") for name, path in paths.items()}, True
        except (OSError, ValueError) as error:
            logger.warning("rebuilding unreadable index cache %s (%s)", base, error)
    arrays = build()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for name, path in paths.items():
            array = arrays[name]
            _atomic_write(path, lambda stream, a=array: np.save(stream, a, allow_pickle=False))
        text = json.dumps(description, sort_keys=True, indent=2)
        _atomic_write(marker, lambda stream: stream.write(text), mode="w")
    except OSError as error:
        raise ConfigError(
            f"cannot write the dataset index cache in {cache_dir} ({error.strerror or error}); "
            f"pass a writable cache_dir (--data-cache-path)"
        ) from None
    return arrays, False


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample dataset id (int16) and sample id within that dataset (int64).

    Greedy error minimisation: at step ``i`` choose ``argmax_k(w_k * max(i, 1) - count_k)``.
    """
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    choice: list[int] = []
    within: list[int] = []
    if len(w) == 1:
        return np.zeros(size, np.int16), np.arange(size, dtype=np.int64)
    others = range(1, len(w))
    for i in range(size):
        x = float(i) if i > 0 else 1.0
        best, best_error = 0, w[0] * x - counts[0]
        for k in others:
            error = w[k] * x - counts[k]
            if error > best_error:
                best, best_error = k, error
        choice.append(best)
        within.append(counts[best])
        counts[best] += 1
    return np.array(choice, dtype=np.int16), np.array(within, dtype=np.int64)


def component_sizes(
    weights: Sequence[float], size: int, surplus: float = MID_LEVEL_SURPLUS
) -> list[int]:
    """Samples each component builds to cover its share of ``size`` with a small margin."""
    return [int(math.ceil(math.ceil(size * w) * (1.0 + surplus))) for w in weights]


class BlendedDataset:
    """Interleave datasets by normalised ``weights``; ``len`` is exactly ``size``.

    ``dataset[i]`` returns the sample of the chosen component (a numpy int64 array).
    ``dataset_index``/``dataset_sample_index`` expose the blend; ``built_from_cache`` says
    whether they were loaded from the cache.

    Args:
        datasets: components, each long enough for its share (see :func:`component_sizes`).
        weights: positive weights, one per component (normalised here).
        size: number of samples.
        cache_dir: where to cache the blend (default: the first component's cache folder).
    """

    def __init__(
        self,
        datasets: Sequence[SampleDataset],
        weights: Sequence[float],
        size: int,
        cache_dir: str | None = None,
    ) -> None:
        if not datasets or len(datasets) != len(weights):
            raise ConfigError(
                f"BlendedDataset needs one weight per dataset, got {len(weights)} weights for "
                f"{len(datasets)} datasets"
            )
        if len(datasets) >= 32767:
            raise ConfigError(f"cannot blend {len(datasets)} datasets; the limit is 32766")
        if any(not math.isfinite(w) or w <= 0 for w in weights):
            raise ConfigError(f"blend weights must be positive numbers, got {list(weights)}")
        if int(size) < 1:
            raise ConfigError(f"BlendedDataset size must be >= 1, got {size}")
        total = float(sum(weights))
        self.datasets = list(datasets)
        self.weights = [float(w) / total for w in weights]
        self.size = int(size)
        self.cache_dir = cache_dir or self.datasets[0].cache_dir
        self.description = {
            "class": "BlendedDataset",
            "format": CACHE_FORMAT_VERSION,
            "datasets": [d.description for d in self.datasets],
            "weights": self.weights,
            "size": self.size,
        }
        started = time.perf_counter()
        arrays, self.built_from_cache = cached_arrays(
            self.cache_dir, "BlendedDataset", self.description,
            ("dataset_index", "dataset_sample_index"), self._build,
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        logger.info(
            "%s BlendedDataset of %d datasets: %d samples (%.2f s)",
            "loaded" if self.built_from_cache else "built", len(self.datasets), self.size,
            time.perf_counter() - started,
        )

    def _build(self) -> dict[str, np.ndarray]:
        dataset_index, sample_index = build_blending_indices(self.weights, self.size)
        counts = np.bincount(dataset_index, minlength=len(self.datasets))
        for k, (count, dataset) in enumerate(zip(counts, self.datasets)):
            if count > len(dataset):
                raise RuntimeError(
                    f"blend needs {count} samples from dataset {k} but it has {len(dataset)}; "
                    f"build components with component_sizes()"
                )
        return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for {self.size} samples")
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]
