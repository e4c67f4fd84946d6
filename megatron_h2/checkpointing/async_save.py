"""Background checkpoint writing (``--async-save``).

The collective part of a save (optimizer state and tensor-parallel shards gathered, RNG states
captured) runs in the training thread; :class:`BackgroundWrite` then copies this rank's parts to
host memory and writes them on a thread, with their checksums, into the save's temporary
directory. Nothing is committed until every rank's write has finished: the committing step
(metadata, manifest, rename into place, ``latest``) is the same as for a synchronous save and
runs when the training loop finds all writes done, so a checkpoint is never torn and a crash
mid-write leaves only a temporary directory, which the next start removes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_h2.checkpointing.format import write_part


def host_copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor copied to host memory (a copy even when it is there already: training goes on
    updating the originals in place)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


@dataclass
class BackgroundWrite:
    """Writes ``parts`` (``(kind, part index, tensors)``, already host copies) into ``tmp_dir``
    on a thread; :attr:`entries` are the manifest entries once done."""

    tmp_dir: Path
    parts: list[tuple[str, int, dict[str, torch.Tensor]]]
    context: dict[str, Any] = field(default_factory=dict)  # what the commit needs later
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._write, name="ckpt-async-save", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        try:
            for kind, index, tensors in self.parts:
                name, entry = write_part(self.tmp_dir, kind, index, tensors)
                self.entries[name] = entry
        except Exception as exc:  # noqa: BLE001 - reported by the committing step
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.parts = []  # free the host copies
            self.finished = time.perf_counter()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
