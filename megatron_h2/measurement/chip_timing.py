"""Measure one chip for the planner, written as its profile table (format:
:mod:`megatron_h2.planner.profile`).

Per micro-batch size: forward and backward time of one transformer layer, the embedding and
the head (each timed on its own), and a layer's extra backward time under selective recompute;
once: the optimizer's once-per-step work per parameter (gradient norm, clipping, AdamW, zeroing
the gradients, as the training step does it). Times are medians over repetitions after warm-up,
at TP 1 and without recompute, on the device this process runs on; the cost model scales them
for TP, recompute and emulated slowdown. The parts run with the model's dropout probabilities
(``hidden_dropout``, ``attention_dropout``), which the table records: drawing the masks can take
as long as a small layer's matrix multiplies, so a profile is only valid for runs with the same.
With ``bf16`` the parts run as ``--bf16`` trains: bf16 weights and activations, no autocast.

A :class:`Pace` makes the measurement look like one chip of a CPU-emulated cluster: padded with
sleep like a chip with ``emulate_slowdown`` (the runtime pads the same way), started together
with the other processes that measure at the same time, and kept busy for a common window so
that they compete for the cores as the cluster's processes do in a run.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml

from megatron_h2.config import ModelConfig, OptimizerConfig
from megatron_h2.devices import Accelerator
from megatron_h2.models.gpt import GPTModel, cast_parameters, init_parameters
from megatron_h2.monitoring.stage_clock import emulation_pad_s
from megatron_h2.optimizer.distributed_optimizer import build_data_parallel_optimizer

PROFILE_MODEL_KEYS = ("hidden_size", "ffn_hidden_size", "num_attention_heads",
                      "num_query_groups", "seq_length", "vocab_size", "hidden_dropout",
                      "attention_dropout")

CPU = "_cpu_ms"
"""Suffix of a table key holding CPU milliseconds rather than wall milliseconds."""

Sample = Callable[[], float]
"""Runs once and returns the milliseconds it measured."""


@dataclass(frozen=True)
class Pace:
    """How one measuring process runs next to others (defaults: alone, not padded)."""

    slowdown: float = 1.0
    """Sleep after each measured interval like a CPU-emulated chip (``slowdown - 1`` times its
    CPU time: :func:`~megatron_h2.monitoring.stage_clock.emulation_pad_s`)."""
    window_s: float = 0.0
    """Keep repeating for at least this long, so that processes measuring at once overlap."""
    sync: Callable[[], None] | None = None
    """Called before each measurement (a barrier over the processes measuring at once)."""


def _timed_ms(acc: Accelerator, fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    acc.synchronize()
    return (time.perf_counter() - start) * 1e3


def repeat(pace: Pace, warmup: int, reps: int, *samples: Sample,
           cpu_ms: list[list[float]] | None = None) -> list[list[float]]:
    """Run ``samples`` in turn, round after round: ``warmup`` rounds, then rounds until there
    are ``reps`` and ``pace.window_s`` has passed; returns each sample's milliseconds per
    counted round. ``cpu_ms`` (one list per sample) receives this thread's CPU milliseconds of
    each counted one: what a pass computes, however much of a core other processes left it."""
    if pace.sync is not None:
        pace.sync()
    results: list[list[float]] = [[] for _ in samples]
    cpu_out = cpu_ms if cpu_ms is not None else [[] for _ in samples]

    def one_round(keep: bool) -> None:
        for sample, out, cpu_list in zip(samples, results, cpu_out):
            cpu = time.thread_time()
            ms = sample()
            cpu = time.thread_time() - cpu
            if pace.slowdown > 1.0:  # padded as the runtime pads a CPU-emulated chip
                time.sleep(emulation_pad_s(pace.slowdown, ms / 1e3, cpu))
            if keep:
                out.append(ms)
                cpu_list.append(cpu * 1e3)

    for _ in range(warmup):
        one_round(False)
    deadline = time.perf_counter() + pace.window_s
    while len(results[0]) < reps or time.perf_counter() < deadline:
        one_round(True)
    return results


@dataclass(frozen=True)
class PartTimes:
    forward_ms: float
    backward_ms: float
    forward_cpu_ms: float
    backward_cpu_ms: float


def _time_part(acc: Accelerator, model: GPTModel, make_input: Callable[[], dict],
               warmup: int, reps: int, pace: Pace = Pace()) -> PartTimes:
    """Forward (recording the graph, as in training) and backward, each timed on its own in
    every round; medians."""
    model.train()
    inputs = make_input()
    loss: list[torch.Tensor] = []

    def forward() -> None:
        loss.append(model(**inputs).float().sum())

    def backward() -> None:
        loss.pop().backward()

    def clear() -> None:
        model.zero_grad(set_to_none=True)
        for value in inputs.values():
            if isinstance(value, torch.Tensor) and value.grad is not None:
                value.grad = None

    def backward_ms() -> float:
        ms = _timed_ms(acc, backward)
        clear()
        return ms

    cpu: list[list[float]] = [[], []]
    fwd, bwd = repeat(pace, warmup, reps, lambda: _timed_ms(acc, forward), backward_ms,
                      cpu_ms=cpu)
    med = statistics.median
    return PartTimes(med(fwd), med(bwd), med(cpu[0]), med(cpu[1]))


def _selective_extra_ms(acc: Accelerator, layers: dict[str, GPTModel], hidden: torch.Tensor,
                        warmup: int, reps: int, pace: Pace) -> tuple[float, float]:
    """A layer's forward + backward with ``recompute: selective`` minus without (medians): wall
    and CPU milliseconds."""

    def step(layer: GPTModel) -> Sample:
        def run() -> None:
            layer(hidden_states=hidden).float().sum().backward()
            layer.zero_grad(set_to_none=True)
            hidden.grad = None
        return lambda: _timed_ms(acc, run)

    cpu: list[list[float]] = [[], []]
    plain, selective = repeat(pace, warmup, reps, step(layers["none"]), step(layers["selective"]),
                              cpu_ms=cpu)
    med = statistics.median
    return (max(med(selective) - med(plain), 0.0), max(med(cpu[1]) - med(cpu[0]), 0.0))


def _part_inputs(cfg: ModelConfig, mbs: int, dev: torch.device,
                 dtype: torch.dtype) -> dict[str, Callable[[], dict]]:
    """Input makers of the layer, the embedding and the head for one micro-batch size."""
    s, h, v = cfg.seq_length, cfg.hidden_size, cfg.vocab_size

    def hidden() -> dict:
        return {"hidden_states": torch.randn(mbs, s, h, device=dev, dtype=dtype,
                                             requires_grad=True)}

    def tokens() -> dict:
        return {"tokens": torch.randint(0, v, (mbs, s), device=dev)}

    def labelled() -> dict:
        return {**hidden(), "labels": torch.randint(0, v, (mbs, s), device=dev)}

    return {"layer": hidden, "embedding": tokens, "head": labelled}


def profile_model(config: ModelConfig, acc: Accelerator, micro_batch_sizes: list[int],
                  bf16: bool = False, warmup: int = 2, reps: int = 7,
                  log: Callable[[str], None] = print,
                  pace: Pace = Pace()) -> dict[int, dict[str, float]]:
    """``{micro_batch_size: {layer_forward_ms, layer_backward_ms, embedding_..., head_...,
    selective_recompute_ms}}``, each also as CPU milliseconds (the key with ``_cpu_ms``)."""
    cfg = replace(config, num_layers=1, recompute="none")
    dev = acc.device
    layer = GPTModel(cfg, acc.kernels, (0, 1), pre_process=False, post_process=False).to(dev)
    embed = GPTModel(cfg, acc.kernels, (0, 0), pre_process=True, post_process=False).to(dev)
    head = GPTModel(cfg, acc.kernels, (0, 0), pre_process=False, post_process=True).to(dev)
    selective = replace(cfg, recompute="selective")
    recomputing = GPTModel(selective, acc.kernels, (0, 1), False, False).to(dev)
    dtype = torch.bfloat16 if bf16 else torch.float32
    for part, part_cfg in ((layer, cfg), (embed, cfg), (head, cfg), (recomputing, selective)):
        init_parameters(part, part_cfg, seed=0)
        cast_parameters(part, dtype)
        part.train()
    table: dict[int, dict[str, float]] = {}
    for mbs in micro_batch_sizes:
        inputs = _part_inputs(cfg, mbs, dev, dtype)
        row = {}
        for name, model in (("layer", layer), ("embedding", embed), ("head", head)):
            t = _time_part(acc, model, inputs[name], warmup, reps, pace)
            row[f"{name}_forward_ms"] = round(t.forward_ms, 4)
            row[f"{name}_backward_ms"] = round(t.backward_ms, 4)
            row[f"{name}_forward{CPU}"] = round(t.forward_cpu_ms, 4)
            row[f"{name}_backward{CPU}"] = round(t.backward_cpu_ms, 4)
        extra, extra_cpu = _selective_extra_ms(acc, {"none": layer, "selective": recomputing},
                                               inputs["layer"]()["hidden_states"], warmup, reps,
                                               pace)
        row["selective_recompute_ms"] = round(extra, 4)
        row[f"selective_recompute{CPU}"] = round(extra_cpu, 4)
        log(f"micro-batch {mbs}: layer forward {row['layer_forward_ms']:.2f} ms, backward "
            f"{row['layer_backward_ms']:.2f} ms | embedding {row['embedding_forward_ms']:.2f}/"
            f"{row['embedding_backward_ms']:.2f} ms | head {row['head_forward_ms']:.2f}/"
            f"{row['head_backward_ms']:.2f} ms | selective recompute +{extra:.2f} ms")
        table[mbs] = row
    return table


def optimizer_ns_per_param(config: ModelConfig, acc: Accelerator, warmup: int = 2,
                           reps: int = 7, pace: Pace = Pace(),
                           cpu_ns: list[float] | None = None) -> float:
    """The work a training step does after the last backward with the replicated optimizer
    (gradient norm, clip, AdamW step) plus the next step's zero_grad, on the whole model, per
    parameter: memory-bound, so it scales with the parameters a chip holds."""
    model = GPTModel(config, acc.kernels, (0, config.num_layers), True, True).to(acc.device)
    init_parameters(model, config, seed=0)
    opt = build_data_parallel_optimizer(model, OptimizerConfig(lr_warmup_iters=1), None,
                                        kernels=acc.kernels)
    params = sum(p.numel() for p in model.parameters())

    def step() -> float:
        opt.zero_grad()
        for bucket in opt.grad_buckets.buckets:  # stands in for the backward's gradients
            bucket.buffer.normal_()
        opt.grad_buckets.start_sync()

        def update() -> None:
            opt.grad_buckets.finish_sync()
            norm = math.sqrt(sum(float(g.double().square().sum()) for _, g in opt.owned_grads()))
            opt.clip_(min(1.0, 1.0 / (norm + 1e-6)))
            opt.set_lr(1e-4)
            opt.step()
            opt.zero_grad()
        return _timed_ms(acc, update)

    cpu: list[list[float]] = [[]]
    (times,) = repeat(pace, warmup, reps, step, cpu_ms=cpu)
    if cpu_ns is not None:  # receives the CPU nanoseconds per parameter
        cpu_ns.append(statistics.median(cpu[0]) * 1e6 / params)
    return statistics.median(times) * 1e6 / params


def write_profile(path: str | Path, config: ModelConfig, chips: list[str],
                  table: dict[int, dict[str, float]], note: str,
                  optimizer_ns: float | None = None, optimizer_cpu_ns: float | None = None,
                  cpu: bool = True) -> None:
    """Write the profile table YAML (the same measurement under every name in ``chips``); the
    CPU times of ``table`` (keys with ``_cpu_ms``) go to ``cpu_micro_batch_sizes`` when ``cpu``
    (a single-threaded measurement on the CPU, whose thread's CPU time is the work)."""
    wall = {k: {key: x for key, x in v.items() if not key.endswith(CPU)} for k, v in table.items()}
    entry: dict = {"micro_batch_sizes": wall}
    if cpu:
        entry["cpu_micro_batch_sizes"] = {
            k: {key[: -len(CPU)] + "_ms": x for key, x in v.items() if key.endswith(CPU)}
            for k, v in table.items()}
    if optimizer_ns is not None:
        entry["optimizer_ns_per_param"] = round(optimizer_ns, 4)
    if cpu and optimizer_cpu_ns is not None:
        entry["optimizer_cpu_ns_per_param"] = round(optimizer_cpu_ns, 4)
    data = {"model": {k: getattr(config, k) for k in PROFILE_MODEL_KEYS},
            "chips": {name: copy.deepcopy(entry) for name in chips}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(f"# {line}\n" for line in note.splitlines())
                          + yaml.safe_dump(data, sort_keys=False))


def link_times(allreduce_bytes: int, p2p_bytes: int, reps: int = 15) -> dict[str, float]:
    """In a 2-rank gloo group (already initialised): the median time of an all-reduce of
    ``allreduce_bytes`` (fp32 gradients) and of one point-to-point transfer of ``p2p_bytes``
    (fp32 activations), as :class:`megatron_h2.planner.calibration.LinkTimes` fields."""
    import torch.distributed as dist

    rank = dist.get_rank()

    def timed(fn: Callable[[], None], count: int) -> float:
        times = []
        for _ in range(count + 2):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times[2:])

    grads, act = torch.ones(allreduce_bytes // 4), torch.ones(p2p_bytes // 4)

    def exchange() -> None:  # one send each way; half of it is one transfer
        if rank == 0:
            dist.send(act, 1)
            dist.recv(act, 1)
        else:
            dist.recv(act, 0)
            dist.send(act, 0)

    return {"allreduce_s": timed(lambda: dist.all_reduce(grads), reps),
            "allreduce_bytes": allreduce_bytes,
            "p2p_s": timed(exchange, 4 * reps) / 2, "p2p_bytes": p2p_bytes}
