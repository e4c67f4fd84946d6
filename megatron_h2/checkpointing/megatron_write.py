"""Write megatron_h2's layout-independent state as a Megatron-LM ``torch_dist`` checkpoint, and
convert between the two on disk.

A ``torch_dist`` checkpoint stores every tensor at its global shape, so one directory loads
under any TP/PP in Megatron-Core; what the target layout changes is the vocabulary padding
(Megatron pads to a multiple of ``--make-vocab-size-divisible-by`` x TP, megatron_h2 without
TP: the extra rows are zeros, and so are their Adam moments) and the args recorded. Written as
Megatron-LM's ``save_checkpoint`` writes it with the local layer spec: the decoder's tensors
stacked on a leading layer axis, the layer norms under their fused names, a ``_extra_state``
object (``[None]``) per linear layer and layer, Adam's moments as
``optimizer.state.exp_avg.<key>``, and ``common.pt`` with the args, iteration, scheduler and the
optimizer's parameter groups and common step.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from megatron_h2.checkpointing.format import LATEST_FILE, iteration_dir
from megatron_h2.checkpointing.megatron_moe import (
    expert_extra_states,
    is_expert,
    layer_keyed,
    layer_keyed_extra_states,
    per_layer_keys,
    stack_experts,
)
from megatron_h2.checkpointing.megatron_names import (
    CHECKPOINT_VERSION,
    LAYER_PREFIX,
    MODEL_ARG_FIELDS,
    OUR_NORM_NAMES,
    split_layer_name,
)
from megatron_h2.config import ModelConfig
from megatron_h2.errors import ConfigError

BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
           "common_backend": "torch", "common_backend_version": 1}
LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
           "mlp.linear_fc2")
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def target_vocab(config: ModelConfig, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary for our (already padded) one at ``tp``."""
    multiple = divisible_by * tp
    return -(-config.vocab_size // multiple) * multiple


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _megatron_key(name: str, layers: int) -> tuple[str, int | None]:
    """``decoder.layers.3.input_layernorm.weight`` ->
    (``decoder.layers.self_attention.linear_qkv.layer_norm_weight``, 3)."""
    layer = split_layer_name(name)
    if layer is None:
        return name, None
    return LAYER_PREFIX + OUR_NORM_NAMES.get(layer[1], layer[1]), layer[0]


def stack_layers(tensors: dict[str, torch.Tensor], layers: int, experts: int = 0
                 ) -> dict[str, torch.Tensor]:
    """Our per-layer tensors -> Megatron's torch_dist keys, layers stacked on dim 0 (and an
    MoE model's experts on dim 1)."""
    out: dict[str, torch.Tensor] = stack_experts(tensors, layers, experts)
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if is_expert(name):
            continue
        key, index = _megatron_key(name, layers)
        if index is None:
            out[key] = tensor
        else:
            stacked.setdefault(key, {})[index] = tensor
    for key, per_layer in stacked.items():
        if sorted(per_layer) != list(range(layers)):
            raise ConfigError(f"state has {key} for layers {sorted(per_layer)}, not all "
                              f"{layers}")
        out[key] = torch.stack([per_layer[i] for i in range(layers)])
    return out


def _keyed(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our tensors under Megatron-Core's torch_dist keys for this model."""
    if per_layer_keys(config):
        return layer_keyed(tensors, config)
    return stack_layers(tensors, config.num_layers, config.num_experts or 0)


def megatron_args(config: ModelConfig, tp: int, pp: int, vocab: int, divisible_by: int,
                  iteration: int, consumed: int, consumed_valid: int) -> argparse.Namespace:
    """The args Megatron-LM records (the model-defining ones and the run's position)."""
    values = {name: getattr(config, name) for name in MODEL_ARG_FIELDS}
    values.update(
        padded_vocab_size=vocab, make_vocab_size_divisible_by=divisible_by,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=1,
        add_position_embedding=config.position_embedding_type == "learned_absolute",
        consumed_train_samples=consumed, consumed_valid_samples=consumed_valid,
        iteration=iteration, ckpt_format="torch_dist", use_distributed_optimizer=False,
        params_dtype=torch.float32, transformer_impl="local")
    return argparse.Namespace(**values)


def _extra_states(config: ModelConfig) -> dict[str, list[None]]:
    """The per-layer ``_extra_state`` objects Megatron-Core's linear layers save (no FP8
    state: ``[None]``, which the checkpoint writer pickles), under its sharded-object keys."""
    if per_layer_keys(config):
        return layer_keyed_extra_states(config)
    layers, experts = config.num_layers, config.num_experts or 0
    linears = LINEARS[:2] if experts else LINEARS
    out = {f"{LAYER_PREFIX}{linear}._extra_state/shard_{i}_{layers}": [None]
           for linear in linears for i in range(layers)}
    if experts:
        out.update(expert_extra_states(layers, experts,
                                       bool(config.moe_shared_expert_intermediate_size)))
    return out


def _param_groups(optimizer: dict[str, Any]) -> list[dict[str, Any]]:
    """Megatron's two groups (decayed weights, then biases and norms) as its common state keeps
    them (without parameter ids)."""
    lr = float(optimizer.get("lr", 0.0))
    common = {"lr": lr, "betas": (float(optimizer.get("adam_beta1", 0.9)),
                                  float(optimizer.get("adam_beta2", 0.999))),
              "eps": float(optimizer.get("adam_eps", 1e-8)), "amsgrad": False}
    wd = float(optimizer.get("weight_decay", 0.01))
    return [{**common, "weight_decay": wd, "wd_mult": 1.0},
            {**common, "weight_decay": 0.0, "wd_mult": 0.0}]


def write_torch_dist(save_dir: str | os.PathLike, iteration: int, config: ModelConfig,
                     model: dict[str, torch.Tensor], optimizer: dict[str, torch.Tensor],
                     tp: int, pp: int, divisible_by: int, metadata: dict[str, Any]) -> Path:
    """Write ``SAVE/iter_NNNNNNN`` in torch_dist and point ``latest`` at it; returns the
    iteration directory. ``optimizer`` holds ``<name>.exp_avg`` / ``.exp_avg_sq`` / ``.step``
    (may be empty); ``metadata`` gives consumed samples, scheduler and optimizer settings."""
    if config.num_attention_heads % tp or config.num_query_groups % tp or \
            config.ffn_hidden_size % tp:
        raise ConfigError(f"--target-tensor-parallel-size {tp} does not divide the heads, query "
                          "groups or FFN size of this model")
    if config.num_layers % pp:
        raise ConfigError(f"--target-pipeline-parallel-size {pp} does not divide "
                          f"{config.num_layers} layers")
    vocab = target_vocab(config, divisible_by, tp)
    model = {k: _pad_rows(v, vocab) if k in VOCAB_ROWS else v for k, v in model.items()}
    state: dict[str, Any] = dict(_keyed(model, config))
    step = None
    if optimizer:
        for kind in ("exp_avg", "exp_avg_sq"):
            moments = {name: optimizer[f"{name}.{kind}"] for name in model}
            moments = {k: _pad_rows(v, vocab) if k in VOCAB_ROWS else v
                       for k, v in moments.items()}
            for key, tensor in _keyed(moments, config).items():
                state[f"optimizer.state.{kind}.{key}"] = tensor
        step = optimizer[f"{next(iter(model))}.step"].clone()
    state.update(_extra_states(config))
    out = iteration_dir(save_dir, iteration)
    out.mkdir(parents=True, exist_ok=False)
    # imported here: about 1 s of CPU time that a training process not writing this format skips
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_save({k: v.contiguous() if isinstance(v, torch.Tensor) else v
                  for k, v in state.items()},
                 storage_writer=FileSystemWriter(str(out)), no_dist=True)
    args = megatron_args(config, tp, pp, vocab, divisible_by, iteration,
                         int(metadata.get("consumed_samples", 0)),
                         int(metadata.get("consumed_valid_samples", 0)))
    common: dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                              "iteration": iteration, "num_floating_point_operations_so_far": 0}
    if metadata.get("opt_param_scheduler") is not None:
        common["opt_param_scheduler"] = dict(metadata["opt_param_scheduler"])
    if step is not None:
        optim_cfg = metadata.get("config", {}).get("optimizer", {})
        common["optimizer"] = {"state": {"common_step": step},
                               "param_groups": _param_groups(optim_cfg)}
    torch.save(common, out / "common.pt")
    (out / "metadata.json").write_text(json.dumps(BACKEND))
    (Path(save_dir) / LATEST_FILE).write_text(str(iteration))
    return out


# --- conversions on disk ------------------------------------------------------------------------

def _megatron_iteration_dir(input_dir: str | os.PathLike, iteration: int | None) -> Path:
    from megatron_h2.checkpointing.format import checkpoint_to_load

    ckpt_dir = checkpoint_to_load(input_dir, iteration)
    if ckpt_dir is None:
        raise ConfigError(f"{input_dir} holds no checkpoint ({LATEST_FILE} is missing)")
    return ckpt_dir


def convert_megatron_to_ours(input_dir: str | os.PathLike, output_dir: str | os.PathLike,
                             iteration: int | None = None) -> Path:
    """A Megatron-LM checkpoint (either format, any TP/PP) -> a megatron_h2 checkpoint of the
    same iteration with its optimizer state, consumed samples and scheduler."""
    from megatron_h2.checkpointing.format import save_checkpoint
    from megatron_h2.checkpointing.hf import _check_output
    from megatron_h2.checkpointing.megatron_read import read_megatron
    from megatron_h2.config import DataConfig, RunConfig

    out = _check_output(output_dir, megatron=True)
    state = read_megatron(_megatron_iteration_dir(input_dir, iteration))
    divisible = state.args.get("make_vocab_size_divisible_by")
    data = DataConfig(make_vocab_size_divisible_by=divisible) if isinstance(divisible, int) \
        else DataConfig()
    metadata: dict[str, Any] = {
        "config": RunConfig(model=state.config, data=data).to_dict(),
        "consumed_samples": state.consumed_samples,
        "consumed_valid_samples": state.consumed_valid_samples,
        "converted_from": f"megatron {state.format}"}
    if state.scheduler is not None:
        metadata["opt_param_scheduler"] = dict(state.scheduler)
    return save_checkpoint(out, state.iteration, state.model, state.optimizer, metadata)


def convert_ours_to_megatron(input_dir: str | os.PathLike, output_dir: str | os.PathLike,
                             tp: int, pp: int, divisible_by: int,
                             iteration: int | None = None) -> Path:
    """A megatron_h2 checkpoint -> Megatron-LM torch_dist for a TP ``tp`` x PP ``pp`` run."""
    from megatron_h2.checkpointing.format import load_checkpoint
    from megatron_h2.checkpointing.hf import _check_output, _model_config_from_metadata

    for flag, value in (("--target-tensor-parallel-size", tp),
                        ("--target-pipeline-parallel-size", pp),
                        ("--make-vocab-size-divisible-by", divisible_by)):
        if value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value}")
    out = _check_output(output_dir, megatron=True)
    ckpt = load_checkpoint(input_dir, iteration)
    if ckpt is None:
        raise ConfigError(f"{input_dir} holds no megatron_h2 checkpoint")
    config = _model_config_from_metadata(ckpt.metadata, ckpt.path, ckpt.model)
    return write_torch_dist(out, ckpt.iteration, config, ckpt.model, ckpt.optimizer, tp, pp,
                            divisible_by, ckpt.metadata)
