"""On-disk checkpoint format: safetensors parts, one JSON metadata file and a manifest.

Layout of a save directory::

    SAVE/latest_checkpointed_iteration.txt     # "120": the newest complete checkpoint
    SAVE/iter_0000120/model_00000.safetensors  # full (unsharded) tensors keyed by global name
    SAVE/iter_0000120/optim_00000.safetensors  # optimizer state keyed "<param name>.<state>"
    SAVE/iter_0000120/metadata.json            # iteration, config, RNG states, part sizes
    SAVE/iter_0000120/manifest.json            # size and SHA-256 of every file above

Every tensor is stored whole under its global parameter name, so a checkpoint does not depend on
the layout it was saved under. A checkpoint may be split into several parts (one per writer);
loading merges them. Nothing is ever unpickled: tensors come from safetensors and everything
else from JSON.

Saving writes into a temporary directory and renames it into place, then updates the
``latest`` file by rename, so a crash mid-save leaves the previous checkpoint loadable. Each
part's checksum is computed while it is written (:mod:`.integrity`); loading checks sizes always
and checksums unless told not to, and a damaged file is reported by name together with the
newest earlier iteration that is intact.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from megatron_h2.checkpointing.integrity import (
    MANIFEST_FILE,
    PART_NAME,
    corrupt_files,
    file_entry,
    read_manifest,
    write_manifest,
    write_safetensors,
    wrong_sizes,
)
from megatron_h2.errors import ConfigError

FORMAT_VERSION = 1
LATEST_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
_MAX_ITERATION = 10**15


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


def saved_iterations(save_dir: str | os.PathLike) -> list[int]:
    """Iterations that have a committed ``iter_*`` directory, oldest first."""
    path = Path(save_dir)
    if not path.is_dir():
        return []
    found = (_ITER_DIR.match(p.name) for p in path.iterdir() if p.is_dir())
    return sorted(int(m.group(1)) for m in found if m)


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


def write_part(tmp_dir: Path, kind: str, part: int,
               tensors: dict[str, torch.Tensor]) -> tuple[str, dict[str, Any]]:
    """Write one safetensors part (``kind`` is ``model`` or ``optim``); returns its file name and
    manifest entry (size and SHA-256, computed while writing)."""
    name = f"{kind}_{part:05d}.safetensors"
    contiguous = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return name, write_safetensors(tmp_dir / name, contiguous, {"format": "pt"})


def commit_save(save_dir: str | os.PathLike, tmp_dir: Path, iteration: int,
                metadata: dict[str, Any], entries: dict[str, dict[str, Any]]) -> Path:
    """Write metadata and the manifest (``entries``: every part's size and checksum), move the
    directory into place and update latest."""
    on_disk = {p.name for p in tmp_dir.glob("*.safetensors")}
    if on_disk != set(entries):
        raise RuntimeError(f"save of iteration {iteration}: parts on disk {sorted(on_disk)} differ "
                           f"from the parts written {sorted(entries)}")
    parts = {name: entry["bytes"] for name, entry in sorted(entries.items())}
    meta = dict(metadata, format_version=FORMAT_VERSION, iteration=iteration, parts=parts)
    _write_text_atomic(tmp_dir / METADATA_FILE, json.dumps(meta, indent=1, sort_keys=True))
    write_manifest(tmp_dir, {**entries, METADATA_FILE: file_entry(tmp_dir / METADATA_FILE)})
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


def set_aside(save_dir: str | os.PathLike, iterations: list[int], keep: int | None,
              suffix: str = "unverified") -> list[str]:
    """Rename the committed checkpoints of ``iterations`` to ``iter_*.{suffix}`` (kept as
    evidence, no longer loadable by accident) and point ``latest`` at ``keep`` (None: at the
    newest checkpoint left, or nowhere when none is left); returns the new names."""
    moved = []
    for iteration in iterations:
        path = iteration_dir(save_dir, iteration)
        if path.is_dir():
            target = path.with_name(f"{path.name}.{suffix}")
            if target.exists():
                shutil.rmtree(target)
            os.replace(path, target)
            moved.append(target.name)
    latest = Path(save_dir) / LATEST_FILE
    left = saved_iterations(save_dir)
    keep = keep if keep is not None else (left[-1] if left else None)
    if keep is not None:
        _write_text_atomic(latest, f"{keep}\n")
    else:
        latest.unlink(missing_ok=True)
    return moved


def save_checkpoint(save_dir: str | os.PathLike, iteration: int,
                    model_state: dict[str, torch.Tensor],
                    optimizer_state: dict[str, torch.Tensor] | None,
                    metadata: dict[str, Any]) -> Path:
    """Single-writer save of a whole checkpoint; returns its directory."""
    tmp = begin_save(save_dir, iteration)
    entries = dict([write_part(tmp, "model", 0, model_state)])
    if optimizer_state:
        entries.update([write_part(tmp, "optim", 0, optimizer_state)])
    return commit_save(save_dir, tmp, iteration, metadata, entries)


def find_latest_iteration(load_dir: str | os.PathLike) -> int | None:
    """Iteration named by the ``latest`` file, or None when ``load_dir`` holds no checkpoint."""
    path = Path(load_dir)
    latest = path / LATEST_FILE
    if not latest.exists():
        if saved_iterations(path):
            raise ConfigError(f"{path} has iter_* directories but no {LATEST_FILE}; the last save "
                              f"did not finish - pass --ckpt-step or write {LATEST_FILE}")
        return None
    raw = latest.read_bytes()[:64]
    text = raw.decode("ascii", errors="replace").strip()
    if not re.fullmatch(r"[0-9]{1,15}", text):  # ASCII digits only: int() would take "٣"
        raise ConfigError(f"{latest} should hold an iteration number, found {text[:40]!r}; "
                          "write the number of an existing iter_* directory into it")
    return int(text)


def _checked_int(meta: dict[str, Any], key: str, where: Path) -> int | None:
    value = meta.get(key)
    if value is None and key not in meta:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_ITERATION:
        raise ConfigError(f"checkpoint metadata {where} has {key}={str(value)[:40]!r}, expected a "
                          "non-negative integer; the file is corrupt, load an earlier iteration")
    return value


def validate_metadata(meta: Any, ckpt_dir: Path) -> dict[str, Any]:
    """Check the structure of a metadata object (types, iteration, part names); returns it."""
    where = ckpt_dir / METADATA_FILE
    if not isinstance(meta, dict):
        raise ConfigError(f"checkpoint metadata {where} must be a JSON object, found "
                          f"{type(meta).__name__}; the file is corrupt, load an earlier iteration")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"checkpoint {ckpt_dir} has format version "
                          f"{str(meta.get('format_version'))[:20]}, this build reads "
                          f"{FORMAT_VERSION}")
    iteration = _checked_int(meta, "iteration", where)
    if iteration is None:
        raise ConfigError(f"checkpoint metadata {where} has no iteration; the file is corrupt, "
                          "load an earlier iteration")
    named = _ITER_DIR.match(ckpt_dir.name)
    if named and int(named.group(1)) != iteration:
        raise ConfigError(f"checkpoint metadata {where} says iteration {iteration} but lives in "
                          f"{ckpt_dir.name}; the file is corrupt or misplaced")
    _checked_int(meta, "consumed_samples", where)
    parts = meta.get("parts", {})
    if not isinstance(parts, dict) or not all(
            isinstance(k, str) and PART_NAME.match(k) and isinstance(v, int)
            and not isinstance(v, bool) and v >= 0 for k, v in parts.items()):
        raise ConfigError(f"checkpoint metadata {where} has a malformed parts list; the file is "
                          "corrupt, load an earlier iteration")
    for key in ("config", "layout"):
        if key in meta and not isinstance(meta[key], dict):
            raise ConfigError(f"checkpoint metadata {where}: {key} must be an object; the file "
                              "is corrupt, load an earlier iteration")
    config = meta.get("config", {})
    if not all(isinstance(v, dict) for v in config.values()):
        raise ConfigError(f"checkpoint metadata {where}: every config section must be an "
                          "object; the file is corrupt, load an earlier iteration")
    return meta


def read_checkpoint_files(ckpt_dir: Path,
                          verify: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(metadata, manifest) of one iteration directory after the cheap checks: every file present
    with its recorded size, the metadata's own checksum and structure. ``verify=False`` accepts a
    checkpoint without a manifest (sizes then come from the metadata; manifest None)."""
    meta_path = ckpt_dir / METADATA_FILE
    if not ckpt_dir.is_dir():
        raise ConfigError(f"checkpoint directory {ckpt_dir} does not exist")
    if not meta_path.is_file():
        raise ConfigError(f"checkpoint {ckpt_dir} is incomplete: {METADATA_FILE} is missing")
    manifest = None
    if verify or (ckpt_dir / MANIFEST_FILE).exists():
        manifest = read_manifest(ckpt_dir)
        bad = wrong_sizes(ckpt_dir, manifest if verify else
                          {n: e for n, e in manifest.items() if n != METADATA_FILE})
        if not bad and verify:
            bad = corrupt_files(ckpt_dir, manifest, [METADATA_FILE])
        if bad:
            raise ConfigError(corruption_message(ckpt_dir, bad))
    try:
        meta = json.loads(meta_path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"checkpoint metadata {meta_path} is corrupt: "
                          f"{str(exc).splitlines()[0][:120]}") from None
    validate_metadata(meta, ckpt_dir)
    if manifest is None:
        bad = wrong_sizes(ckpt_dir, {n: {"bytes": b} for n, b in meta.get("parts", {}).items()})
        if bad:
            raise ConfigError(f"checkpoint part {ckpt_dir / bad[0]} does not have the size "
                              f"recorded in {METADATA_FILE}: the file is truncated or corrupt")
    elif set(meta.get("parts", {})) != set(manifest) - {METADATA_FILE}:
        raise ConfigError(f"checkpoint {ckpt_dir}: the parts in {METADATA_FILE} differ from "
                          f"those in {MANIFEST_FILE}; load an earlier iteration")
    return meta, manifest


def read_metadata(ckpt_dir: Path, verify: bool = True) -> dict[str, Any]:
    """The checked metadata of one iteration directory (see :func:`read_checkpoint_files`)."""
    return read_checkpoint_files(ckpt_dir, verify)[0]


def find_intact_before(load_dir: str | os.PathLike, iteration: int) -> int | None:
    """The newest iteration below ``iteration`` whose files all match their checksums."""
    for earlier in reversed(saved_iterations(load_dir)):
        if earlier >= iteration:
            continue
        ckpt_dir = iteration_dir(load_dir, earlier)
        try:
            _, manifest = read_checkpoint_files(ckpt_dir)
        except ConfigError:
            continue
        if manifest is not None and not corrupt_files(ckpt_dir, manifest):
            return earlier
    return None


def corruption_message(ckpt_dir: Path, bad: list[str]) -> str:
    """One line naming the damaged file(s) and the newest intact earlier iteration."""
    named = _ITER_DIR.match(ckpt_dir.name)
    iteration = int(named.group(1)) if named else None
    files = ", ".join(str(ckpt_dir / name) for name in bad[:3]) + (" ..." if len(bad) > 3 else "")
    text = (f"checkpoint file {files} is truncated or corrupt: it does not match the size / "
            f"checksum recorded in {MANIFEST_FILE} (changed after it was written)")
    if iteration is None:
        return text
    intact = find_intact_before(ckpt_dir.parent, iteration)
    if intact is None:
        return text + "; no earlier iteration in this directory is intact"
    return (text + f"; iteration {intact} ({iteration_dir(ckpt_dir.parent, intact)}) is intact: "
            f"load it with --ckpt-step {intact}")


class CheckpointReader:
    """Lazy access to one checkpoint: each rank reads only the tensors (or slices) it owns.

    Nothing is loaded until :meth:`get`; a tensor is located through the safetensors headers of
    the parts, so a rank holding two layers of a 100B model reads two layers.
    """

    def __init__(self, ckpt_dir: Path, metadata: dict[str, Any],
                 manifest: dict[str, dict[str, Any]] | None = None) -> None:
        self.path, self.metadata, self.manifest = ckpt_dir, metadata, manifest
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

    def parts_of(self, names: list[str]) -> list[str]:
        """The part files that hold any of the tensors ``names``."""
        return sorted({self._where[n] for n in names if n in self._where})

    def verify(self, parts: list[str] | None = None) -> list[str]:
        """Parts (default all) whose checksum differs from the manifest; [] without a manifest."""
        if self.manifest is None:
            return []
        return corrupt_files(self.path, self.manifest, parts)

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


def checkpoint_to_load(load_dir: str | os.PathLike, iteration: int | None = None) -> Path | None:
    """The iteration directory to load from ``load_dir`` (default: the latest), or None when
    the directory holds no checkpoint."""
    path = Path(load_dir)
    if not path.is_dir():
        raise ConfigError(f"--load directory {path} does not exist")
    if iteration is None:
        iteration = find_latest_iteration(path)
        if iteration is None:
            return None
    return iteration_dir(path, iteration)


def open_checkpoint(load_dir: str | os.PathLike, iteration: int | None = None,
                    verify: bool = True) -> CheckpointReader | None:
    """Check the given (default: latest) checkpoint and index its tensors; None if there is none.
    The parts' checksums are not read here (see :meth:`CheckpointReader.verify`)."""
    ckpt_dir = checkpoint_to_load(load_dir, iteration)
    if ckpt_dir is None:
        return None
    return CheckpointReader(ckpt_dir, *read_checkpoint_files(ckpt_dir, verify))


def load_checkpoint(load_dir: str | os.PathLike, iteration: int | None = None,
                    load_optimizer: bool = True, verify: bool = True) -> Checkpoint | None:
    """Load every tensor of the given (default: latest) iteration, after checking every part's
    checksum (unless ``verify`` is False); None when ``load_dir`` has no checkpoint. (Training
    loads through :class:`CheckpointReader`, one rank's share.)"""
    reader = open_checkpoint(load_dir, iteration, verify)
    if reader is None:
        return None
    if verify and (bad := reader.verify()):
        raise ConfigError(corruption_message(reader.path, bad))
    model = reader.load_all("model")
    if not model:
        raise ConfigError(f"checkpoint {reader.path} holds no model tensors")
    optim = reader.load_all("optim") if load_optimizer else {}
    return Checkpoint(iteration=reader.iteration, model=model, optimizer=optim,
                      metadata=reader.metadata, path=reader.path)
