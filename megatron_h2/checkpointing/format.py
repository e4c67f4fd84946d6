"""On-disk checkpoint format: safetensors parts plus one JSON metadata file.

Layout of a save directory::

    SAVE/latest_checkpointed_iteration.txt     # "120": the newest complete checkpoint
    SAVE/iter_0000120/model_00000.safetensors  # full (unsharded) tensors keyed by global name
    SAVE/iter_0000120/optim_00000.safetensors  # optimizer state keyed "<param name>.<state>"
    SAVE/iter_0000120/metadata.json            # iteration, config, RNG states, part sizes

Every tensor is stored whole under its global parameter name, so a checkpoint does not depend on
the layout it was saved under. A checkpoint may be split into several parts (one per writer);
loading merges them. Nothing is ever unpickled: tensors come from safetensors and everything
else from JSON.

Saving writes into a temporary directory and renames it into place, then updates the
``latest`` file by rename, so a crash mid-save leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_h2.errors import ConfigError

FORMAT_VERSION = 1
LATEST_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"


@dataclass
class Checkpoint:
    """A loaded checkpoint: tensors by global name, and its JSON metadata."""

    iteration: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


def iteration_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    return Path(save_dir) / f"iter_{iteration:07d}"


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def incomplete_dir(save_dir: str | os.PathLike, iteration: int) -> Path:
    """The temporary directory that a save of ``iteration`` is written into."""
    return Path(save_dir) / f".iter_{iteration:07d}.incomplete"


def begin_save(save_dir: str | os.PathLike, iteration: int) -> Path:
    """Create (and return) the temporary directory that writers fill before :func:`commit_save`."""
    tmp = incomplete_dir(save_dir, iteration)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def write_part(tmp_dir: Path, kind: str, part: int, tensors: dict[str, torch.Tensor]) -> str:
    """Write one safetensors part (``kind`` is ``model`` or ``optim``); returns its file name."""
    name = f"{kind}_{part:05d}.safetensors"
    contiguous = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(contiguous, str(tmp_dir / name), metadata={"format": "pt"})
    return name


def commit_save(save_dir: str | os.PathLike, tmp_dir: Path, iteration: int,
                metadata: dict[str, Any]) -> Path:
    """Write metadata (with every part's size), move the directory into place, update latest."""
    parts = {p.name: p.stat().st_size for p in sorted(tmp_dir.glob("*.safetensors"))}
    meta = dict(metadata, format_version=FORMAT_VERSION, iteration=iteration, parts=parts)
    _write_text_atomic(tmp_dir / METADATA_FILE, json.dumps(meta, indent=1, sort_keys=True))
    final = iteration_dir(save_dir, iteration)
    if final.exists():  # re-saving the same iteration: keep the old one until the new is in place
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp_dir, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp_dir, final)
    _write_text_atomic(Path(save_dir) / LATEST_FILE, f"{iteration}\n")
    return final


def save_checkpoint(save_dir: str | os.PathLike, iteration: int,
                    model_state: dict[str, torch.Tensor],
                    optimizer_state: dict[str, torch.Tensor] | None,
                    metadata: dict[str, Any]) -> Path:
    """Single-writer save of a whole checkpoint; returns its directory."""
    tmp = begin_save(save_dir, iteration)
    write_part(tmp, "model", 0, model_state)
    if optimizer_state:
        write_part(tmp, "optim", 0, optimizer_state)
    return commit_save(save_dir, tmp, iteration, metadata)


def find_latest_iteration(load_dir: str | os.PathLike) -> int | None:
    """Iteration named by the ``latest`` file, or None when ``load_dir`` holds no checkpoint."""
    path = Path(load_dir)
    latest = path / LATEST_FILE
    if not latest.exists():
        if any(path.glob("iter_*")):
            raise ConfigError(f"{path} has iter_* directories but no {LATEST_FILE}; the last save "
                              f"did not finish - pass --ckpt-step or write {LATEST_FILE}")
        return None
    text = latest.read_text().strip()
    if not text.isdigit():
        raise ConfigError(f"{latest} should hold an iteration number, found {text[:40]!r}")
    return int(text)


def read_metadata(ckpt_dir: Path) -> dict[str, Any]:
    """Metadata of one iteration directory, after checking that every part is complete."""
    meta_path = ckpt_dir / METADATA_FILE
    if not ckpt_dir.is_dir():
        raise ConfigError(f"checkpoint directory {ckpt_dir} does not exist")
    if not meta_path.exists():
        raise ConfigError(f"checkpoint {ckpt_dir} is incomplete: {METADATA_FILE} is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"checkpoint metadata {meta_path} is corrupt: {exc}") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"checkpoint {ckpt_dir} has format version "
                          f"{meta.get('format_version')}, this build reads {FORMAT_VERSION}")
    for name, size in meta.get("parts", {}).items():
        part = ckpt_dir / name
        if not part.exists():
            raise ConfigError(f"checkpoint {ckpt_dir} is incomplete: {name} is missing")
        if part.stat().st_size != size:
            raise ConfigError(f"checkpoint part {part} has {part.stat().st_size} bytes, "
                              f"expected {size}: the file is truncated or corrupt")
    return meta


class CheckpointReader:
    """Lazy access to one checkpoint: each rank reads only the tensors (or slices) it owns.

    Nothing is loaded until :meth:`get`; a tensor is located through the safetensors headers of
    the parts, so a rank holding two layers of a 100B model reads two layers.
    """

    def __init__(self, ckpt_dir: Path, metadata: dict[str, Any]) -> None:
        self.path, self.metadata = ckpt_dir, metadata
        self.iteration = int(metadata["iteration"])
        self._where: dict[str, str] = {}
        for name in sorted(metadata.get("parts", {})):
            try:
                with safe_open(str(ckpt_dir / name), framework="pt") as fh:
                    keys = list(fh.keys())
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise ConfigError(f"checkpoint part {ckpt_dir / name} is corrupt ({exc}); load "
                                  "an earlier iteration") from None
            for key in keys:
                if key in self._where:
                    raise ConfigError(f"checkpoint {ckpt_dir} stores {key} in two parts")
                self._where[key] = name

    def load_all(self, kind: str) -> dict[str, torch.Tensor]:
        """Every tensor of the ``model`` or ``optim`` parts."""
        return {name: self.get(name, kind) for name in self._where if self.has(name, kind)}

    def has(self, name: str, kind: str = "model") -> bool:
        return self._where.get(name, "").startswith(kind + "_")

    def get(self, name: str, kind: str = "model") -> torch.Tensor:
        """The full tensor ``name`` from a ``model`` or ``optim`` part."""
        if not self.has(name, kind):
            raise ConfigError(f"checkpoint {self.path} has no {kind} tensor {name}")
        try:
            with safe_open(str(self.path / self._where[name]), framework="pt") as fh:
                return fh.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ConfigError(f"checkpoint part {self.path / self._where[name]} is corrupt "
                              f"({exc}); load an earlier iteration") from None


def open_checkpoint(load_dir: str | os.PathLike,
                    iteration: int | None = None) -> CheckpointReader | None:
    """Check the given (default: latest) checkpoint and index its tensors; None if there is none."""
    path = Path(load_dir)
    if not path.exists():
        raise ConfigError(f"--load directory {path} does not exist")
    if iteration is None:
        iteration = find_latest_iteration(path)
        if iteration is None:
            return None
    ckpt_dir = iteration_dir(path, iteration)
    return CheckpointReader(ckpt_dir, read_metadata(ckpt_dir))


def load_checkpoint(load_dir: str | os.PathLike, iteration: int | None = None,
                    load_optimizer: bool = True) -> Checkpoint | None:
    """Load every tensor of the given (default: latest) iteration; None when ``load_dir`` has
    no checkpoint. (Training loads through :class:`CheckpointReader`, one rank's share.)"""
    reader = open_checkpoint(load_dir, iteration)
    if reader is None:
        return None
    model = reader.load_all("model")
    if not model:
        raise ConfigError(f"checkpoint {reader.path} holds no model tensors")
    optim = reader.load_all("optim") if load_optimizer else {}
    return Checkpoint(iteration=reader.iteration, model=model, optimizer=optim,
                      metadata=reader.metadata, path=reader.path)
