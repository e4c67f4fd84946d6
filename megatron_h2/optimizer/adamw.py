"""AdamW with Megatron's parameter groups, and optimizer state as named tensors (for
layout-independent checkpoints)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.optim.adamw import adamw

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


class AdamW:
    """``torch.optim.AdamW``'s update without ``torch.optim.Optimizer``: the same public
    functional step (``torch.optim.adamw.adamw``, so the same numbers, fused or ``foreach``
    kernels included) over the same ``param_groups`` and per-parameter ``state`` (``step``,
    ``exp_avg``, ``exp_avg_sq``).

    ``torch.optim.Optimizer`` wraps its constructor's ``add_param_group`` and its ``step`` for
    ``torch.compile``, which imports ``torch._dynamo`` (and sympy) in every process that builds
    one: about 2 s of CPU time per training process, which nothing here uses.
    """

    def __init__(self, groups: list[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, foreach: bool = False,
                 fused: bool = False) -> None:
        self.defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                         "foreach": foreach, "fused": fused}
        self.param_groups = [{**self.defaults, **group, "params": list(group["params"])}
                             for group in groups]
        self.state: defaultdict[torch.Tensor, dict[str, torch.Tensor]] = defaultdict(dict)

    def _state_of(self, param: torch.Tensor, fused: bool) -> dict[str, torch.Tensor]:
        """``param``'s state, zeros at its first step (``step`` on the CPU unless fused)."""
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32,
                                        device=param.device if fused else "cpu")
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step of every parameter that has a gradient."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            states = [self._state_of(p, group["fused"]) for p in params]
            beta1, beta2 = group["betas"]
            adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                  [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                  foreach=group["foreach"], fused=group["fused"], amsgrad=False, beta1=beta1,
                  beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                  eps=group["eps"], maximize=False)

    def zero_grad(self) -> None:
        """Drop every parameter's gradient (``set_to_none``, as torch's default)."""
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None


def build_optimizer(model: nn.Module, config: OptimizerConfig,
                    kernels: Kernels | None = None) -> AdamW:
    """AdamW over ``model``'s trainable parameters in Megatron's groups (:func:`param_groups`)."""
    items = [(name, p, p) for name, p in model.named_parameters() if p.requires_grad]
    return AdamW(param_groups(items, config), **adamw_kwargs(config, kernels))


def optimizer_state_to_named(optimizer: AdamW,
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


def load_named_optimizer_state(optimizer: AdamW, names: dict[nn.Parameter, str],
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
