"""Megatron-LM's mixture-of-experts checkpoint conventions (local ``SequentialMLP`` experts).

Our names key each expert by its global index:
``decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight``. Megatron-Core writes
them two ways:

- ``torch_dist``: one tensor per expert weight, stacked over layers and global experts,
  ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` of shape ``[layers, experts, ...]``
  (``SequentialMLP.sharded_state_dict``), whatever the expert-parallel size it was saved at;
  with dense layers among the MoE ones (``--moe-layer-freq`` other than 1) Megatron-Core keys
  every layer apart (``decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight`` of shape
  ``[experts, ...]``, ``decoder.layers.{i}.self_attention...``): :func:`per_layer_keys`;
- legacy ``torch``: each expert-parallel rank ``e`` saves its ``experts / EP`` local experts in
  ``mp_rank_TT[_PPP]_EEE/`` (the ``_EEE`` only when EP > 1, as Megatron-LM's
  ``get_checkpoint_name``), numbered from 0 on every rank; the other tensors are replicated.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from megatron_h2.checkpointing.megatron_names import OUR_NORM_NAMES, split_layer_name
from megatron_h2.config import ModelConfig
from megatron_h2.errors import ConfigError

DIST_EXPERTS = "mlp.experts.experts."
"""torch_dist's per-layer key of the stacked expert weights (after ``decoder.layers.``)."""
OUR_EXPERTS = "mlp.experts.local_experts."
_LOCAL = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_MP_RANK = re.compile(r"^mp_rank_(\d{2})((?:_\d{3}){0,2})$")

UNSUPPORTED_MOE_ARGS = {
    "moe_grouped_gemm": False, "moe_use_legacy_grouped_gemm": False,
    "moe_expert_capacity_factor": None, "moe_router_enable_expert_bias": False,
}
"""MoE args whose other values change the checkpoint's layout or the model beyond what this
build reads (TEGroupedMLP's stacked ``weight{e}`` tensors, token dropping, a bias buffer)."""


def expert_parallel_size(args: dict[str, Any], where: Path, load_optim: bool) -> int:
    """The EP size the checkpoint was saved at (1 for a dense model), its MoE args checked."""
    if not args.get("num_experts"):
        return 1
    if load_optim and args.get("use_distributed_optimizer"):
        raise ConfigError(f"checkpoint {where}: the distributed optimizer's state of a "
                          "mixture-of-experts model is not read by this build; load with "
                          "--no-load-optim")
    for name, default in UNSUPPORTED_MOE_ARGS.items():
        if args.get(name, default) not in (default, 0):
            raise ConfigError(f"checkpoint {where}: args.{name} is {args[name]!r}; this build "
                              f"reads only {default!r} (Megatron-Core's local SequentialMLP "
                              "experts)")
    ep = args.get("expert_model_parallel_size", 1)
    if not isinstance(ep, int) or ep < 1 or args["num_experts"] % ep:
        raise ConfigError(f"checkpoint {where}: args.expert_model_parallel_size is {ep!r}, "
                          f"which does not divide --num-experts {args['num_experts']}")
    return ep


def parse_rank_dir(name: str, pp: int, ep: int) -> tuple[int, int, int] | None:
    """``mp_rank_TT[_PPP][_EEE]`` -> (TP, PP, EP rank), the suffixes read as the args' PP and
    EP sizes say (None: not a shard directory of that layout)."""
    match = _MP_RANK.match(name)
    if not match:
        return None
    rest = [int(x) for x in match.group(2).split("_")[1:]]
    if len(rest) != (pp > 1) + (ep > 1):
        return None
    p = rest.pop(0) if pp > 1 else 0
    e = rest.pop(0) if ep > 1 else 0
    return int(match.group(1)), p, e


def rank_dir_name(t: int, p: int, e: int, pp: int, ep: int) -> str:
    return f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")


def globalize(name: str, ep_rank: int, local_experts: int, where: Path) -> str | None:
    """A legacy file's local expert name on EP rank ``ep_rank`` -> our global one (None: not an
    expert tensor)."""
    match = _LOCAL.match(name)
    if not match:
        return None
    local = int(match.group(2))
    if local >= local_experts:
        raise ConfigError(f"checkpoint file {where} holds {name}, but its args give each EP "
                          f"rank {local_experts} experts")
    return f"{match.group(1)}{ep_rank * local_experts + local}{match.group(3)}"


def per_layer_keys(config: ModelConfig) -> bool:
    """Whether Megatron-Core keys each layer apart in torch_dist (its ``non_homogeneous_layers``:
    a ``--moe-layer-freq`` list, or an integer above 1)."""
    freq = config.moe_layer_freq
    return config.num_experts is not None and (isinstance(freq, list) or freq > 1)


def unstack_experts(key: str, sub: str, tensor: torch.Tensor, config: ModelConfig,
                    where: Path, layer: int | None = None) -> dict[str, torch.Tensor]:
    """torch_dist's ``[layers, experts, ...]`` tensor of ``decoder.layers.<sub>`` (or the
    ``[experts, ...]`` one of ``decoder.layers.<layer>.<sub>``) -> our per-layer, per-expert
    tensors."""
    layers = [layer] if layer is not None else list(range(config.num_layers))
    want = (*([] if layer is not None else [config.num_layers]), config.num_experts or 0)
    if tensor.dim() < len(want) + 1 or tuple(tensor.shape[:len(want)]) != want:
        raise ConfigError(f"checkpoint {where}: {key} has shape {tuple(tensor.shape)}, expected "
                          f"{' x '.join(map(str, want))} (layers x) experts first")
    rest = sub[len(DIST_EXPERTS):]
    stacked = tensor if layer is None else tensor.unsqueeze(0)
    return {f"decoder.layers.{i}.{OUR_EXPERTS}{e}.{rest}": stacked[n, e]
            for n, i in enumerate(layers) for e in range(want[-1])}


def is_expert(name: str) -> bool:
    return f".{OUR_EXPERTS}" in name


def stack_experts(tensors: dict[str, torch.Tensor], layers: int, experts: int
                  ) -> dict[str, torch.Tensor]:
    """Inverse of :func:`unstack_experts` for the expert weights in ``tensors`` (our names ->
    ``decoder.layers.mlp.experts.experts.<rest>``, ``[layers, experts, ...]``); a missing
    layer or expert is one line."""
    rests = sorted({n.split(f".{OUR_EXPERTS}", 1)[1].split(".", 1)[1]
                    for n in tensors if is_expert(n)})
    out = {}
    for rest in rests:
        names = [[f"decoder.layers.{i}.{OUR_EXPERTS}{e}.{rest}" for e in range(experts)]
                 for i in range(layers)]
        missing = [n for row in names for n in row if n not in tensors]
        if missing:
            raise ConfigError(f"state has no {missing[0]} (expected {layers} layers x "
                              f"{experts} experts)")
        out[f"decoder.layers.{DIST_EXPERTS}{rest}"] = torch.stack(
            [torch.stack([tensors[n] for n in row]) for row in names])
    return out


def expert_extra_states(layers: int, experts: int, shared: bool) -> dict[str, list[None]]:
    """The ``_extra_state`` objects of an MoE layer's linears as Megatron-Core saves them: each
    expert's keyed by (layer, global expert), the shared expert's by layer."""
    out: dict[str, list[None]] = {}
    for linear in ("linear_fc1", "linear_fc2"):
        for i in range(layers):
            for e in range(experts):
                out[f"decoder.layers.{DIST_EXPERTS}{linear}._extra_state/"
                    f"shard_{i}.{e}_{layers}.{experts}"] = [None]
            if shared:
                out[f"decoder.layers.mlp.shared_experts.{linear}._extra_state/"
                    f"shard_{i}_{layers}"] = [None]
    return out


def layer_keyed(tensors: dict[str, torch.Tensor], config: ModelConfig
                ) -> dict[str, torch.Tensor]:
    """Our tensors -> Megatron-Core's torch_dist keys when it keys each layer apart
    (:func:`per_layer_keys`): the layer norms under their fused names, each MoE layer's experts
    stacked ``[experts, ...]``."""
    experts = config.num_experts or 0
    out: dict[str, torch.Tensor] = {}
    grouped: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        layer = split_layer_name(name)
        if layer is None:
            out[name] = tensor
        elif layer[1].startswith(OUR_EXPERTS):
            index, rest = layer[1][len(OUR_EXPERTS):].split(".", 1)
            grouped.setdefault((layer[0], rest), {})[int(index)] = tensor
        else:
            out[f"decoder.layers.{layer[0]}.{OUR_NORM_NAMES.get(layer[1], layer[1])}"] = tensor
    for (i, rest), per_expert in grouped.items():
        if sorted(per_expert) != list(range(experts)):
            raise ConfigError(f"state has layer {i}'s {rest} for experts {sorted(per_expert)}, "
                              f"not all {experts}")
        out[f"decoder.layers.{i}.{DIST_EXPERTS}{rest}"] = torch.stack(
            [per_expert[e] for e in range(experts)])
    return out


def layer_keyed_extra_states(config: ModelConfig) -> dict[str, list[None]]:
    """The ``_extra_state`` objects Megatron-Core saves when it keys each layer apart."""
    experts, shared = config.num_experts or 0, bool(config.moe_shared_expert_intermediate_size)
    out: dict[str, list[None]] = {}
    for i in range(config.num_layers):
        prefix = f"decoder.layers.{i}."
        linears = ["self_attention.linear_proj", "self_attention.linear_qkv"]
        if config.is_moe_layer(i):
            linears += [f"mlp.shared_experts.{x}" for x in ("linear_fc1", "linear_fc2") if shared]
            for linear in ("linear_fc1", "linear_fc2"):
                out.update({f"{prefix}{DIST_EXPERTS}{linear}._extra_state/shard_{e}_{experts}":
                            [None] for e in range(experts)})
        else:
            linears += ["mlp.linear_fc1", "mlp.linear_fc2"]
        out.update({f"{prefix}{linear}._extra_state/shard_0_1": [None] for linear in linears})
    return out
