"""AdamW with Megatron's parameter groups, the learning-rate schedule, and optimizer state as
named tensors (for layout-independent checkpoints)."""

from __future__ import annotations

import math

import torch
from torch import nn

from megatron_h2.config import OptimizerConfig
from megatron_h2.devices.kernels import Kernels
from megatron_h2.errors import ConfigError

ADAM_STATES = ("exp_avg", "exp_avg_sq")


def build_optimizer(model: nn.Module, config: OptimizerConfig,
                    kernels: Kernels | None = None) -> torch.optim.AdamW:
    """AdamW; norms and other 1-D parameters get no weight decay (as in Megatron)."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    extra = {"fused": True} if kernels is not None and kernels.fused_adamw else {"foreach": True}
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                             eps=config.adam_eps, **extra)


class LRSchedule:
    """Linear warm-up to ``lr``, then cosine / linear / constant decay to ``min_lr``.

    ``lr_at(it)`` gives the rate used by iteration ``it`` (1-based), so the first step already
    moves the weights.
    """

    def __init__(self, config: OptimizerConfig, train_iters: int) -> None:
        self.config = config
        self.decay_iters = config.lr_decay_iters or train_iters
        if self.decay_iters < config.lr_warmup_iters:
            raise ConfigError(f"--lr-warmup-iters {config.lr_warmup_iters} exceeds the decay "
                              f"length {self.decay_iters} (--lr-decay-iters or --train-iters)")

    def lr_at(self, iteration: int) -> float:
        c = self.config
        if c.lr_warmup_iters > 0 and iteration <= c.lr_warmup_iters:
            return c.lr * iteration / c.lr_warmup_iters
        if c.lr_decay_style == "constant":
            return c.lr
        if iteration >= self.decay_iters:
            return c.min_lr
        ratio = (iteration - c.lr_warmup_iters) / max(1, self.decay_iters - c.lr_warmup_iters)
        if c.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        else:  # cosine
            coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
        return c.min_lr + coeff * (c.lr - c.min_lr)

    def apply(self, optimizer: torch.optim.Optimizer, iteration: int) -> float:
        lr = self.lr_at(iteration)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr


def optimizer_state_to_named(optimizer: torch.optim.Optimizer,
                             names: dict[nn.Parameter, str]) -> dict[str, torch.Tensor]:
    """Adam moments and step as ``{"<param name>.<state>": tensor}``."""
    out: dict[str, torch.Tensor] = {}
    for param, state in optimizer.state.items():
        name = names[param]
        for key in (*ADAM_STATES, "step"):
            if key in state:
                out[f"{name}.{key}"] = torch.as_tensor(state[key]).detach().clone()
    return out


def load_named_optimizer_state(optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str],
                               tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`optimizer_state_to_named`; a parameter missing its state is an error."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = names[param]
            missing = [k for k in (*ADAM_STATES, "step") if f"{name}.{k}" not in tensors]
            if missing:
                raise ConfigError(f"checkpoint optimizer state lacks {name}.{missing[0]}; "
                                  "load with --no-load-optim to start the optimizer fresh")
            state = optimizer.state[param]
            for key in ADAM_STATES:
                state[key] = tensors[f"{name}.{key}"].to(param.device, param.dtype).clone()
            step_device = param.device if optimizer.defaults.get("fused") else "cpu"
            state["step"] = tensors[f"{name}.step"].to(step_device, torch.float32).clone()
