"""Megatron-Core's distributed-optimizer state as flat buffers of Adam's moments and the fp32
main weights, in two files:

- ``torch_dist`` saved ``dp_reshardable`` (Megatron-LM's default sharding): one buffer per
  gradient bucket of each model-parallel rank G (``G = stage x TP + tp_rank``), under
  ``optimizer.distributed.dp_group_idx_G.gbuf_idx_0.dtype_(...).bucket_idx_K.{param,exp_avg,
  exp_avg_sq}``, each at its unpadded size with the data-parallel ranks' slices already put
  together by torch.distributed.checkpoint; the bucket sizes (``per_bucket_numel[_unpadded]``)
  and the parameter groups with Adam's step (``optimizer``) as pickled objects beside them;
- the legacy format's ``distrib_optim.pt`` beside each ``mp_rank_TT[_PPP]/model_optim_rng.pt``
  (whose optimizer entry holds the parameter groups with the step): that rank's buckets
  gathered over the data-parallel ranks, unpadded and coalesced.

The layout of a rank's buffer is Megatron-Core's (megatron/core/distributed/
param_and_grad_buffer.py): its stage's parameters at their TP shapes, in reverse
``named_parameters()`` order, each starting at a multiple of 64 elements; a bucket closes once
it holds ``--ddp-bucket-size`` elements (with ``--overlap-grad-reduce``, on the first stage), and
at a pipeline split of a tied model the embedding and its last-stage copy each have a bucket of
their own; each bucket is padded to a multiple of lcm(DP, 128) (x 2^16 under
``--ddp-pad-buckets-for-high-nccl-busbw``). It is computed from the model the checkpoint's args
describe and must reproduce the saved bucket sizes exactly, else one line. The ranks' pieces
are merged into whole tensors by :func:`~.megatron_names.merge_tp`, the stages' layers renumbered.
Read at any DP, TP and PP with any number of buckets (checked against checkpoints
Megatron-Core wrote at DP 2, TP 2, PP 2 and TP 2 x PP 2 x DP 2); virtual or uneven pipeline
stages, context or expert parallelism, several buffers (parameters of several dtypes) and the
legacy file of a ``--ddp-num-buckets`` run are refused in one line.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from megatron_h2.checkpointing.megatron_dist import read_dist_objects
from megatron_h2.checkpointing.megatron_names import (
    LAYER_PREFIX,
    merge_tp,
    safe_torch_load,
    split_layer_name,
    tp_rule,
)
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
                  bucket_ends: list[int] | None = None, shared: tuple[str, ...] = (),
                  bucket_size: int | None = None
                  ) -> list[tuple[dict[str, tuple[int, int]], int]]:
    """Per bucket: name -> (start, end) from the bucket's start, and the bucket's unpadded
    size, as Megatron-Core lays out one rank's buffer: the parameters in reverse module order,
    each start padded to a multiple of 64; a bucket closes once it holds ``bucket_size``
    elements, where a parameter ends at the saved unpadded size ``bucket_ends[i]``, and around
    each ``shared`` parameter (a tied embedding split over stages); the next starts at 0."""
    order = sorted(shapes, key=lambda n: _position(n, where), reverse=True)
    buckets: list[tuple[dict[str, tuple[int, int]], int]] = []
    layout: dict[str, tuple[int, int]] = {}
    start = 0
    for name in order:
        start = -(-start // PARAM_ALIGN) * PARAM_ALIGN
        if name in shared and layout:  # the bucket before closes at the padded start
            buckets.append((layout, start))
            layout, start = {}, 0
        end = start + int(torch.Size(shapes[name]).numel())
        layout[name] = (start, end)
        start = end
        at_saved_end = (bucket_ends is not None and len(buckets) < len(bucket_ends) - 1
                        and end == bucket_ends[len(buckets)])
        if name in shared or at_saved_end or (bucket_size is not None and end >= bucket_size):
            buckets.append((layout, end))
            layout, start = {}, 0
    if layout:
        buckets.append((layout, start))
    return buckets


def _one_line(where: Path, what: str) -> ConfigError:
    return ConfigError(f"checkpoint {where}: the distributed optimizer's state {what}; load "
                       "with --no-load-optim")


def parallel_sizes(where: Path, args: dict[str, Any]) -> tuple[int, int, int]:
    """TP, PP and DP of the saving run, after refusing the layouts this build does not read
    (those no checkpoint of Megatron-Core's has verified)."""
    sizes = [args.get(k) or 1 for k in ("tensor_model_parallel_size",
                                        "pipeline_model_parallel_size", "data_parallel_size")]
    unread = {k: args[k] for k in ("virtual_pipeline_model_parallel_size",
                                   "num_layers_per_virtual_pipeline_stage",
                                   "decoder_first_pipeline_num_layers",
                                   "decoder_last_pipeline_num_layers",
                                   "pipeline_model_parallel_layout")
              if args.get(k) is not None}
    unread.update({k: args[k] for k in ("context_parallel_size", "expert_model_parallel_size")
                   if (args.get(k) or 1) != 1})
    if unread:
        key, value = next(iter(unread.items()))
        raise _one_line(where, f"is not read with {key}={str(value)[:20]}; this build reads "
                        "even pipeline stages without context or expert parallelism")
    if args.get("num_layers") and args["num_layers"] % sizes[1]:
        raise _one_line(where, f"is of {args['num_layers']} layers over {sizes[1]} stages; this "
                        "build reads even stages")
    return sizes[0], sizes[1], sizes[2]


def rank_parameters(shapes: dict[str, tuple[int, ...]], args: dict[str, Any], tp_rank: int,
                    stage: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The parameters of one model-parallel rank: its local name (the stage's layers numbered
    from 0) -> (our name, its TP shard's shape). A tied model split over stages keeps a copy of
    the embedding as the last stage's ``output_layer.weight`` (our name too, folded later)."""
    tp = args.get("tensor_model_parallel_size") or 1
    pp = args.get("pipeline_model_parallel_size") or 1
    per_stage = (args.get("num_layers") or 0) // pp
    swiglu = bool(args.get("swiglu"))
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    wanted = dict(shapes)
    head = "output_layer.weight"
    if pp > 1 and head not in wanted:
        wanted[head] = wanted["embedding.word_embeddings.weight"]
    for name, shape in wanted.items():
        layer = split_layer_name(name)
        if pp == 1:
            local = name
        elif layer is not None:
            if layer[0] // per_stage != stage:
                continue
            local = f"{LAYER_PREFIX}{layer[0] - stage * per_stage}.{layer[1]}"
        elif name.startswith("embedding.") and stage != 0 \
                or not name.startswith("embedding.") and stage != pp - 1:
            continue
        else:
            local = name
        spec = tp_rule(name, swiglu)
        if spec is not None:
            dim = spec.resolve_dim(len(shape))
            shape = (*shape[:dim], shape[dim] // tp, *shape[dim + 1:])
        out[local] = (name, tuple(shape))
    return out


def shared_embedding(args: dict[str, Any], stage: int) -> tuple[str, ...]:
    """The parameters Megatron-Core gives a bucket of their own on ``stage``: the tied
    embedding and its copy when the model is split over stages."""
    pp = args.get("pipeline_model_parallel_size") or 1
    if pp == 1 or args.get("untie_embeddings_and_output_weights"):
        return ()
    return (*(("embedding.word_embeddings.weight",) if stage == 0 else ()),
            *(("output_layer.weight",) if stage == pp - 1 else ()))


def _buffers(ckpt_dir: Path, tensors: dict[str, torch.Tensor]
             ) -> dict[int, list[dict[str, torch.Tensor]]]:
    """Per model-parallel rank, the flat buffers of each bucket by kind, after checking that
    each rank has one buffer and buckets numbered from 0 without a gap."""
    found: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        match = _BUFFER.match(key)
        if match is None:
            raise _one_line(ckpt_dir, f"holds tensor {key}, which this build does not read")
        group, gbuf, _, bucket, kind = match.groups()
        if gbuf != "0":
            raise _one_line(ckpt_dir, f"has several buffers ({key}); this build reads one")
        if kind not in KINDS or tensor.dim() != 1:
            raise _one_line(ckpt_dir, f"holds {key} of shape {tuple(tensor.shape)}, not a "
                            f"flat {'/'.join(KINDS)} buffer")
        found.setdefault(int(group), {}).setdefault(int(bucket), {})[kind] = tensor
    out: dict[int, list[dict[str, torch.Tensor]]] = {}
    for group, buckets in sorted(found.items()):
        if sorted(buckets) != list(range(len(buckets))):
            raise _one_line(ckpt_dir, f"has buckets {sorted(buckets)} of rank {group}; a file "
                            "is incomplete")
        for index, bucket in sorted(buckets.items()):
            missing = [k for k in KINDS if k not in bucket]
            if missing:
                raise _one_line(ckpt_dir, f"has no {missing[0]} buffer of bucket {index}; a "
                                "file is incomplete")
            if len({t.numel() for t in bucket.values()}) != 1:
                raise _one_line(ckpt_dir, f"has buffers of different sizes in bucket {index}; "
                                "a file is corrupt")
        out[group] = [buckets[i] for i in range(len(buckets))]
    return out


def _objects(ckpt_dir: Path, objects: list[str], groups: int) -> dict[int, dict[str, Any]]:
    """Per model-parallel rank, the pickled bucket sizes and parameter groups."""
    keys: dict[tuple[int, str], str] = {}
    for key in objects:
        match = _OBJECT.match(key)
        if match is None:
            continue
        group, name, rank, ranks = match.groups()
        if (rank, ranks) != ("0", "1"):
            raise _one_line(ckpt_dir, f"holds object {key}, one of {ranks} pieces; this build "
                            "reads whole objects")
        keys[(int(group), name)] = key
    want = ("per_bucket_numel", "per_bucket_numel_unpadded", "optimizer")
    lacking = [(g, n) for g in range(groups) for n in want if (g, n) not in keys]
    if lacking:
        raise _one_line(ckpt_dir, f"has no object {lacking[0][1]} of rank {lacking[0][0]}; a "
                        "file is incomplete")
    read = read_dist_objects(ckpt_dir, [keys[(g, n)] for g in range(groups) for n in want])
    return {g: {n: read[keys[(g, n)]] for n in want} for g in range(groups)}


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


def _check_padding(where: Path, padded: list[int], unpadded: list[int], dp: int,
                   args: dict[str, Any]) -> None:
    """Megatron-Core pads each bucket to a multiple of lcm(DP, 128) (x 2^16 for NCCL)."""
    divisor = math.lcm(dp, 128, *((2 ** 16,) if args.get("ddp_pad_buckets_for_high_nccl_busbw")
                                  else ()))
    want = [-(-u // divisor) * divisor for u in unpadded]
    if padded != want:
        raise _one_line(where, f"has padded buckets of {padded} elements; Megatron-Core at DP "
                        f"{dp} pads {unpadded} to {want}; a file is corrupt")


def _unflatten(where: Path, buckets: list[dict[str, torch.Tensor]], unpadded: list[int],
               shapes: dict[str, tuple[int, ...]], step: float, shared: tuple[str, ...] = (),
               bucket_size: int | None = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One rank's fp32 main weights by name and Adam's state keyed ``<name>.exp_avg|
    exp_avg_sq|step`` from each bucket's flat buffers, after checking the computed layout
    against the saved unpadded bucket sizes (each buffer holds at least that many elements)."""
    layouts = buffer_layout(shapes, where, unpadded, shared, bucket_size)
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


def _fold_copy(where: Path, whole: dict[str, torch.Tensor]) -> None:
    """The last stage's copy of a tied embedding: its state must be the embedding's; dropped."""
    copy, embedding = "output_layer.weight", "embedding.word_embeddings.weight"
    for kind in ("main", "exp_avg", "exp_avg_sq", "step"):
        if f"{copy}.{kind}" in whole:
            if not torch.equal(whole.pop(f"{copy}.{kind}"), whole[f"{embedding}.{kind}"]):
                raise _one_line(where, f"of the last stage's copy of the tied embedding "
                                f"({kind}) differs from the first stage's; it is inconsistent")


def read_dp_reshardable(ckpt_dir: Path, tensors: dict[str, torch.Tensor], objects: list[str],
                        shapes: dict[str, tuple[int, ...]], args: dict[str, Any]
                        ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """From the optimizer's ``tensors`` and ``objects`` of a torch_dist checkpoint of the
    model of ``shapes``: the fp32 main weights by name, and Adam's state keyed
    ``<name>.exp_avg|exp_avg_sq|step``."""
    tp, pp, dp = parallel_sizes(ckpt_dir, args)
    buffers = _buffers(ckpt_dir, tensors)
    if sorted(buffers) != list(range(tp * pp)):
        raise _one_line(ckpt_dir, f"has buffers of model-parallel ranks {sorted(buffers)}, a "
                        f"TP {tp} x PP {pp} run has {tp * pp}; a file is incomplete")
    found = _objects(ckpt_dir, objects, tp * pp)
    pieces: dict[str, list[torch.Tensor]] = {}
    for group in range(tp * pp):
        stage, tp_rank = divmod(group, tp)
        params = rank_parameters(shapes, args, tp_rank, stage)
        objs = found[group]
        unpadded = _bucket_numels(objs["per_bucket_numel_unpadded"],
                                  "per_bucket_numel_unpadded", ckpt_dir)
        padded = _bucket_numels(objs["per_bucket_numel"], "per_bucket_numel", ckpt_dir)
        if len(padded) != len(unpadded):
            raise _one_line(ckpt_dir, f"has buckets of {padded} elements, unpadded {unpadded}; "
                            "a file is corrupt")
        mains, state = _unflatten(ckpt_dir, buffers[group], unpadded,
                                  {local: shape for local, (_, shape) in params.items()},
                                  _step(objs["optimizer"], ckpt_dir),
                                  shared_embedding(args, stage))
        _check_padding(ckpt_dir, padded, unpadded, dp, args)
        for key, tensor in [*((f"{n}.main", t) for n, t in mains.items()), *state.items()]:
            local, kind = key.rsplit(".", 1)
            pieces.setdefault(f"{params[local][0]}.{kind}", []).append(tensor)
    whole = {key: merge_tp(key, shards, bool(args.get("swiglu")), ckpt_dir)
             for key, shards in pieces.items()}
    if "output_layer.weight" not in shapes:
        _fold_copy(ckpt_dir, whole)
    mains = {key[: -len(".main")]: t for key, t in whole.items() if key.endswith(".main")}
    return mains, {key: t for key, t in whole.items() if not key.endswith(".main")}


def read_distrib_optim(path: Path, optim: Any, shapes: dict[str, tuple[int, ...]],
                       args: dict[str, Any], stage: int = 0) -> dict[str, torch.Tensor]:
    """The legacy format's ``distrib_optim.pt`` (``{"buckets_coalesced": True, 0: {dtypes:
    {param, exp_avg, exp_avg_sq, numel_unpadded}}}``) of one model-parallel rank, whose
    parameters ``shapes`` are (``stage``'s local names, TP shapes), beside the
    ``model_optim_rng.pt`` whose ``optim`` holds the parameter groups with Adam's step: keyed
    ``<name>.main|exp_avg|exp_avg_sq|step``."""
    _, _, dp = parallel_sizes(path, args)
    if args.get("overlap_grad_reduce") and args.get("ddp_num_buckets") is not None:
        raise _one_line(path, f"was saved with --ddp-num-buckets {args['ddp_num_buckets']}, "
                        "whose bucket size this build does not derive")
    # Megatron-Core makes one bucket unless --overlap-grad-reduce; then --ddp-bucket-size (by
    # default max(40M, 1M x DP) elements) on the first stage, one bucket on the others
    bucket_size = ((args.get("ddp_bucket_size") or max(40_000_000, 1_000_000 * dp))
                   if args.get("overlap_grad_reduce") and stage == 0 else None)
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
    shared = shared_embedding(args, stage)
    ends = [end for _, end in buffer_layout(shapes, path, None, shared, bucket_size)]
    if sum(ends) != unpadded or buffers["param"].numel() != unpadded:
        raise _one_line(path, f"has buckets of [{unpadded}] elements (buffers of "
                        f"[{buffers['param'].numel()}]); the model its args describe lays out "
                        f"{ends}")
    offsets = [sum(ends[:i]) for i in range(len(ends) + 1)]
    buckets = [{k: b[offsets[i]:offsets[i + 1]] for k, b in buffers.items()}
               for i in range(len(ends))]
    groups = optim.get("optimizer") if isinstance(optim, dict) else None
    mains, state = _unflatten(path, buckets, ends, shapes, _step([groups], path), shared,
                              bucket_size)
    return {**state, **{f"{name}.main": main for name, main in mains.items()}}
