"""Megatron-Core's distributed-optimizer state as flat buffers of Adam's moments and the fp32
main weights, in two files:

- ``torch_dist`` saved ``dp_reshardable`` (Megatron-LM's default sharding): one buffer per
  gradient bucket, under ``optimizer.distributed.dp_group_idx_G.gbuf_idx_B.dtype_(...)
  .bucket_idx_K.{param,exp_avg,exp_avg_sq}``, with the bucket sizes
  (``per_bucket_numel[_unpadded]/shard_R_N``) and the parameter groups with Adam's step
  (``optimizer/shard_R_N``) as pickled objects beside them;
- the legacy format's ``distrib_optim.pt`` beside ``model_optim_rng.pt`` (whose optimizer
  entry holds the parameter groups with the step): the buckets coalesced per buffer.

The layout inside a bucket is Megatron-Core's (megatron/core/distributed/
param_and_grad_buffer.py, megatron/core/optimizer/param_layout.py): the parameters in reverse
``named_parameters()`` order, each starting at a multiple of 64 elements. It is computed from
the model the checkpoint's args describe and must reproduce the saved unpadded bucket size
exactly, else one line. Read at TP 1, PP 1 and one data-parallel rank, ``dp_reshardable`` with
any number of buckets, ``distrib_optim.pt`` with one (the layouts checked against checkpoints
Megatron-Core wrote); others are refused in one line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from megatron_h2.checkpointing.megatron_dist import read_dist_objects
from megatron_h2.checkpointing.megatron_names import safe_torch_load
from megatron_h2.errors import ConfigError

PREFIX = "optimizer.distributed."
PARAM_ALIGN = 64  # Megatron-Core's pad_param_start
KINDS = ("param", "exp_avg", "exp_avg_sq")
_BUFFER = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\."
                     r"dtype_(\(.*\))\.bucket_idx_(\d+)\.(\w+)$")
_OBJECT = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.(\w+)/shard_(\d+)_(\d+)$")

# Megatron-Core's module order: the embedding, each layer's modules, the final norm, the head.
_TOP_ORDER = ("embedding.word_embeddings.", "embedding.position_embeddings.", "decoder.layers.",
              "decoder.final_layernorm.", "output_layer.")
_LAYER_ORDER = ("input_layernorm.", "self_attention.linear_proj.", "self_attention.linear_qkv.",
                "self_attention.q_layernorm.", "self_attention.k_layernorm.",
                "pre_mlp_layernorm.", "mlp.linear_fc1.", "mlp.linear_fc2.")
_LEAF_ORDER = ("weight", "bias")


def _position(name: str, where: Path) -> tuple[int, ...]:
    """Where ``name`` comes in Megatron-Core's ``named_parameters()``."""
    top = next((i for i, p in enumerate(_TOP_ORDER) if name.startswith(p)), None)
    rest = name[len(_TOP_ORDER[top]):] if top is not None else ""
    layer, sub = 0, rest
    if top == 2:
        index, _, sub = rest.partition(".")
        layer = int(index) if index.isdigit() else -1
    module = 0 if top != 2 else next((i for i, p in enumerate(_LAYER_ORDER)
                                      if sub.startswith(p)), None)
    leaf = sub.rsplit(".", 1)[-1]
    if top is None or module is None or layer < 0 or leaf not in _LEAF_ORDER:
        raise ConfigError(f"checkpoint {where}: the place of parameter {name} in the "
                          "distributed optimizer's buffer is not known to this build; load "
                          "with --no-load-optim")
    return top, layer, module, _LEAF_ORDER.index(leaf)


def buffer_layout(shapes: dict[str, tuple[int, ...]], where: Path,
                  bucket_ends: list[int] | None = None
                  ) -> list[tuple[dict[str, tuple[int, int]], int]]:
    """Per bucket: name -> (start, end) from the bucket's start, and the bucket's unpadded
    size. The parameters in reverse module order, each start padded to a multiple of 64; a
    bucket closes where a parameter ends at the saved unpadded size ``bucket_ends[i]`` (one
    bucket when None), the next starting at 0."""
    order = sorted(shapes, key=lambda n: _position(n, where), reverse=True)
    buckets: list[tuple[dict[str, tuple[int, int]], int]] = []
    layout: dict[str, tuple[int, int]] = {}
    start = 0
    for name in order:
        start = -(-start // PARAM_ALIGN) * PARAM_ALIGN
        start, end = start, start + int(torch.Size(shapes[name]).numel())
        layout[name] = (start, end)
        start = end
        if bucket_ends is not None and len(buckets) < len(bucket_ends) - 1 \
                and end == bucket_ends[len(buckets)]:
            buckets.append((layout, end))
            layout, start = {}, 0
    if layout:
        buckets.append((layout, start))
    return buckets


def _one_line(where: Path, what: str) -> ConfigError:
    return ConfigError(f"checkpoint {where}: the distributed optimizer's state {what}; load "
                       "with --no-load-optim")


def _buffers(ckpt_dir: Path, tensors: dict[str, torch.Tensor]
             ) -> list[dict[str, torch.Tensor]]:
    """The flat buffers of each bucket by kind, after checking that there is one group and one
    buffer, and that the buckets are numbered from 0 without a gap."""
    found: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _BUFFER.match(key)
        if match is None:
            raise _one_line(ckpt_dir, f"holds tensor {key}, which this build does not read")
        group, gbuf, _, bucket, kind = match.groups()
        if (group, gbuf) != ("0", "0"):
            raise _one_line(ckpt_dir, f"has several groups or buffers ({key}); this build "
                            "reads one")
        if kind not in KINDS or tensor.dim() != 1:
            raise _one_line(ckpt_dir, f"holds {key} of shape {tuple(tensor.shape)}, not a "
                            f"flat {'/'.join(KINDS)} buffer")
        found.setdefault(int(bucket), {})[kind] = tensor
    if sorted(found) != list(range(len(found))) or not found:
        raise _one_line(ckpt_dir, f"has buckets {sorted(found)}; a file is incomplete")
    for index, bucket in sorted(found.items()):
        missing = [k for k in KINDS if k not in bucket]
        if missing:
            raise _one_line(ckpt_dir, f"has no {missing[0]} buffer of bucket {index}; a file "
                            "is incomplete")
        if len({t.numel() for t in bucket.values()}) != 1:
            raise _one_line(ckpt_dir, f"has buffers of different sizes in bucket {index}; a "
                            "file is corrupt")
    return [found[i] for i in range(len(found))]


def _objects(ckpt_dir: Path, objects: list[str]) -> dict[str, Any]:
    """The pickled bucket sizes and parameter groups, keyed by their name (one DP rank)."""
    keys: dict[str, str] = {}
    for key in objects:
        match = _OBJECT.match(key)
        if match is None:
            continue
        group, name, rank, ranks = match.groups()
        if (group, rank, ranks) != ("0", "0", "1"):
            raise _one_line(ckpt_dir, f"was saved by {ranks} data-parallel ranks or several "
                            f"groups ({key}); this build reads one rank's")
        keys[name] = key
    want = ("per_bucket_numel", "per_bucket_numel_unpadded", "optimizer")
    lacking = [n for n in want if n not in keys]
    if lacking:
        raise _one_line(ckpt_dir, f"has no object {lacking[0]}; a file is incomplete")
    read = read_dist_objects(ckpt_dir, [keys[n] for n in want])
    return {n: read[keys[n]] for n in want}


def _bucket_numels(value: Any, name: str, ckpt_dir: Path) -> list[int]:
    """The bucket sizes in ``[[{dtypes: [numel, ...]}]]`` (per model chunk, per buffer)."""
    try:
        (chunk,) = value
        (gbuf,) = chunk
        (numels,) = gbuf.values()
        return [int(n) for n in numels]
    except (TypeError, ValueError, AttributeError):
        raise _one_line(ckpt_dir, f"has {name} {str(value)[:60]}, not the buckets of one "
                        "buffer") from None


def _step(value: Any, ckpt_dir: Path) -> float:
    try:
        steps = {group["step"] for entry in value for group in entry["param_groups"]}
    except (TypeError, KeyError, AttributeError):
        raise _one_line(ckpt_dir, "has parameter groups without Adam's step") from None
    if len(steps) != 1 or not isinstance(next(iter(steps)), int | float):
        raise _one_line(ckpt_dir, f"has parameter groups with steps {sorted(map(str, steps))}"
                        "; expected one number")
    return float(steps.pop())


def _unflatten(where: Path, buckets: list[dict[str, torch.Tensor]], unpadded: list[int],
               shapes: dict[str, tuple[int, ...]], step: float
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The fp32 main weights by name and Adam's state keyed ``<name>.exp_avg|exp_avg_sq|step``
    from each bucket's flat buffers, after checking the computed layout against the saved
    unpadded bucket sizes (each buffer holds at least that many elements)."""
    layouts = buffer_layout(shapes, where, unpadded)
    ends = [end for _, end in layouts]
    held = [b["param"].numel() for b in buckets]
    if ends != unpadded or len(held) != len(ends) or any(h < e for h, e in zip(held, ends)):
        raise _one_line(where, f"has buckets of {unpadded} elements (buffers of {held}); the "
                        f"model its args describe lays out {ends}")
    mains: dict[str, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for (layout, _), buffers in zip(layouts, buckets):
        for name, (start, stop) in layout.items():
            piece = {k: b[start:stop].view(shapes[name]).clone() for k, b in buffers.items()}
            mains[name] = piece["param"]
            state[f"{name}.exp_avg"] = piece["exp_avg"]
            state[f"{name}.exp_avg_sq"] = piece["exp_avg_sq"]
            state[f"{name}.step"] = torch.tensor(step, dtype=torch.float32)
    return mains, state


def _check_sizes(where: Path, args: dict[str, Any]) -> None:
    sizes = {k: args.get(k) for k in ("tensor_model_parallel_size",
                                      "pipeline_model_parallel_size")}
    if any(v not in (None, 1) for v in sizes.values()):
        raise _one_line(where, f"is not read at {sizes}; this build reads TP 1 / PP 1")


def read_dp_reshardable(ckpt_dir: Path, tensors: dict[str, torch.Tensor], objects: list[str],
                        shapes: dict[str, tuple[int, ...]], args: dict[str, Any]
                        ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """From the optimizer's ``tensors`` and ``objects`` of a torch_dist checkpoint: the fp32
    main weights by name, and Adam's state keyed ``<name>.exp_avg|exp_avg_sq|step``."""
    _check_sizes(ckpt_dir, args)
    buckets = _buffers(ckpt_dir, tensors)
    found = _objects(ckpt_dir, objects)
    unpadded = _bucket_numels(found["per_bucket_numel_unpadded"], "per_bucket_numel_unpadded",
                              ckpt_dir)
    padded = _bucket_numels(found["per_bucket_numel"], "per_bucket_numel", ckpt_dir)
    if len(padded) != len(unpadded) or any(p < u for p, u in zip(padded, unpadded)):
        raise _one_line(ckpt_dir, f"has buckets of {padded} elements, unpadded {unpadded}; "
                        "a file is corrupt")
    return _unflatten(ckpt_dir, buckets, unpadded, shapes, _step(found["optimizer"], ckpt_dir))


def read_distrib_optim(path: Path, optim: Any, shapes: dict[str, tuple[int, ...]],
                       args: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The legacy format's ``distrib_optim.pt`` (``{"buckets_coalesced": True, 0: {dtypes:
    {param, exp_avg, exp_avg_sq, numel_unpadded}}}``) beside ``model_optim_rng.pt``, whose
    ``optim`` holds the parameter groups with Adam's step: keyed ``<name>.main|exp_avg|
    exp_avg_sq|step`` (one data-parallel rank's save, one bucket)."""
    _check_sizes(path, args)
    dp = args.get("data_parallel_size")
    if dp not in (None, 1):
        raise _one_line(path, f"was saved by {dp} data-parallel ranks; this build reads one's")
    # Megatron-Core makes one bucket unless --overlap-grad-reduce; then --ddp-bucket-size,
    # by default 40M elements at DP 1
    bucket_size = ((args.get("ddp_bucket_size") or 40_000_000)
                   if args.get("overlap_grad_reduce") else float("inf"))
    saved = safe_torch_load(path)
    try:
        coalesced = saved.get("buckets_coalesced")
        (gbuf,) = [v for k, v in saved.items() if k != "buckets_coalesced"]
        (entry,) = gbuf.values()
        buffers = {k: entry[k] for k in KINDS}
        unpadded = int(entry["numel_unpadded"])
    except (AttributeError, ValueError, KeyError, TypeError):
        raise _one_line(path, "is not one buffer of param / exp_avg / exp_avg_sq / "
                        "numel_unpadded") from None
    if coalesced is not True or not all(isinstance(b, torch.Tensor) and b.dim() == 1
                                        for b in buffers.values()):
        raise _one_line(path, "is not saved as flat coalesced buffers")
    if len({b.numel() for b in buffers.values()}) != 1:
        raise _one_line(path, "has buffers of different sizes; the file is corrupt")
    if unpadded >= bucket_size:
        raise _one_line(path, f"spans {unpadded} elements, several gradient buckets of "
                        f"{bucket_size}; this build reads one bucket")
    groups = optim.get("optimizer") if isinstance(optim, dict) else None
    mains, state = _unflatten(path, [buffers], [unpadded], shapes, _step([groups], path))
    return {**state, **{f"{name}.main": main for name, main in mains.items()}}
