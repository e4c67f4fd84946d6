"""AdamW with Megatron's parameter groups, and optimizer state as named tensors (for
layout-independent checkpoints)."""

from __future__ import annotations

import torch
from torch import nn

from megatron_h2.config import OptimizerConfig
from megatron_h2.devices.kernels import Kernels
from megatron_h2.errors import ConfigError

ADAM_STATES = ("exp_avg", "exp_avg_sq")


EMBEDDING_OR_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")
"""Parameters that ``--decoupled-lr`` / ``--decoupled-min-lr`` apply to (as Megatron's
``is_embedding_or_output_parameter``: the word embedding and the output layer weight)."""


def param_groups(items: list[tuple[str, nn.Parameter, torch.Tensor]],
                 config: OptimizerConfig) -> list[dict]:
    """Megatron's parameter groups for ``(name, parameter, tensor the optimizer updates)``.

    Norms and biases (``ndim < 2``) get no weight decay (``wd_mult`` 0); with
    ``--decoupled-lr`` the embedding and output layer form their own groups whose ``max_lr`` /
    ``min_lr`` the schedule uses. The plain decay and no-decay groups always come first (possibly
    empty), the decoupled ones after them when they hold something.
    """
    decoupled = config.decoupled_lr is not None
    buckets: dict[tuple[bool, bool], list[torch.Tensor]] = {
        (False, False): [], (True, False): [], (False, True): [], (True, True): []}
    for name, param, tensor in items:
        buckets[(param.ndim < 2, decoupled and name in EMBEDDING_OR_OUTPUT)].append(tensor)
    groups = []
    for (no_decay, special), tensors in buckets.items():
        if special and not tensors:
            continue
        group = {"params": tensors, "wd_mult": 0.0 if no_decay else 1.0,
                 "weight_decay": 0.0 if no_decay else config.start_wd}
        if special:
            group["max_lr"] = config.decoupled_lr
            group["min_lr"] = (config.min_lr if config.decoupled_min_lr is None
                               else config.decoupled_min_lr)
        groups.append(group)
    return groups


def adamw_kwargs(config: OptimizerConfig, kernels: Kernels | None) -> dict:
    """AdamW's hyper-parameters from the config (fused kernels where the device has them)."""
    extra = {"fused": True} if kernels is not None and kernels.fused_adamw else {"foreach": True}
    return {"lr": config.lr, "betas": (config.adam_beta1, config.adam_beta2),
            "eps": config.adam_eps, **extra}


def build_optimizer(model: nn.Module, config: OptimizerConfig,
                    kernels: Kernels | None = None) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters in Megatron's groups (:func:`param_groups`)."""
    items = [(name, p, p) for name, p in model.named_parameters() if p.requires_grad]
    return torch.optim.AdamW(param_groups(items, config), **adamw_kwargs(config, kernels))


def optimizer_state_to_named(optimizer: torch.optim.Optimizer,
                             names: dict[nn.Parameter, str],
                             skip: frozenset[int] = frozenset()) -> dict[str, torch.Tensor]:
    """Adam moments and step as ``{"<param name>.<state>": tensor}`` (of every tensor the
    optimizer holds but those whose ``id`` is in ``skip``)."""
    out: dict[str, torch.Tensor] = {}
    for param, state in optimizer.state.items():
        if id(param) in skip:
            continue
        name = names[param]
        for key in (*ADAM_STATES, "step"):
            if key in state:
                out[f"{name}.{key}"] = torch.as_tensor(state[key]).detach().clone()
    return out


def load_named_optimizer_state(optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str],
                               tensors: dict[str, torch.Tensor],
                               skip: frozenset[int] = frozenset()) -> None:
    """Inverse of :func:`optimizer_state_to_named`; a parameter missing its state is an error."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) in skip:
                continue
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
