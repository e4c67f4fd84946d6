"""The tensors of a ``torch_dist`` checkpoint, read with torch.distributed.checkpoint's own
reader and no process group, after checking that every file its metadata names is there and
long enough (a truncated or missing file is one line naming it).

torch.distributed.checkpoint is imported where it is used: importing it costs about 1 s of CPU
time (it pulls in torch.distributed.tensor and sympy), in every training process, which reads a
``torch_dist`` checkpoint only when ``--load`` names one."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_h2.checkpointing.megatron_names import safe_torch_load
from megatron_h2.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

DIST_METADATA = ".metadata"
BACKEND_FILE = "metadata.json"


def _first_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:120]


def check_backend(ckpt_dir: Path) -> None:
    """``metadata.json`` must name the torch_dist backend this reader understands."""
    path = ckpt_dir / BACKEND_FILE
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"checkpoint metadata {path} is unreadable ({_first_line(exc)})") \
            from None
    if not isinstance(meta, dict) or meta.get("sharded_backend") != "torch_dist":
        backend = meta.get("sharded_backend") if isinstance(meta, dict) else meta
        raise ConfigError(f"checkpoint metadata {path} names sharded backend "
                          f"{str(backend)[:30]!r}; this build reads torch_dist")


def read_dist_metadata(ckpt_dir: Path) -> Metadata:
    """The torch.distributed.checkpoint metadata, after checking the files it names."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    check_backend(ckpt_dir)
    if not (ckpt_dir / DIST_METADATA).is_file():
        raise ConfigError(f"checkpoint file {ckpt_dir / DIST_METADATA} is missing")
    try:
        meta = FileSystemReader(str(ckpt_dir)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a damaged file
        raise ConfigError(f"checkpoint file {ckpt_dir / DIST_METADATA} is truncated or corrupt "
                          f"({_first_line(exc)})") from None
    if not isinstance(meta, Metadata) or not isinstance(meta.storage_data, dict):
        raise ConfigError(f"checkpoint file {ckpt_dir / DIST_METADATA} is not "
                          "torch.distributed.checkpoint metadata")
    needed: dict[str, int] = {}
    for info in meta.storage_data.values():
        name = str(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(needed.items()):
        path = ckpt_dir / name
        if not path.is_file():
            raise ConfigError(f"checkpoint file {path} is missing")
        if path.stat().st_size < size:
            raise ConfigError(f"checkpoint file {path} is truncated: {path.stat().st_size} "
                              f"bytes, its metadata needs {size}")
    return meta


def read_dist_tensors(ckpt_dir: Path, skip: str | None = None
                      ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every tensor at its global shape (but those whose key starts with ``skip``), and the
    names of the entries not read: byte objects (extra state, RNG states: they would have to be
    unpickled) and skipped tensors."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    meta = read_dist_metadata(ckpt_dir)
    tensors: dict[str, torch.Tensor] = {}
    objects: list[str] = []
    for key, item in meta.state_dict_metadata.items():
        if skip is not None and key.startswith(skip):
            objects.append(key)
        elif isinstance(item, TensorStorageMetadata):
            tensors[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
        elif isinstance(item, BytesStorageMetadata):
            objects.append(key)
        else:
            raise ConfigError(f"checkpoint {ckpt_dir}: entry {key} is of a kind this build "
                              f"does not read ({type(item).__name__})")
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(tensors, storage_reader=FileSystemReader(str(ckpt_dir)), no_dist=True)
    except Exception as exc:  # noqa: BLE001 - torch wraps a damaged file in several types
        raise ConfigError(f"checkpoint {ckpt_dir}: a tensor file is corrupt "
                          f"({_first_line(exc)})") from None
    return tensors, sorted(objects)


def read_dist_objects(ckpt_dir: Path, keys: list[str]) -> dict[str, Any]:
    """The byte objects ``keys`` (pickled by Megatron-Core), unpickled without running code
    (:func:`~.megatron_names.safe_torch_load`); a missing or damaged one is one line."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta = read_dist_metadata(ckpt_dir)
    where = {index.fqn: info for index, info in meta.storage_data.items()}
    found: dict[str, Any] = {}
    for key in keys:
        info = where.get(key)
        if info is None or not isinstance(meta.state_dict_metadata.get(key),
                                          BytesStorageMetadata):
            raise ConfigError(f"checkpoint {ckpt_dir} has no object {key}")
        path = ckpt_dir / str(info.relative_path)
        with open(path, "rb") as file:
            file.seek(int(info.offset))
            data = file.read(int(info.length))
        found[key] = safe_torch_load(path, data)
    return found
