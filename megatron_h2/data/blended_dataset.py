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

from megatron_h2.data.build_lock import build_once
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


def atomic_write(path: str, write: Callable[[Any], None], mode: str = "wb") -> None:
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
    check: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> tuple[dict[str, np.ndarray], bool]:
    """Load named arrays from ``cache_dir`` or build and save them; return (arrays, cache_hit).

    Files are ``{hash}-{stem}-{name}.npy`` plus ``{hash}-{stem}-description.json``, where the
    hash covers ``description``. Every file is written atomically and the description is
    written last, so a crash never leaves something that looks like a finished cache. Without
    a ``cache_dir`` the arrays are built and kept in memory only. Loaded arrays go through
    ``check`` (which raises ValueError on values that cannot be right); an unreadable or failing
    cache is rebuilt, with one warning line. The build runs under a file lock
    (``{hash}-{stem}.lock``): processes of several jobs sharing the cache folder build the same
    arrays once, the others wait and load them.
    """
    if cache_dir is None:
        return build(), False
    base = os.path.join(cache_dir, f"{description_hash(description)}-{stem}")
    marker = f"{base}-description.json"
    paths = {name: f"{base}-{name}.npy" for name in names}

    def ready() -> bool:
        return os.path.isfile(marker) and all(os.path.isfile(p) for p in paths.values())

    def load() -> dict[str, np.ndarray] | None:
        try:
            arrays = {name: np.load(path, mmap_mode="r") for name, path in paths.items()}
            if check is not None:
                check(arrays)
            return arrays
        except (OSError, ValueError, EOFError) as error:
            logger.warning("rebuilding unreadable index cache %s (%s)", base, error)
            return None

    if ready() and (arrays := load()) is not None:
        return arrays, True
    built: dict[str, np.ndarray] = {}

    def build_and_save() -> None:
        built.update(build())
        for name, path in paths.items():
            array = built[name]
            atomic_write(path, lambda stream, a=array: np.save(stream, a, allow_pickle=False))
        text = json.dumps(description, sort_keys=True, indent=2)
        atomic_write(marker, lambda stream: stream.write(text), mode="w")

    try:
        os.makedirs(cache_dir, exist_ok=True)
        if os.path.isfile(marker):  # unreadable or failing its check: rebuild it
            os.unlink(marker)
        build_once(f"{base}.lock", ready, build_and_save, f"the index cache {base}",
                   say=logger.warning)
    except OSError as error:
        raise cache_write_error(cache_dir, error) from None
    if built:
        return built, False
    arrays = load()  # another process built it while this one waited
    if arrays is None:
        raise ConfigError(f"the dataset index cache {base} written by another process is "
                          "unreadable; delete it and start again")
    return arrays, True


def cache_write_error(cache_dir: str, error: OSError) -> ConfigError:
    """The one-line error for a dataset cache folder that cannot be written."""
    return ConfigError(f"cannot write the dataset index cache in {cache_dir} "
                       f"({error.strerror or error}); pass a writable cache_dir "
                       "(--data-cache-path)")


def check_index_array(name: str, array: np.ndarray, length: int | None,
                      bound: int | None, ndim: int = 1) -> None:
    """ValueError unless ``array`` is an integer array of ``ndim`` dimensions, ``length`` rows
    (if given) and values in ``[0, bound)`` (if given; else >= 0)."""
    if array.ndim != ndim or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} has shape {array.shape} and dtype {array.dtype}")
    if length is not None and len(array) != length:
        raise ValueError(f"{name} has {len(array)} rows, expected {length}")
    if array.size and (int(array.min()) < 0 or (bound is not None and int(array.max()) >= bound)):
        raise ValueError(f"{name} has values outside [0, {bound})")


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
            ("dataset_index", "dataset_sample_index"), self._build, self._check,
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

    def _check(self, arrays: dict[str, np.ndarray]) -> None:
        """ValueError unless cached blend arrays fit this blend (shape, range)."""
        which, within = arrays["dataset_index"], arrays["dataset_sample_index"]
        check_index_array("dataset_index", which, self.size, len(self.datasets))
        check_index_array("dataset_sample_index", within, self.size, None)
        for k, dataset in enumerate(self.datasets):
            mine = within[which == k]
            if mine.size and (int(mine.min()) < 0 or int(mine.max()) >= len(dataset)):
                raise ValueError(f"dataset_sample_index points outside dataset {k}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for {self.size} samples")
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]
