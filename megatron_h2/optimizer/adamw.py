"""AdamW with Megatron's parameter groups, and optimizer state as named tensors (for
layout-independent checkpoints)."""

from __future__ import annotations

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
