"""Operator precision checks of the GPT model: one training step (tools/precision_check.py) and
the periodic in-training check of each pipeline stage (``--precision-check-interval``).

Both run the model under :class:`~megatron_h2.devices.op_replay.PrecisionCapture`, which
replays every operator on a reference device / dtype (default CPU fp64), and build the model
with :class:`~megatron_h2.devices.op_replay.KernelProbe` kernels so that the accelerator's
kernel table (vendor RMSNorm, SwiGLU) is compared with the native kernels too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megatron_h2.config import ModelConfig, OptimizerConfig
from megatron_h2.devices import Accelerator, Kernels, fork_rng
from megatron_h2.devices.op_replay import DTYPES, KernelProbe, ModuleStack, PrecisionCapture
from megatron_h2.devices.op_replay_report import PrecisionReport, describe
from megatron_h2.distributed.topology import Topology
from megatron_h2.models.gpt import GPTModel, init_parameters
from megatron_h2.optimizer.adamw import build_optimizer


@dataclass(frozen=True)
class StepInputs:
    """One micro-batch of a stage: ``tokens`` [b, s] (first stage) or ``hidden_states``
    [b, s, h] (later stages), and ``labels`` [b, s] on the last stage."""

    tokens: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    labels: torch.Tensor | None = None


def _run_stage(model: nn.Module, inputs: StepInputs, acc: Accelerator, bf16: bool,
               capture: PrecisionCapture, probe: KernelProbe | None,
               params: list[nn.Parameter], seed: int) -> list[torch.Tensor | None]:
    """Forward and backward of one micro-batch under ``capture``; returns the gradients of
    ``params`` (and of the stage input last, where it has one) without touching ``.grad``."""
    hidden = inputs.hidden_states
    if hidden is not None:
        hidden = hidden.detach().clone().requires_grad_()
    if probe is not None:
        probe.capture = capture
    try:
        with fork_rng(acc), capture.modules, capture:
            with acc.autocast(bf16):
                out = model(tokens=inputs.tokens, hidden_states=hidden, labels=inputs.labels)
            if inputs.labels is not None:  # per-token loss [b, s]
                loss = out.float().mean()
            else:  # an activation [b, s, h]: a fixed random projection gives O(1) gradients
                gen = torch.Generator().manual_seed(seed)
                weight = torch.randn(out.shape, generator=gen).to(out.device)
                loss = (out.float() * weight).sum()
            wanted = params + ([hidden] if hidden is not None else [])
            grads = torch.autograd.grad(loss, wanted, allow_unused=True)
    finally:
        if probe is not None:
            probe.capture = None
    return list(grads)


def check_training_step(model_cfg: ModelConfig, acc: Accelerator, *, dtype: str = "fp32",
                        reference: str = "cpu", reference_dtype: str = "fp64",
                        micro_batch_size: int = 2, seed: int = 1234,
                        optimizer_cfg: OptimizerConfig | None = None,
                        kernels: Kernels | None = None,
                        layer_range: tuple[int, int] | None = None) -> PrecisionReport:
    """One training step of ``model_cfg`` on ``acc`` (forward, backward, AdamW step), every
    operator replayed on ``reference`` in ``reference_dtype``.

    ``dtype`` is ``fp32`` or ``bf16`` (bf16 autocast with fp32 weights; ``--bf16`` training
    keeps bf16 weights instead, which :class:`PrecisionMonitor` checks); ``kernels`` replaces
    the accelerator's kernel table (to check a kernel against the native one); ``layer_range``
    checks one pipeline stage: its layers, the embedding only
    if it starts at layer 0, the head only if it ends at the last layer (random hidden states
    stand in for the previous stage's output). Tokens are random (seeded).
    """
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be fp32 or bf16, got {dtype!r}")
    start, end = layer_range or (0, model_cfg.num_layers)
    first, last = start == 0, end == model_cfg.num_layers
    probe = KernelProbe(kernels or acc.kernels)
    model = GPTModel(model_cfg, probe.kernels, (start, end), first, last)
    init_parameters(model, model_cfg, seed)
    model.to(acc.device).train()
    optimizer = build_optimizer(model, optimizer_cfg or OptimizerConfig(), probe.base)
    gen = torch.Generator().manual_seed(seed)
    b, s, h = micro_batch_size, model_cfg.seq_length, model_cfg.hidden_size
    tokens = torch.randint(0, model_cfg.vocab_size, (b, s + 1), generator=gen).to(acc.device)
    inputs = StepInputs(
        tokens=tokens[:, :-1] if first else None,
        hidden_states=None if first else torch.randn(b, s, h, generator=gen).to(acc.device),
        labels=tokens[:, 1:] if last else None)
    capture = PrecisionCapture(reference, DTYPES[reference_dtype], ModuleStack(model))
    params = [p for p in model.parameters() if p.requires_grad]
    grads = _run_stage(model, inputs, acc, dtype == "bf16", capture, probe, params, seed)
    for param, grad in zip(params, grads):
        param.grad = grad
    capture.phase = "optimizer"
    with capture:
        optimizer.step()
    meta = {"device": acc.registry_name(), "dtype": dtype, "reference": reference,
            "reference_dtype": reference_dtype, "kernels": dict(probe.base.names),
            "layers": f"{start}-{end - 1}", "micro_batch_size": b,
            "model": {k: v for k, v in vars(model_cfg).items()}}
    return PrecisionReport(capture.records, meta)


class PrecisionMonitor:
    """``--precision-check-interval``: re-runs the last micro-batch this rank's stage trained
    on (kept by a forward pre-hook: one micro-batch of inputs) under a capture against the CPU
    reference, and reports the worst operator of every stage.

    It computes gradients with ``torch.autograd.grad`` (nothing is accumulated into ``.grad``,
    no data-parallel hook fires) inside :func:`fork_rng`, so training continues exactly as
    without the check. Cost per check: one forward and backward of one micro-batch on the
    device plus the replay of each of its operators on the CPU in fp64, so an interval of N
    adds about a check's cost in iterations / N (bench/bench_precision_check.py measures it);
    on an accelerator the CPU fp64 replay of the micro-batch's FLOPs dominates.
    """

    def __init__(self, model: nn.Module, probe: KernelProbe | None, acc: Accelerator,
                 topo: Topology, bf16: bool, seed: int, reference: str = "cpu",
                 reference_dtype: str = "fp64") -> None:
        self.model, self.probe, self.acc, self.topo = model, probe, acc, topo
        self.bf16, self.seed = bf16, seed
        self.reference, self.reference_dtype = reference, reference_dtype
        self._inputs: StepInputs | None = None
        self._hook = model.register_forward_pre_hook(self._keep, with_kwargs=True)

    def _keep(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not module.training or not torch.is_grad_enabled():
            return

        def keep(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().clone()

        self._inputs = StepInputs(keep(kwargs.get("tokens")), keep(kwargs.get("hidden_states")),
                                  keep(kwargs.get("labels")))

    def check(self) -> PrecisionReport:
        """This rank's check (collective over its TP group where the stage has TP > 1)."""
        if self._inputs is None:
            raise RuntimeError("no training micro-batch seen yet: run a train step first")
        capture = PrecisionCapture(self.reference, DTYPES[self.reference_dtype],
                                   ModuleStack(self.model))
        params = [p for p in self.model.parameters() if p.requires_grad]
        _run_stage(self.model, self._inputs, self.acc, self.bf16, capture, self.probe, params,
                   self.seed)
        return PrecisionReport(capture.records)

    def run(self, iteration: int) -> str:
        """Check every stage (collective over the job); the log line for rank 0."""
        start = time.perf_counter()
        report = self.check()
        seconds = time.perf_counter() - start
        worst, summary = report.worst, report.summary()
        mine = {"stage": self.topo.stage, "rank": self.topo.rank,
                "chip": self.topo.stage_spec.chip, "device": self.acc.registry_name(),
                "ratio": -1.0 if worst is None else worst.tol_ratio,
                "worst": "nothing compared" if worst is None else describe(worst),
                "compared": summary["compared"], "failed": summary["failed"],
                "seconds": seconds}
        rows = [mine]
        if self.topo.distributed:
            rows = [None] * self.topo.world_size
            dist.all_gather_object(rows, mine, group=self.topo.cpu_group)
        lines = [f"precision check at iteration {iteration} (one micro-batch per stage, every "
                 f"operator replayed on {self.reference} {self.reference_dtype}; took "
                 f"{max(r['seconds'] for r in rows):.2f} s):"]
        for stage in sorted({r["stage"] for r in rows}):
            ranks = [r for r in rows if r["stage"] == stage]
            top = max(ranks, key=lambda r: r["ratio"])
            lines.append(f"  stage {stage} (chip {top['chip']}, {top['device']}): "
                         f"{sum(r['failed'] for r in ranks)} of "
                         f"{sum(r['compared'] for r in ranks)} operator calls beyond tolerance;"
                         f" worst (rank {top['rank']}): {top['worst']}")
        return "\n".join(lines)

    def close(self) -> None:
        self._hook.remove()
