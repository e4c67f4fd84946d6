"""Saving and restoring the whole training state: weights, optimizer, progress and RNG.

Every tensor is saved whole under its global name, so a checkpoint written under one layout
(TP, PP, DP, data-parallel pipelines) loads under any other. Each pipeline stage writes its own
part in parallel: its tensor-parallel shards are gathered inside the stage's TP group, one DP
replica writes (of a plan of several pipelines, pipeline 0's: they all hold the same state),
and no rank ever holds more than its stage. Loading reads only the tensors this rank owns.
"""

from __future__ import annotations

import base64
import copy
import random
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from megatron_h2.checkpointing import (
    CheckpointReader,
    begin_save,
    commit_save,
    corruption_message,
    incomplete_dir,
    write_part,
)
from megatron_h2.checkpointing.async_save import BackgroundWrite, host_copy
from megatron_h2.checkpointing.format import iteration_dir, load_checkpoint
from megatron_h2.checkpointing.housekeeping import SaveDirOwner, apply_retention
from megatron_h2.checkpointing.megatron_open import MegatronReader, open_any_checkpoint
from megatron_h2.checkpointing.megatron_write import write_torch_dist
from megatron_h2.config import ARCHITECTURE_FIELDS, ModelConfig, RunConfig, flag_name
from megatron_h2.devices import Accelerator
from megatron_h2.distributed.topology import Topology
from megatron_h2.errors import ConfigError, JobConfigError, TrainingError
from megatron_h2.optimizer.distributed_optimizer import DataParallelOptimizer
from megatron_h2.optimizer.expert_optimizer import is_expert_param
from megatron_h2.parallel import TPContext, gather_tp_tensor, get_tp_shard, shard_tensor
from megatron_h2.plan.schema import HeteroPlan

STAGING_DIR = ".megatron_h2_staging"  # under --save with --ckpt-format torch_dist

# Config fields that must match for a checkpoint's weights to mean the same model.
MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                *ARCHITECTURE_FIELDS)


@dataclass
class TrainProgress:
    iteration: int = 0
    consumed_samples: int = 0
    scheduler: dict[str, Any] | None = None  # optimizer-parameter schedule state, if resumed
    grad_scaler: dict[str, Any] | None = None  # fp16 loss-scaler state, if resumed
    health: dict[str, Any] | None = None  # the numerical health monitor's history, if resumed


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


def check_rng_state(state: Any, where: str) -> None:
    """Raise a one-line ConfigError unless ``state`` is a usable :func:`capture_rng` result
    (each stream is tried on a throwaway generator, so nothing global changes)."""
    try:
        if not isinstance(state, dict):
            raise TypeError(f"expected an object, found {type(state).__name__}")
        py_version, py_state, py_gauss = state["python"]
        random.Random().setstate((py_version, tuple(py_state), py_gauss))
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.RandomState().set_state((name, np.asarray(keys, dtype=np.uint32), pos,
                                           has_gauss, gauss))
        torch.Generator().set_state(_unb64(state["torch_cpu"]))
        if state.get("device") is not None:
            _unb64(state["device"])
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError, IndexError) as exc:
        raise ConfigError(f"{where} holds an invalid RNG state ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:80] if str(exc) else ''}); load with "
                          "--no-load-rng or an earlier iteration") from None


def check_rng_metadata(meta: dict[str, Any], source: Path | None) -> None:
    """Check every saved RNG state of a checkpoint's metadata (before anything is restored)."""
    per_rank = meta.get("rng_per_rank")
    if per_rank is None:
        return
    if not isinstance(per_rank, list) or not per_rank:
        raise ConfigError(f"checkpoint {source}: rng_per_rank must be a non-empty list; load with "
                          "--no-load-rng or an earlier iteration")
    layout = meta.get("layout")
    if isinstance(layout, dict) and _layout_world_size(layout) not in (None, len(per_rank)):
        raise ConfigError(f"checkpoint {source} has {len(per_rank)} RNG states but its layout "
                          f"needs {_layout_world_size(layout)}; load with --no-load-rng")
    for rank, state in enumerate(per_rank):
        check_rng_state(state, f"checkpoint {source} (rank {rank})")


def _layout_world_size(layout: dict[str, Any]) -> int | None:
    try:
        return HeteroPlan.from_dict(layout).world_size
    except (ConfigError, TypeError, ValueError):
        return None


def restore_rng(state: dict[str, Any], accelerator: Accelerator) -> None:
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    if state.get("device") is not None:
        accelerator.set_rng_state(_unb64(state["device"]))


def check_compatible(metadata: dict[str, Any], config: RunConfig, source: Path | None) -> None:
    """The checkpoint's model must equal the configured one (one line names the field)."""
    saved = metadata.get("config", {}).get("model", {})
    for name in MODEL_FIELDS:
        mine = getattr(config.model, name)
        was = saved.get(name, mine)
        if name == "bias_gelu_fusion" and not _fusion_matters(saved, config.model):
            continue  # no biased GeLU MLP: Megatron turns the fusion off, we leave it
        if was != mine:
            flag = flag_name(next(f for f in fields(ModelConfig) if f.name == name)) \
                if name != "vocab_size" else "--vocab-size (padded)"
            if name == "vocab_size" and "megatron" in metadata:
                flag += ("; Megatron-LM pads to a multiple of --make-vocab-size-divisible-by x "
                         "TP: pass that product as --make-vocab-size-divisible-by")
            raise ConfigError(f"checkpoint {source} was saved with {name}={was} but "
                              f"this run has {name}={mine} ({flag}); use matching model flags")


def _fusion_matters(saved: dict[str, Any], model: ModelConfig) -> bool:
    """Whether ``--no-bias-gelu-fusion`` changes the model: only a GeLU MLP with biases."""
    return all(not side.get("swiglu") and not side.get("squared_relu")
               and side.get("add_bias_linear", True)
               for side in (saved, {k: getattr(model, k) for k in
                                    ("swiglu", "squared_relu", "add_bias_linear")}))


def _param_of_state(key: str) -> str:
    """``decoder.layers.0.mlp.linear_fc1.weight.exp_avg`` -> the parameter name."""
    return key.rsplit(".", 1)[0]


EXPERT_PART_STRIDE = 1000
"""Part ``stage + 1000 x ep_rank`` holds the routed experts of EP rank ``ep_rank > 0`` of a
stage (part ``stage`` the rest of the stage); tensors are found by name, whatever the part."""


class CheckpointIO:
    """Saves and loads this rank's share of the training state (collective over the job).

    Tensors are stored under their checkpoint names (``model.checkpoint_names``): the last
    stage's copy of a tied embedding is the word embedding, which the first stage saves. The
    model's weights are stored in fp32: under ``--bf16`` / ``--fp16`` they are the optimizer's
    fp32 main weights, so a run resumes exactly and the checkpoint loads under any precision.
    """

    def __init__(self, cfg: RunConfig, acc: Accelerator, topo: Topology, tp: TPContext,
                 model: nn.Module, optimizer: DataParallelOptimizer) -> None:
        self.cfg, self.acc, self.topo, self.tp = cfg, acc, topo, tp
        self.model, self.optimizer = model, optimizer
        aliases: dict[str, str] = getattr(model, "checkpoint_names", {})
        self.names = {p: aliases.get(n, n) for n, p in model.named_parameters()}
        self.params = {aliases.get(n, n): p for n, p in model.named_parameters()}
        self.copies = set(aliases.values())  # names this rank holds a copy of, saved elsewhere
        saved = model.state_dict(keep_vars=True)
        self.buffers = {n: b for n, b in model.named_buffers() if n in saved}
        """Persistent buffers (a MoE router's expert bias): whole on every TP rank, saved with
        the weights; absent from older checkpoints, where they keep their initial value."""
        self.owner: SaveDirOwner | None = None  # rank 0's claim on --save (checked per save)
        self.removed: list[int] = []  # iterations the last save's retention policy deleted
        self.protect: int | None = None  # a checkpoint retention must keep (the last good one)
        self.pending: BackgroundWrite | None = None  # --async-save: the write in progress
        self.save_format: str | None = None  # "torch_dist": save in Megatron-LM's format

    def _layout(self) -> dict[str, Any]:
        """The job's plan as checkpoints record it (every pipeline of it)."""
        plan = self.topo.job_plan or self.topo.plan
        return plan.to_dict()

    def _barrier(self) -> None:
        if self.topo.distributed:
            dist.barrier(group=self.topo.cpu_group)

    def _gather_full(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole tensors from this rank's TP shards (collective over the TP group)."""
        out = {}
        for key, value in tensors.items():
            param = self.params[key if key in self.params else _param_of_state(key)]
            spec = get_tp_shard(param)
            if spec is not None and value.ndim > 0:
                out[key] = gather_tp_tensor(value.detach(), spec, self._tp_of(param))
            else:
                out[key] = value.detach()
        return out

    def _tp_of(self, param: nn.Parameter) -> TPContext:
        """The group ``param`` is sharded over: the experts' TP group for routed experts under
        ETP != TP, else the TP group."""
        etp: TPContext | None = getattr(self.model, "etp", None)
        return etp if etp is not None and is_expert_param(param) else self.tp

    def _gather(self, mine: Any) -> list[Any]:
        """Every rank's ``mine`` (picklable), in rank order."""
        if not self.topo.distributed:
            return [mine]
        out: list[Any] = [None] * self.topo.world_size
        dist.all_gather_object(out, mine, group=self.topo.cpu_group)
        return out

    def _agree(self, problems: list[str]) -> list[str]:
        """The union of every rank's ``problems``, the same on every rank."""
        return sorted(set().union(*self._gather(problems)))

    def _from_rank0(self, value: Any) -> Any:
        if not self.topo.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.topo.cpu_group)
        return box[0]

    def save(self, save_dir: str, progress: TrainProgress, background: bool = False
             ) -> Path | None:
        """Write a complete checkpoint for ``progress.iteration``; returns its directory.

        ``background`` (``--async-save``): gather the state, copy this rank's parts to host
        memory and write them on a thread; returns None, and :meth:`finish_background_save`
        commits the checkpoint once every rank's write is done. A save first finishes the
        previous background save. Collective over the job either way.
        """
        self.finish_background_save(blocking=True)
        topo, it = self.topo, progress.iteration
        target, save_dir = save_dir, self._write_dir(save_dir)
        self.optimizer.finish_param_sync()  # the parameters hold the last step's update
        if topo.rank == 0:
            if self.owner is not None:
                self.owner.check()  # another job may have taken the directory over
            begin_save(save_dir, it)
        self._barrier()
        optim = self.optimizer.named_state(self.names)  # collective over DP under ZeRO
        weights = self.optimizer.main_weights()  # fp32; collective under ZeRO with bf16 weights
        parts = self._parts_to_write(optim, weights) if topo.pipeline == 0 else []
        # what the commit writes, as of this iteration (a background commit comes later)
        context = {"save_dir": save_dir, "target": target, "iteration": it,
                   "rng": capture_rng(self.acc),
                   "consumed_samples": progress.consumed_samples,
                   "scheduler": copy.deepcopy(progress.scheduler),
                   "grad_scaler": copy.deepcopy(progress.grad_scaler),
                   "health": copy.deepcopy(progress.health)}
        tmp = incomplete_dir(save_dir, it)
        if background:
            self.pending = BackgroundWrite(tmp, [(kind, index, host_copy(tensors))
                                                 for kind, index, tensors in parts], context)
            return None
        entries = dict(write_part(tmp, kind, index, tensors) for kind, index, tensors in parts)
        return self._commit(context, entries)

    def _parts_to_write(self, optim: dict[str, torch.Tensor],
                        weights: dict[nn.Parameter, torch.Tensor]
                        ) -> list[tuple[str, int, dict[str, torch.Tensor]]]:
        """This rank's parts of the checkpoint (collective over its TP and expert-TP groups).

        The first DP replica saves the stage (TP rank 0 writes, the tensors gathered whole over
        the TP group); under expert parallelism the first expert-DP replica saves the routed
        experts, each gathered whole over its expert-TP group (the TP group where ETP = TP), and
        expert-TP rank 0 of each EP rank other than 0 writes them in a part of their own."""
        topo = self.topo
        etp_rank, ep_rank, edp_rank = topo.expert_ranks
        dense, experts = topo.dp_rank == 0, edp_rank == 0
        own = {n: p for n, p in self.params.items() if n not in self.copies
               and (experts if is_expert_param(p) else dense)}
        routed = {n for n, p in own.items() if is_expert_param(p)}
        # the dense tensors first, then the experts': the same collectives in the same order
        model = self._gather_full({n: weights[own[n]]
                                   for n in sorted(own, key=routed.__contains__)})
        states = self._gather_full({k: optim[k] for k in sorted(
            optim, key=lambda k: _param_of_state(k) in routed) if _param_of_state(k) in own})

        def part(index: int, names: set[str]) -> list[tuple[str, int, dict[str, torch.Tensor]]]:
            tensors = {n: model[n] for n in names}
            if index == topo.stage:
                tensors.update({n: b.detach().float() for n, b in self.buffers.items()})
            state = {k: v for k, v in states.items() if _param_of_state(k) in names}
            return [("model", index, tensors)] + ([("optim", index, state)] if state else [])

        parts = []
        if dense and topo.tp_rank == 0:  # the stage's first rank, with EP rank 0's experts
            parts += part(topo.stage, set(own))
        if experts and etp_rank == 0 and ep_rank > 0:
            parts += part(topo.stage + EXPERT_PART_STRIDE * ep_rank, routed)
        return parts

    def _commit(self, context: dict[str, Any], entries: dict[str, Any]) -> Path:
        """Collective: every rank's parts are on disk; rank 0 writes metadata and manifest and
        moves the directory into place."""
        save_dir, it = context["save_dir"], context["iteration"]
        gathered = self._gather((context["rng"], entries))
        path = iteration_dir(context.get("target", save_dir), it)
        if self.topo.rank == 0:
            rng = [state for state, _ in gathered]
            meta = {"iteration": it, "consumed_samples": context["consumed_samples"],
                    "config": self.cfg.to_dict(), "rng": rng[0], "rng_per_rank": rng,
                    "layout": self._layout()}
            if context["scheduler"] is not None:
                meta["opt_param_scheduler"] = context["scheduler"]
            if context["grad_scaler"] is not None:
                meta["grad_scaler"] = context["grad_scaler"]
            if context.get("health") is not None:
                meta["health"] = context["health"]
            written = {name: e for _, part in gathered for name, e in part.items()}
            path = commit_save(save_dir, incomplete_dir(save_dir, it), it, meta, written)
            if self.save_format == "torch_dist":
                path = self._to_megatron(path, context["target"])
            t = self.cfg.training
            self.removed = apply_retention(context["target"], t.save_retain_interval,
                                           t.most_recent_k, self.protect)
        self._barrier()
        return path

    def _write_dir(self, save_dir: str) -> str:
        """Where this rank's parts go: ``--save``, or under ``--ckpt-format torch_dist`` a
        staging directory inside it that :meth:`_to_megatron` converts from."""
        if self.save_format == "torch_dist":
            return str(Path(save_dir) / STAGING_DIR)
        return save_dir

    def _to_megatron(self, staged: Path, target: str) -> Path:
        """Rank 0: the committed megatron_h2 checkpoint ``staged`` rewritten as Megatron-LM
        torch_dist in ``target`` (the vocabulary as this run pads it, TP 1 / PP 1 in the args:
        convert_checkpoint pads for another layout); the staged copy is then removed."""
        ckpt = load_checkpoint(staged.parent, int(staged.name[len("iter_"):]))
        out = iteration_dir(target, ckpt.iteration)
        if out.exists():
            shutil.rmtree(out)
        path = write_torch_dist(target, ckpt.iteration, self.cfg.model, ckpt.model,
                                ckpt.optimizer, 1, 1, 1, ckpt.metadata)
        shutil.rmtree(staged.parent)
        return path

    def finish_background_save(self, blocking: bool) -> tuple[Path, int, float] | None:
        """Commit the background save once every rank's write is done: ``(directory,
        iteration, seconds the writes took)``, or None when there is none or (``blocking``
        False) some rank still writes. Collective: every rank calls it at the same points."""
        pending = self.pending
        if pending is None:
            return None
        if blocking:
            pending.wait()
        elif self.topo.distributed:
            busy = torch.tensor([0.0 if pending.done else 1.0], dtype=torch.float64)
            dist.all_reduce(busy, group=self.topo.cpu_group)
            if busy.item():
                return None
        elif not pending.done:
            return None
        self.pending = None
        failed = self._agree([f"rank {self.topo.rank}: {pending.error}"] if pending.error else [])
        if failed:
            raise TrainingError(f"background save of iteration {pending.context['iteration']}"
                                   f" failed ({failed[0]}); the checkpoint was not committed")
        seconds = pending.finished - pending.started
        return self._commit(pending.context, pending.entries), pending.context["iteration"], \
            seconds

    def _load_model(self, reader: CheckpointReader) -> None:
        """The weights, whole fp32 tensors sharded for this rank, into the model and (as they
        are) into the optimizer's main weights."""
        not_finite = []
        values: dict[nn.Parameter, torch.Tensor] = {}
        with torch.no_grad():
            for name, param in self.params.items():
                full = reader.get(name)
                if full.is_floating_point() and not bool(torch.isfinite(full).all()):
                    not_finite.append(name)
                spec = get_tp_shard(param)
                tp = self._tp_of(param)
                part = full if spec is None else shard_tensor(full, spec, tp.rank, tp.size)
                if part.shape != param.shape:
                    raise ConfigError(f"checkpoint tensor {name} has shape {tuple(full.shape)}, "
                                      "which does not fit this model; use matching model flags")
                values[param] = part.to(param.device, torch.float32)
            for name, buffer in self.buffers.items():
                if reader.has(name):
                    buffer.copy_(reader.get(name).to(buffer.device, buffer.dtype))
        self.optimizer.load_main_weights(values)
        bad = self._agree(not_finite)
        if bad and self.cfg.training.check_for_nan_in_loss_and_grad:
            raise JobConfigError(f"checkpoint {reader.path} holds NaN or Inf in {bad[0]}"
                                 f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}; "
                                 "load an earlier iteration")

    def _load_optimizer(self, reader: CheckpointReader) -> bool:
        if not any(reader.has(f"{n}.exp_avg", "optim") for n in self.params):
            return False
        tensors = {}
        for name, param in self.params.items():
            spec, tp = get_tp_shard(param), self._tp_of(param)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                full = reader.get(f"{name}.{key}", "optim")
                if spec is not None and full.ndim > 0:
                    full = shard_tensor(full, spec, tp.rank, tp.size)
                tensors[f"{name}.{key}"] = full
        self.optimizer.load_named_state(self.names, tensors)
        return True

    def _verify(self, reader: CheckpointReader, load_optim: bool) -> None:
        """Check the checksums of the parts this job reads, each part by one of the ranks that
        read it; every rank raises the same one-line error if any part is damaged."""
        names = list(self.params) + list(self.buffers)
        if load_optim:
            names += [f"{n}.{key}" for n in self.params for key in ("exp_avg", "exp_avg_sq",
                                                                   "step")]
        needs = self._gather(reader.parts_of(names))
        mine = []
        for index, part in enumerate(sorted(set().union(*needs))):
            readers = [rank for rank, parts in enumerate(needs) if part in parts]
            if readers[index % len(readers)] == self.topo.rank:
                mine.append(part)
        bad = self._agree(reader.verify(mine))
        if bad:
            message = corruption_message(reader.path, bad) if self.topo.rank == 0 else None
            raise JobConfigError(self._from_rank0(message))

    def load(self, load_dir: str, iteration: int | None, load_optim: bool,
             load_rng: bool, log, verify: bool = True, ckpt_format: str | None = None,
             auto_detect: bool = False) -> TrainProgress | None:
        """Restore a checkpoint into model and optimizer; None if ``load_dir`` holds none.
        ``verify`` checks the checksums of every part read (collective). A Megatron-LM
        checkpoint (``ckpt_format`` / ``auto_detect``: see :func:`open_any_checkpoint`) is read
        whole on every rank and restored like ours."""
        reader = open_any_checkpoint(load_dir, iteration, verify, ckpt_format, auto_detect,
                                     load_optim)
        if reader is None:
            return None
        meta = reader.metadata
        check_compatible(meta, self.cfg, reader.path)
        if isinstance(reader, MegatronReader):
            megatron = meta["megatron"]
            log(f"reading Megatron-LM {megatron['format']} checkpoint {reader.path} (saved at TP "
                f"{megatron['tensor_model_parallel_size']} PP "
                f"{megatron['pipeline_model_parallel_size']}); not carried over: "
                f"{len(megatron['not_read'])} extra-state / RNG entries")
        if verify:
            self._verify(reader, load_optim)
        else:
            log(f"loading {reader.path} without checking checksums (--no-verify-checkpoint)")
        self._load_model(reader)
        if load_optim and not self._load_optimizer(reader):
            log("checkpoint has no optimizer state: the optimizer starts fresh")
        if load_rng:
            self._restore_rng(meta, reader.path, log)
        return TrainProgress(iteration=reader.iteration,
                             consumed_samples=int(meta.get("consumed_samples", 0)),
                             scheduler=meta.get("opt_param_scheduler") if load_optim else None,
                             grad_scaler=meta.get("grad_scaler") if load_optim else None,
                             health=meta.get("health"))

    def _restore_rng(self, meta: dict[str, Any], source: Path, log) -> None:
        per_rank = meta.get("rng_per_rank")
        if not per_rank:  # e.g. converted from Hugging Face: nothing to restore
            return
        if meta.get("layout") == self._layout():
            check_rng_metadata(meta, source)
            restore_rng(per_rank[self.topo.rank], self.acc)
        else:
            log("checkpoint was saved under another parallel layout: RNG streams start from "
                "the seed (weights, optimizer and data position are restored exactly)")
