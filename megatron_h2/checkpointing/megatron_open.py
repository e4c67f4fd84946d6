"""Open a ``--load`` directory whatever it holds: a megatron_h2 checkpoint, or a Megatron-LM one
(``torch_dist`` or legacy ``torch``), the latter behind :class:`CheckpointReader`'s interface so
that training restores either the same way under any plan."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from megatron_h2.checkpointing.format import (
    CheckpointReader,
    checkpoint_to_load,
    read_checkpoint_files,
)
from megatron_h2.checkpointing.megatron_read import (
    MegatronState,
    detect_format,
    read_header,
    read_megatron,
)
from megatron_h2.errors import ConfigError

MEGATRON_FORMATS = ("torch", "torch_dist")


def megatron_metadata(state: MegatronState) -> dict[str, Any]:
    """Our checkpoint metadata for a Megatron-LM checkpoint (what restoring reads)."""
    model = {name: getattr(state.config, name) for name in state.config.__dataclass_fields__}
    meta: dict[str, Any] = {"iteration": state.iteration,
                            "consumed_samples": state.consumed_samples,
                            "consumed_valid_samples": state.consumed_valid_samples,
                            "config": {"model": model},
                            "megatron": {"format": state.format,
                                         "tensor_model_parallel_size":
                                             state.args.get("tensor_model_parallel_size"),
                                         "pipeline_model_parallel_size":
                                             state.args.get("pipeline_model_parallel_size"),
                                         "not_read": state.not_read}}
    if state.scheduler is not None:
        meta["opt_param_scheduler"] = dict(state.scheduler)
    return meta


class MegatronReader:
    """:class:`CheckpointReader`'s interface over a Megatron-LM checkpoint read into memory (it
    has no manifest: the files' sizes are checked against the checkpoint's own metadata)."""

    def __init__(self, state: MegatronState) -> None:
        self.state = state
        self.path = state.path
        self.iteration = state.iteration
        self.metadata = megatron_metadata(state)
        self.manifest = None

    def parts_of(self, names: list[str]) -> list[str]:
        return []

    def verify(self, parts: list[str] | None = None) -> list[str]:
        return []

    def _tensors(self, kind: str) -> dict[str, torch.Tensor]:
        return self.state.model if kind == "model" else self.state.optimizer

    def has(self, name: str, kind: str = "model") -> bool:
        return name in self._tensors(kind)

    def get(self, name: str, kind: str = "model") -> torch.Tensor:
        if not self.has(name, kind):
            raise ConfigError(f"Megatron-LM checkpoint {self.path} has no {kind} tensor {name}")
        return self._tensors(kind)[name]

    def load_all(self, kind: str) -> dict[str, torch.Tensor]:
        return dict(self._tensors(kind))


def check_format(ckpt_dir: Path, ckpt_format: str | None, auto_detect: bool) -> str:
    """The format of ``ckpt_dir`` (see :func:`detect_format`). ``ckpt_format``
    (``--ckpt-format``) names the Megatron-LM format expected; another Megatron-LM format is
    refused unless ``auto_detect`` (``--auto-detect-ckpt-format``), as Megatron-LM does. A
    megatron_h2 checkpoint is always read."""
    found = detect_format(ckpt_dir)
    if found in MEGATRON_FORMATS and ckpt_format is not None and found != ckpt_format \
            and not auto_detect:
        raise ConfigError(f"{ckpt_dir} holds a Megatron-LM {found} checkpoint but "
                          f"--ckpt-format is {ckpt_format}; pass --ckpt-format {found} or "
                          "--auto-detect-ckpt-format")
    return found


def read_any_metadata(ckpt_dir: Path, verify: bool = True, ckpt_format: str | None = None,
                      auto_detect: bool = False) -> dict[str, Any]:
    """The metadata of either kind of checkpoint, reading no tensor files (start-up checks)."""
    if check_format(ckpt_dir, ckpt_format, auto_detect) == "megatron_h2":
        return read_checkpoint_files(ckpt_dir, verify)[0]
    return megatron_metadata(read_header(ckpt_dir))


def open_any_checkpoint(load_dir: str | os.PathLike, iteration: int | None = None,
                        verify: bool = True, ckpt_format: str | None = None,
                        auto_detect: bool = False, load_optim: bool = True
                        ) -> CheckpointReader | MegatronReader | None:
    """The checkpoint in ``load_dir`` (default: the latest iteration), or None when there is
    none; the format is checked by :func:`check_format`."""
    ckpt_dir = checkpoint_to_load(load_dir, iteration)
    if ckpt_dir is None:
        return None
    if check_format(ckpt_dir, ckpt_format, auto_detect) == "megatron_h2":
        return CheckpointReader(ckpt_dir, *read_checkpoint_files(ckpt_dir, verify))
    return MegatronReader(read_megatron(ckpt_dir, load_optim))
