"""Read Megatron-LM checkpoints, at whatever TP/PP layout they were saved with, into megatron_h2's
layout-independent state: whole tensors under our global names (:class:`MegatronState`).

Two formats, found in ``DIR/iter_NNNNNNN/`` next to ``DIR/latest_checkpointed_iteration.txt``:

- ``torch_dist`` (Megatron-Core distributed checkpointing): ``metadata.json`` naming the
  backend, ``common.pt`` (args, iteration, scheduler, the optimizer's parameter groups) and
  torch.distributed.checkpoint files (``.metadata``, ``*.distcp``) holding every tensor at its
  global shape, the decoder's layers stacked on a leading layer axis
  (``decoder.layers.mlp.linear_fc1.weight`` [L, ...]). Read with torch's checkpoint reader,
  without a process group. Per-layer ``_extra_state`` objects and RNG states are reported, not
  read (nothing is unpickled from the tensor files).
- ``torch`` (legacy): ``mp_rank_TT[_PPP]/model_optim_rng.pt`` per TP rank TT and pipeline
  stage PPP, each stage numbering its layers from 0; TP shards are merged by Megatron's
  partitioning (:func:`~.megatron_names.tp_rule`).

Optimizer state comes over where present: Adam's moments and step, and the fp32 main weights of
a mixed-precision run (which then are the weights, as in our own checkpoints); the distributed
optimizer's flat buffers are read by :mod:`~.megatron_distopt`. Strict: every
tensor of the model must be found, every tensor of the checkpoint is used or named in an error,
and a bad file is one line naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_h2.checkpointing.hf_tensors import megatron_shapes
from megatron_h2.checkpointing.megatron_dist import read_dist_tensors
from megatron_h2.checkpointing.megatron_distopt import PREFIX as DISTOPT_PREFIX
from megatron_h2.checkpointing.megatron_distopt import read_distrib_optim, read_dp_reshardable
from megatron_h2.checkpointing.megatron_moe import (
    DIST_EXPERTS,
    expert_parallel_size,
    globalize,
    parse_rank_dir,
    rank_dir_name,
    unstack_experts,
)
from megatron_h2.checkpointing.megatron_names import (
    CHECKPOINT_VERSION,
    DIST_NORM_NAMES,
    LAYER_PREFIX,
    MODEL_ARG_FIELDS,
    args_dict,
    is_no_weight_decay,
    merge_tp,
    model_config_from_args,
    safe_torch_load,
    split_layer_name,
)
from megatron_h2.config import ModelConfig
from megatron_h2.errors import ConfigError

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
_SAME_ARGS = (*MODEL_ARG_FIELDS, "padded_vocab_size", "tensor_model_parallel_size",
              "pipeline_model_parallel_size", "expert_model_parallel_size")
_MP_RANK = re.compile(r"^mp_rank_(\d{2})(?:_\d{3}){0,2}$")


@dataclass
class MegatronState:
    """A Megatron-LM checkpoint in megatron_h2's terms."""

    path: Path
    format: str  # "torch_dist" or "torch"
    iteration: int
    args: dict[str, Any]
    config: ModelConfig
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor] = field(default_factory=dict)  # "<name>.exp_avg" ...
    scheduler: dict[str, Any] | None = None
    not_read: list[str] = field(default_factory=list)  # entries reported, not carried over

    @property
    def consumed_samples(self) -> int:
        return int(self.args.get("consumed_train_samples") or 0)

    @property
    def consumed_valid_samples(self) -> int:
        return int(self.args.get("consumed_valid_samples") or 0)


def detect_format(ckpt_dir: Path) -> str:
    """``torch_dist``, ``torch`` (legacy Megatron-LM) or ``megatron_h2`` for one iteration
    directory (a directory that is neither counts as an incomplete megatron_h2 one)."""
    if not ckpt_dir.is_dir():
        raise ConfigError(f"checkpoint directory {ckpt_dir} does not exist")
    meta = ckpt_dir / "metadata.json"
    if meta.is_file():
        try:
            data = json.loads(meta.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise ConfigError(f"checkpoint metadata {meta} is corrupt (not JSON)") from None
        if isinstance(data, dict) and "sharded_backend" in data:
            return "torch_dist"
        return "megatron_h2"
    if any(_MP_RANK.match(p.name) for p in ckpt_dir.iterdir() if p.is_dir()):
        return "torch"
    return "megatron_h2"  # whose reader names what is missing


def _check_common(state: Any, where: Path) -> tuple[dict[str, Any], int]:
    if not isinstance(state, dict):
        raise ConfigError(f"checkpoint file {where} holds a {type(state).__name__}, not "
                          "Megatron-LM's state dict")
    version = state.get("checkpoint_version")
    if version != CHECKPOINT_VERSION:
        raise ConfigError(f"checkpoint file {where} has checkpoint_version "
                          f"{str(version)[:20]}; this build reads Megatron-LM's version "
                          f"{CHECKPOINT_VERSION} (convert older ones with Megatron-LM first)")
    iteration = state.get("iteration")
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        raise ConfigError(f"checkpoint file {where} has iteration {str(iteration)[:20]!r}, "
                          "expected a non-negative integer")
    return args_dict(state.get("args"), where), iteration


def _scheduler(state: dict[str, Any], where: Path) -> dict[str, Any] | None:
    sched = state.get("opt_param_scheduler")
    if sched is not None and not (isinstance(sched, dict) and "num_steps" in sched):
        raise ConfigError(f"checkpoint file {where}: opt_param_scheduler is malformed")
    return sched


def _check_complete(state: MegatronState) -> None:
    """Every tensor of the model found with its shape; nothing left over."""
    shapes = megatron_shapes(state.config)
    want = list(shapes)
    missing = [n for n in want if n not in state.model]
    if missing:
        raise ConfigError(f"checkpoint {state.path} has no tensor {missing[0]}"
                          f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''} of "
                          "the model its args describe; a shard is missing or the file is corrupt")
    extra = sorted(set(state.model) - set(want))
    if extra:
        raise ConfigError(f"checkpoint {state.path} holds {extra[0]}, which the model its args "
                          "describe does not have; the checkpoint is not of that model")
    for name, tensor in state.model.items():
        if name in shapes and tuple(tensor.shape) != shapes[name]:
            raise ConfigError(f"checkpoint {state.path}: {name} has shape "
                              f"{tuple(tensor.shape)}, its args say {shapes[name]}")
    if state.optimizer:
        lacking = [f"{n}.{k}" for n in want for k in (*ADAM_KEYS, "step")
                   if f"{n}.{k}" not in state.optimizer]
        if lacking:
            raise ConfigError(f"checkpoint {state.path} has no optimizer state {lacking[0]}"
                              f"{f' (and {len(lacking) - 1} more)' if len(lacking) > 1 else ''}"
                              "; a file is incomplete (load with --no-load-optim to skip it)")
    for key, tensor in state.optimizer.items():
        name = key.rsplit(".", 1)[0]
        if name not in state.model:
            raise ConfigError(f"checkpoint {state.path} holds optimizer state {key} of no "
                              "parameter of the model")
        if key.endswith(ADAM_KEYS) and tensor.shape != state.model[name].shape:
            raise ConfigError(f"checkpoint {state.path}: optimizer state {key} has shape "
                              f"{tuple(tensor.shape)}, its parameter "
                              f"{tuple(state.model[name].shape)}")


# --- torch_dist ---------------------------------------------------------------------------------

def _dist_name(key: str, layers: int) -> list[str] | str | None:
    """Our name(s) for a torch_dist model key: a list of per-layer names for a stacked key."""
    if (layer := split_layer_name(key)) is not None:  # keyed per layer (non-homogeneous)
        return f"{LAYER_PREFIX}{layer[0]}.{DIST_NORM_NAMES.get(layer[1], layer[1])}"
    if key.startswith(LAYER_PREFIX):
        sub = key[len(LAYER_PREFIX):]
        sub = DIST_NORM_NAMES.get(sub, sub)
        return [f"{LAYER_PREFIX}{i}.{sub}" for i in range(layers)]
    return key


def read_torch_dist(ckpt_dir: Path, load_optim: bool = True) -> MegatronState:
    """A ``torch_dist`` iteration directory (without ``load_optim``, its optimizer tensors are
    listed as not read, whatever their layout)."""
    common_path = ckpt_dir / "common.pt"
    common = safe_torch_load(common_path)
    args, iteration = _check_common(common, common_path)
    config = model_config_from_args(args, common_path)
    expert_parallel_size(args, common_path, load_optim)
    optim = common.get("optimizer")
    sharding = optim.get("param_state_sharding_type") if isinstance(optim, dict) else None
    if load_optim and sharding not in (None, "fully_reshardable", "dp_reshardable"):
        raise ConfigError(f"checkpoint {common_path}: the distributed optimizer's state is "
                          f"saved {sharding!r}, which this build does not read; load with "
                          "--no-load-optim, or re-save it with Megatron-LM's "
                          "--dist-ckpt-optim-fully-reshardable")
    tensors, objects = read_dist_tensors(ckpt_dir, None if load_optim else "optimizer.")
    state = MegatronState(ckpt_dir, "torch_dist", iteration, args, config, {},
                          scheduler=_scheduler(common, common_path))
    flat_mains: dict[str, torch.Tensor] = {}
    if load_optim and sharding == "dp_reshardable":
        flat = {k: tensors.pop(k) for k in list(tensors) if k.startswith(DISTOPT_PREFIX)}
        flat_mains, state.optimizer = read_dp_reshardable(
            ckpt_dir, flat, objects, megatron_shapes(config), args)
        objects = [k for k in objects if not k.startswith(DISTOPT_PREFIX)]
    layers = config.num_layers
    # "param": the distributed optimizer's fp32 main weights in its model-space layouts
    optim_keys = {f"optimizer.state.{k}.": k for k in (*ADAM_KEYS, "fp32_param", "param")}
    mains: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        kind = next((k for p, k in optim_keys.items() if key.startswith(p)), None)
        model_key = key[len(f"optimizer.state.{kind}."):] if kind else key
        if not kind and key.startswith("optimizer."):
            raise ConfigError(f"checkpoint {ckpt_dir} holds optimizer tensor {key}, a layout "
                              "this build does not read (distributed optimizer?); load with "
                              "--no-load-optim or convert it with Megatron-LM's "
                              "--dist-ckpt-optim-fully-reshardable")
        names = _dist_name(model_key, layers)
        layer = split_layer_name(model_key)
        if layer is not None and layer[1].startswith(DIST_EXPERTS):
            pieces = unstack_experts(key, layer[1], tensor, config, ckpt_dir, layer[0])
        elif model_key.startswith(LAYER_PREFIX + DIST_EXPERTS):
            pieces = unstack_experts(key, model_key[len(LAYER_PREFIX):], tensor, config, ckpt_dir)
        elif isinstance(names, list):
            if tensor.dim() < 1 or tensor.shape[0] != layers:
                raise ConfigError(f"checkpoint {ckpt_dir}: {key} has shape "
                                  f"{tuple(tensor.shape)}, expected {layers} stacked layers")
            pieces = dict(zip(names, tensor.unbind(0)))
        else:
            pieces = {names: tensor}
        for name, piece in pieces.items():
            if kind in ("fp32_param", "param"):
                mains[name] = piece.clone()
            elif kind:
                state.optimizer[f"{name}.{kind}"] = piece.clone()
            else:
                state.model[name] = piece.clone()
    mains = mains or flat_mains
    if mains and set(mains) != set(state.model):
        missing = sorted(set(state.model) - set(mains))
        raise ConfigError(f"checkpoint {ckpt_dir} has fp32 main weights for some parameters but "
                          f"not {missing[0] if missing else 'others'}; a file is incomplete")
    _take_mains(state, mains)
    state.not_read = objects
    if state.optimizer and not flat_mains:
        step = _common_step(optim)
        if step is None:
            raise ConfigError(f"checkpoint {common_path} has optimizer moments but no Adam "
                              "step (optimizer.state.common_step or the parameter groups' step)")
        for name in state.model:
            state.optimizer[f"{name}.step"] = torch.as_tensor(step, dtype=torch.float32)
    _check_complete(state)
    return state


def _take_mains(state: MegatronState, mains: dict[str, torch.Tensor]) -> None:
    """The fp32 main weights are the weights. An fp32 run's are its weights themselves: one
    that differs is another parameter's (a misread optimizer layout), one line."""
    for name, main in mains.items():
        model = state.model.get(name)
        if model is None or main.shape != model.shape:
            raise ConfigError(f"checkpoint {state.path}: fp32 main weight of {name} matches no "
                              "model tensor")
        if model.dtype == torch.float32 and not torch.equal(main, model):
            raise ConfigError(f"checkpoint {state.path}: the optimizer's fp32 main weight of "
                              f"{name} differs from the fp32 weight itself; the optimizer state "
                              "is not this model's (load with --no-load-optim)")
        state.model[name] = main


def _common_step(optim: Any) -> Any:
    """Adam's step count in ``common.pt``: ``state.common_step`` (Megatron's plain optimizer) or
    the parameter groups' ``step`` (the distributed optimizer, whose groups all agree)."""
    if not isinstance(optim, dict):
        return None
    if (step := optim.get("state", {}).get("common_step")) is not None:
        return step
    groups = optim.get("optimizer", {}).get("param_groups") or [{}]
    steps = {group.get("step") for group in groups}
    return steps.pop() if len(steps) == 1 else None


# --- legacy torch -------------------------------------------------------------------------------

def _rank_dirs(ckpt_dir: Path, pp: int, ep: int) -> dict[tuple[int, int, int], Path]:
    """Every (TP, PP, EP) rank's shard directory; one outside the args' TP x PP x EP grid, or
    missing from it, is one line."""
    names = sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and _MP_RANK.match(p.name))
    found = {key: ckpt_dir / n for n in names if (key := parse_rank_dir(n, pp, ep)) is not None}
    strays = [n for n in names if parse_rank_dir(n, pp, ep) is None]
    if strays:
        raise ConfigError(f"checkpoint {ckpt_dir} has shard directory {strays[0]}, not of the "
                          f"PP {pp} x EP {ep} layout its args name")
    return found


def _first_rank_dir(ckpt_dir: Path) -> Path:
    first = next((ckpt_dir / n for n in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000")
                  if (ckpt_dir / n).is_dir()), None)
    if first is None:
        raise ConfigError(f"checkpoint {ckpt_dir} is missing shard directory mp_rank_00 "
                          "(or mp_rank_00_000)")
    return first


def _check_grid(ckpt_dir: Path, found: dict[tuple[int, int, int], Path], tp: int, pp: int,
                ep: int) -> None:
    """Every TP rank of every stage and EP rank that the args name, and nothing else."""
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                if (t, p, e) not in found:
                    raise ConfigError(f"checkpoint {ckpt_dir} is missing shard directory "
                                      f"{rank_dir_name(t, p, e, pp, ep)} (a TP {tp} x PP {pp}"
                                      f"{f' x EP {ep}' if ep > 1 else ''} checkpoint)")
    extra = sorted(found[k].name for k in found if k[0] >= tp or k[1] >= pp or k[2] >= ep)
    if extra:
        raise ConfigError(f"checkpoint {ckpt_dir} has shard directory {extra[0]}, outside the "
                          f"TP {tp} x PP {pp}{f' x EP {ep}' if ep > 1 else ''} its args name")


def _param_names(model_sd: dict[str, Any]) -> list[str]:
    return [k for k, v in model_sd.items() if isinstance(v, torch.Tensor)]


def _optimizer_by_name(optim: Any, model_sd: dict[str, Any],
                       where: Path) -> dict[str, torch.Tensor]:
    """One rank's optimizer state keyed ``<local name>.<state>``. Megatron's parameter ids run
    over its groups: the decayed parameters in module order, then the others."""
    inner = optim.get("optimizer", optim) if isinstance(optim, dict) else None
    if not isinstance(inner, dict) or not {"state", "param_groups"} <= set(inner):
        raise ConfigError(f"checkpoint file {where}: optimizer state is not Megatron's "
                          "(no state / param_groups)")
    names = _param_names(model_sd)
    ordered = ([n for n in names if not is_no_weight_decay(n, model_sd[n])]
               + [n for n in names if is_no_weight_decay(n, model_sd[n])])
    ids = [i for group in inner["param_groups"] for i in group.get("params", [])]
    if len(ids) != len(ordered):
        raise ConfigError(f"checkpoint file {where}: the optimizer has {len(ids)} parameters, "
                          f"the model {len(ordered)}; cannot match them")
    out: dict[str, torch.Tensor] = {}
    for pid, name in zip(ids, ordered):
        entry = inner["state"].get(pid, {})
        for key in (*ADAM_KEYS, "step"):
            if key not in entry:
                raise ConfigError(f"checkpoint file {where}: optimizer state of {name} has no "
                                  f"{key}")
            value = torch.as_tensor(entry[key])
            if key != "step" and value.shape != model_sd[name].shape:
                raise ConfigError(f"checkpoint file {where}: optimizer {key} of parameter id "
                                  f"{pid} has shape {tuple(value.shape)}, {name} has "
                                  f"{tuple(model_sd[name].shape)}; cannot match them")
            out[f"{name}.{key}"] = value
    mains = optim.get("fp32_from_fp16_params") if "optimizer" in optim else None
    if mains is not None:
        flat = [t for group in mains for t in group]
        for name, main in zip(ordered, flat):
            out[f"{name}.main"] = main
    return out


def _legacy_rank(sd: Any, where: Path, args: dict[str, Any], iteration: int, stage: int,
                 load_optim: bool, state: MegatronState) -> list[tuple[str, torch.Tensor]]:
    """One shard file's tensors and optimizer state under its local names, checked to be of
    the same run as the first shard; its non-tensor entries go to ``state.not_read``."""
    its_args, its_iteration = _check_common(sd, where)
    if its_iteration != iteration:
        raise ConfigError(f"checkpoint file {where} is of iteration {its_iteration}, "
                          f"not {iteration}")
    differs = [k for k in _SAME_ARGS if its_args.get(k) != args.get(k)]
    if differs:
        raise ConfigError(f"checkpoint file {where} has {differs[0]}="
                          f"{str(its_args.get(differs[0]))[:20]}, the first shard "
                          f"{str(args.get(differs[0]))[:20]}; the shards are of different runs")
    model_sd = sd.get("model")
    if not isinstance(model_sd, dict):
        raise ConfigError(f"checkpoint file {where} has no model state")
    tensors = {k: v for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    state.not_read += [f"{where.parent.name}/{k}" for k in model_sd if k not in tensors]
    if (distrib := where.parent / "distrib_optim.pt").exists() and load_optim:
        optim = read_distrib_optim(distrib, sd.get("optimizer"),
                                   {k: tuple(v.shape) for k, v in tensors.items()},
                                   its_args, stage)
    else:
        optim = (_optimizer_by_name(sd["optimizer"], model_sd, where)
                 if load_optim and sd.get("optimizer") is not None else {})
    return [*tensors.items(), *optim.items()]


def read_legacy(ckpt_dir: Path, load_optim: bool = True) -> MegatronState:
    """A legacy ``torch`` iteration directory (``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``)."""
    first = _first_rank_dir(ckpt_dir) / "model_optim_rng.pt"
    head = safe_torch_load(first)
    args, iteration = _check_common(head, first)
    tp, pp = (args.get(k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size"))
    if not all(isinstance(v, int) and v >= 1 for v in (tp, pp)):
        raise ConfigError(f"checkpoint file {first}: args name no valid TP / PP size")
    config = model_config_from_args(args, first)
    ep = expert_parallel_size(args, first, load_optim)
    etp = args.get("expert_tensor_parallel_size") or tp
    if config.is_moe and etp != tp:
        raise ConfigError(f"checkpoint file {first}: args.expert_tensor_parallel_size {etp} "
                          f"differs from its TP {tp}; this build reads legacy files with "
                          "experts split like the dense layers only: save it as torch_dist")
    dirs = _rank_dirs(ckpt_dir, pp, ep)
    _check_grid(ckpt_dir, dirs, tp, pp, ep)
    files = {key: d / "model_optim_rng.pt" for key, d in dirs.items()}
    loaded = {key: head if files[key] == first else safe_torch_load(path)
              for key, path in sorted(files.items())}
    state = MegatronState(ckpt_dir, "torch", iteration, args, config, {},
                          scheduler=_scheduler(head, first))
    per_name: dict[str, list[torch.Tensor]] = {}
    offset = 0
    for p in range(pp):
        stage_layers = set()
        for t in range(tp):
            replicated: dict[str, torch.Tensor] = {}
            for e in range(ep):
                where, seen = files[(t, p, e)], set()
                for local, tensor in _legacy_rank(loaded[(t, p, e)], where, args, iteration, p,
                                                  load_optim, state):
                    layer = split_layer_name(local)
                    if layer is not None:
                        stage_layers.add(layer[0])
                        local = f"{LAYER_PREFIX}{offset + layer[0]}.{layer[1]}"
                    if ep > 1 and (name := globalize(local, e, config.num_experts // ep, where)):
                        per_name.setdefault(name, []).append(tensor)
                        continue
                    seen.add(local)
                    if e == 0:
                        replicated[local] = tensor
                        per_name.setdefault(local, []).append(tensor)
                    elif not torch.equal(replicated.get(local, tensor.new_empty(0)), tensor):
                        raise ConfigError(f"checkpoint file {where}: {local} differs from EP "
                                          "rank 0's copy (or it has none)")
                if lacking := sorted(set(replicated) - seen):
                    raise ConfigError(f"checkpoint file {where} has no {lacking[0]}, which EP "
                                      "rank 0's file has; the file is incomplete")
        offset += len(stage_layers)
    if offset != config.num_layers:
        raise ConfigError(f"checkpoint {ckpt_dir} holds {offset} layers across its {pp} stages, "
                          f"its args say --num-layers {config.num_layers}")
    mains = {}
    for name, shards in per_name.items():
        if len(shards) != tp:
            raise ConfigError(f"checkpoint {ckpt_dir}: {name} is on {len(shards)} shards, "
                              f"expected {tp}")
        full = merge_tp(name, shards, config.swiglu, ckpt_dir)
        if name.endswith(".main"):
            mains[name[: -len(".main")]] = full
        elif name.rsplit(".", 1)[-1] in (*ADAM_KEYS, "step"):
            state.optimizer[name] = full
        else:
            state.model[name] = full
    _take_mains(state, mains)
    _fold_tied_copy(state)
    _check_complete(state)
    return state


def _fold_tied_copy(state: MegatronState) -> None:
    """A tied model split over stages keeps a copy of the embedding as the last stage's
    ``output_layer.weight``: it must equal the embedding, and is then used as that."""
    copy = "output_layer.weight"
    if not state.config.tied_embeddings or copy not in state.model:
        return
    if not torch.equal(state.model[copy], state.model["embedding.word_embeddings.weight"]):
        raise ConfigError(f"checkpoint {state.path}: the last stage's copy of the tied "
                          "embedding differs from the first stage's; the checkpoint is "
                          "inconsistent")
    del state.model[copy]
    for key in [k for k in state.optimizer if k.startswith(copy + ".")]:
        del state.optimizer[key]


def read_header(ckpt_dir: Path) -> MegatronState:
    """Args, iteration and scheduler of either format, without the tensors (``common.pt``, or
    the first legacy shard): what start-up checks need."""
    fmt = detect_format(ckpt_dir)
    if fmt == "torch_dist":
        path = ckpt_dir / "common.pt"
    elif fmt == "torch":
        path = _first_rank_dir(ckpt_dir) / "model_optim_rng.pt"
    else:
        raise ConfigError(f"{ckpt_dir} is a megatron_h2 checkpoint, not a Megatron-LM one")
    common = safe_torch_load(path)
    args, iteration = _check_common(common, path)
    return MegatronState(ckpt_dir, fmt, iteration, args, model_config_from_args(args, path), {},
                         scheduler=_scheduler(common, path))


def read_megatron(ckpt_dir: Path, load_optim: bool = True) -> MegatronState:
    """Either format, detected from the directory."""
    fmt = detect_format(ckpt_dir)
    if fmt == "torch_dist":
        return read_torch_dist(ckpt_dir, load_optim)
    if fmt == "torch":
        return read_legacy(ckpt_dir, load_optim)
    raise ConfigError(f"{ckpt_dir} is a megatron_h2 checkpoint, not a Megatron-LM one")
