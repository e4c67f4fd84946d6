"""Saving and restoring the whole training state: weights, optimizer, progress and RNG."""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from megatron_h2.checkpointing import load_checkpoint, save_checkpoint
from megatron_h2.config import RunConfig
from megatron_h2.devices import Accelerator
from megatron_h2.errors import ConfigError
from megatron_h2.training.optimizer import load_named_optimizer_state, optimizer_state_to_named

# Config fields that must match for a checkpoint's weights to mean the same model.
MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size", "vocab_size", "norm_epsilon", "rotary_base")


@dataclass
class TrainProgress:
    iteration: int = 0
    consumed_samples: int = 0


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng(accelerator: Accelerator) -> dict[str, Any]:
    """Every RNG stream that training draws from, as JSON-safe data."""
    np_state = np.random.get_state()
    dev = accelerator.get_rng_state()
    py_version, py_state, py_gauss = random.getstate()
    return {"python": [py_version, list(py_state), py_gauss],
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "torch_cpu": _b64(torch.get_rng_state()),
            "device": _b64(dev.cpu()) if dev is not None else None}


def restore_rng(state: dict[str, Any], accelerator: Accelerator) -> None:
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    if state.get("device") is not None:
        accelerator.set_rng_state(_unb64(state["device"]))


def param_names(model: nn.Module) -> dict[nn.Parameter, str]:
    return {p: n for n, p in model.named_parameters()}


def save_training_state(save_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                        progress: TrainProgress, config: RunConfig,
                        accelerator: Accelerator) -> Path:
    """Write a complete checkpoint for ``progress.iteration``."""
    model_state = {n: p.detach() for n, p in model.named_parameters()}
    optim_state = optimizer_state_to_named(optimizer, param_names(model))
    metadata = {"iteration": progress.iteration, "consumed_samples": progress.consumed_samples,
                "config": config.to_dict(), "rng": capture_rng(accelerator)}
    return save_checkpoint(save_dir, progress.iteration, model_state, optim_state, metadata)


def check_compatible(metadata: dict[str, Any], config: RunConfig, source: Path | None) -> None:
    """The checkpoint's model must equal the configured one (one line names the field)."""
    saved = metadata.get("config", {}).get("model", {})
    for name in MODEL_FIELDS:
        mine = getattr(config.model, name)
        if name in saved and saved[name] != mine:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"checkpoint {source} was saved with {name}={saved[name]} but "
                              f"this run has {flag} {mine}; use matching model flags")


def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: Path | None) -> None:
    """Copy the tensors this model owns; every one of its parameters must be present."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in tensors:
                raise ConfigError(f"checkpoint {source} has no tensor {name}")
            src = tensors[name]
            if src.shape != param.shape:
                raise ConfigError(f"checkpoint tensor {name} has shape {tuple(src.shape)}, "
                                  f"model expects {tuple(param.shape)}")
            param.copy_(src)


def load_training_state(load_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                        config: RunConfig, accelerator: Accelerator, *, iteration: int | None,
                        load_optim: bool, load_rng: bool) -> TrainProgress | None:
    """Restore a checkpoint into model and optimizer; None if ``load_dir`` holds none yet."""
    ckpt = load_checkpoint(load_dir, iteration, load_optimizer=load_optim)
    if ckpt is None:
        return None
    check_compatible(ckpt.metadata, config, ckpt.path)
    load_weights(model, ckpt.model, ckpt.path)
    if load_optim and ckpt.optimizer:
        load_named_optimizer_state(optimizer, param_names(model), ckpt.optimizer)
    if load_rng and "rng" in ckpt.metadata:
        restore_rng(ckpt.metadata["rng"], accelerator)
    return TrainProgress(iteration=ckpt.iteration,
                         consumed_samples=int(ckpt.metadata.get("consumed_samples", 0)))
