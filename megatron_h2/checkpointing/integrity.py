"""Checksums of checkpoint files: computed while a file is written, kept in a manifest, checked
on load.

Every file of an iteration directory (the safetensors parts and ``metadata.json``) is listed in
``manifest.json`` with its size and SHA-256. The parts are written by :func:`write_safetensors`,
which streams each tensor's bytes to disk and hashes the same bytes on a second thread, so the
checksum costs no extra pass over the data and no extra copy of it. Loading compares sizes
always (cheap) and checksums unless the user opts out (``--no-verify-checkpoint``).

The written files are standard safetensors (they are read back with the ``safetensors`` library);
tensors are laid out as the library lays them out (largest element size first, then by name).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from megatron_h2.errors import ConfigError

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
CHUNK_BYTES = 16 << 20
PART_NAME = re.compile(r"^(model|optim)_\d{5}\.safetensors$")
"""File names a checkpoint may list (no paths: a manifest cannot point outside its directory)."""

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in memory order, without a copy (the tensor must be contiguous)."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


class _HashingFile:
    """Writes bytes to a file and feeds the same bytes, in order, to SHA-256 on a second thread
    (both release the GIL, so hashing overlaps the write)."""

    def __init__(self, path: Path) -> None:
        self.fh = open(path, "wb")
        self.digest = hashlib.sha256()
        self.size = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-sha256")

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), CHUNK_BYTES):
            chunk = view[start:start + CHUNK_BYTES]
            self._pool.submit(self.digest.update, chunk)  # one worker: updates stay in order
            self.fh.write(chunk)
            self.size += len(chunk)

    def close(self) -> tuple[int, str]:
        """Flush to disk; returns (size in bytes, hex SHA-256)."""
        self._pool.shutdown(wait=True)
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        return self.size, self.digest.hexdigest()


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """Write ``tensors`` (CPU, contiguous) as a safetensors file; returns its manifest entry
    ``{"bytes": size, "sha256": hex}``."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise ConfigError(f"cannot store tensor {name} of dtype {t.dtype} in a checkpoint")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    out = _HashingFile(path)
    try:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for name in order:
            out.write(_byte_view(tensors[name]))
    finally:
        size, digest = out.close()
    return {"bytes": size, "sha256": digest}


def file_entry(path: Path) -> dict[str, Any]:
    """Manifest entry of an existing file (size and SHA-256, read in chunks)."""
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": digest}


def write_manifest(ckpt_dir: Path, entries: dict[str, dict[str, Any]]) -> None:
    """Write ``manifest.json`` (atomically) listing every file of ``ckpt_dir``."""
    data = {"version": MANIFEST_VERSION, "algorithm": "sha256", "files": entries}
    tmp = ckpt_dir / f".{MANIFEST_FILE}.tmp"
    with open(tmp, "w") as fh:
        fh.write(json.dumps(data, indent=1, sort_keys=True))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, ckpt_dir / MANIFEST_FILE)


def _check_entry(name: Any, entry: Any, where: Path) -> None:
    if not isinstance(name, str) or not (PART_NAME.match(name) or name == "metadata.json"):
        raise ConfigError(f"checkpoint manifest {where} lists an unexpected file {name!r}; the "
                          "manifest is corrupt, load an earlier iteration")
    if (not isinstance(entry, dict) or set(entry) != {"bytes", "sha256"}
            or isinstance(entry["bytes"], bool) or not isinstance(entry["bytes"], int)
            or entry["bytes"] < 0 or not isinstance(entry["sha256"], str)
            or not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])):
        raise ConfigError(f"checkpoint manifest {where} has a malformed entry for {name}; the "
                          "manifest is corrupt, load an earlier iteration")


def read_manifest(ckpt_dir: Path) -> dict[str, dict[str, Any]]:
    """``{file name: {"bytes", "sha256"}}`` from ``manifest.json``; one-line errors."""
    path = ckpt_dir / MANIFEST_FILE
    if not path.is_file():
        raise ConfigError(f"checkpoint {ckpt_dir} has no {MANIFEST_FILE} (incomplete, or written "
                          "by an older version without checksums); load another iteration or "
                          "pass --no-verify-checkpoint to load it unchecked")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"checkpoint manifest {path} is not valid JSON "
                          f"({type(exc).__name__}); load an earlier iteration") from None
    if (not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION
            or data.get("algorithm") != "sha256" or not isinstance(data.get("files"), dict)):
        raise ConfigError(f"checkpoint manifest {path} is malformed (expected version "
                          f"{MANIFEST_VERSION}, sha256 and a files mapping); load an earlier "
                          "iteration")
    for name, entry in data["files"].items():
        _check_entry(name, entry, path)
    if "metadata.json" not in data["files"]:
        raise ConfigError(f"checkpoint manifest {path} does not list metadata.json; the manifest "
                          "is corrupt, load an earlier iteration")
    return data["files"]


def wrong_sizes(ckpt_dir: Path, entries: dict[str, dict[str, Any]]) -> list[str]:
    """Listed files whose size differs from the record (cheap: no data is read); a missing
    file is a one-line ConfigError."""
    bad = []
    for name, entry in sorted(entries.items()):
        path = ckpt_dir / name
        if not path.is_file():
            raise ConfigError(f"checkpoint {ckpt_dir} is incomplete: {name} is missing")
        if path.stat().st_size != entry["bytes"]:
            bad.append(name)
    return bad


def corrupt_files(ckpt_dir: Path, entries: dict[str, dict[str, Any]],
                  names: list[str] | None = None) -> list[str]:
    """Names (of ``names``, default all) whose size or SHA-256 differs from the manifest."""
    bad = []
    for name in sorted(entries if names is None else names):
        path, entry = ckpt_dir / name, entries[name]
        try:
            if path.stat().st_size != entry["bytes"] or file_entry(path) != entry:
                bad.append(name)
        except OSError:
            bad.append(name)
    return bad
