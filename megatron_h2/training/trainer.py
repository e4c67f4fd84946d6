"""The training loop: gradient accumulation, clipping, schedule, evaluation, checkpoints."""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from types import FrameType

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from megatron_h2.config import RunConfig
from megatron_h2.devices import Accelerator
from megatron_h2.errors import TrainingError
from megatron_h2.models.gpt import flops_per_token
from megatron_h2.training.metrics import MetricsWriter, log
from megatron_h2.training.optimizer import LRSchedule
from megatron_h2.training.state import TrainProgress, save_training_state


def stack_samples(dataset: Dataset, start: int, count: int) -> torch.Tensor:
    """Samples ``start .. start+count-1`` as one int64 tensor [count, s + 1]."""
    return torch.from_numpy(np.stack([np.asarray(dataset[start + i], dtype=np.int64)
                                      for i in range(count)]))


class ExitSignal:
    """Turns SIGTERM / SIGINT into a request to save and stop after the current iteration."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # second signal: stop now
            raise KeyboardInterrupt
        self.received = signum
        log(f"received signal {signal.Signals(signum).name}: saving and stopping after this "
            "iteration (send again to stop at once)")

    def __enter__(self) -> ExitSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float


class Trainer:
    """Runs single-process training of ``model`` on ``train_ds``."""

    def __init__(self, config: RunConfig, accelerator: Accelerator, model: nn.Module,
                 optimizer: torch.optim.Optimizer, train_ds: Dataset, valid_ds: Dataset | None,
                 metrics: MetricsWriter, progress: TrainProgress) -> None:
        self.cfg = config
        self.acc = accelerator
        self.model = model
        self.optimizer = optimizer
        self.schedule = LRSchedule(config.optimizer, config.training.train_iters)
        self.train_ds, self.valid_ds = train_ds, valid_ds
        self.metrics = metrics
        self.progress = progress
        self.params = [p for p in model.parameters() if p.requires_grad]

    def _loss_sum(self, samples: torch.Tensor) -> torch.Tensor:
        """Forward (and backward when training) over micro-batches of ``samples`` [B, s + 1].

        Returns the loss summed over micro-batches, each already divided by the token count of
        the whole batch, so the result is the mean per-token loss of the batch.
        """
        t = self.cfg.training
        total_tokens = samples.shape[0] * (samples.shape[1] - 1)
        loss_sum = torch.zeros((), device=self.acc.device)
        for mb in samples.split(t.micro_batch_size):
            mb = mb.to(self.acc.device, non_blocking=True)
            tokens, labels = mb[:, :-1], mb[:, 1:]  # [b, s] each
            with self.acc.autocast(t.bf16):
                per_token = self.model(tokens=tokens, labels=labels)  # [b, s] fp32
            loss = per_token.sum() / total_tokens
            if self.model.training:
                loss.backward()
            loss_sum += loss.detach()
        return loss_sum

    def train_step(self, samples: torch.Tensor, iteration: int) -> StepResult:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._loss_sum(samples)
        grads = [p.grad for p in self.params if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads)
        if self.cfg.optimizer.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.cfg.optimizer.clip_grad,
                                                 grad_norm)
        loss_value, norm_value = loss.item(), grad_norm.item()
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
            raise TrainingError(f"loss {loss_value} / grad norm {norm_value} is not finite at "
                                f"iteration {iteration}; lower --lr or resume from the last "
                                "checkpoint")
        lr = self.schedule.apply(self.optimizer, iteration)
        self.optimizer.step()
        return StepResult(loss=loss_value, grad_norm=norm_value, lr=lr)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over the first ``eval_iters`` global batches of the validation split."""
        t = self.cfg.training
        if self.valid_ds is None or t.eval_iters == 0:
            return None
        self.model.eval()
        total = 0.0
        for i in range(t.eval_iters):
            loss = self._loss_sum(stack_samples(self.valid_ds, i * t.global_batch_size,
                                                   t.global_batch_size))
            total += loss.item()
        self.model.train()
        return total / t.eval_iters

    def save(self) -> None:
        save_dir = self.cfg.training.save
        if save_dir:
            start = time.perf_counter()
            path = save_training_state(save_dir, self.model, self.optimizer, self.progress,
                                       self.cfg, self.acc)
            log(f"saved checkpoint at iteration {self.progress.iteration} to {path} "
                f"({time.perf_counter() - start:.2f} s)")

    def run(self) -> TrainProgress:
        """Train until ``train_iters`` (or an exit signal / ``--exit-interval``)."""
        t = self.cfg.training
        tokens_per_iter = t.global_batch_size * self.cfg.model.seq_length
        flops_per_iter = flops_per_token(self.cfg.model) * tokens_per_iter
        last_saved = self.progress.iteration
        window: list[StepResult] = []
        window_start = time.perf_counter()
        with ExitSignal() as stop:
            while self.progress.iteration < t.train_iters:
                it = self.progress.iteration + 1
                samples = stack_samples(self.train_ds, self.progress.consumed_samples,
                                        t.global_batch_size)
                window.append(self.train_step(samples, it))
                self.progress.iteration = it
                self.progress.consumed_samples += t.global_batch_size
                val_loss = self.evaluate() if it % t.eval_interval == 0 else None
                if it % t.log_interval == 0 or val_loss is not None or it == t.train_iters:
                    self.acc.synchronize()
                    elapsed = time.perf_counter() - window_start
                    self._log(window, elapsed, tokens_per_iter, flops_per_iter, val_loss)
                    window, window_start = [], time.perf_counter()
                exiting = stop.received is not None or (
                    t.exit_interval is not None and it % t.exit_interval == 0)
                if (t.save_interval and it % t.save_interval == 0) or exiting:
                    self.save()
                    last_saved = it
                if exiting:
                    log(f"stopping at iteration {it} as requested")
                    break
        if self.progress.iteration != last_saved:
            self.save()
        return self.progress

    def _log(self, window: list[StepResult], elapsed: float, tokens_per_iter: int,
             flops_per_iter: float, val_loss: float | None) -> None:
        n = len(window)
        seconds = elapsed / n
        record = {"iteration": self.progress.iteration,
                  "consumed_samples": self.progress.consumed_samples,
                  "lr": window[-1].lr,
                  "lm_loss": sum(r.loss for r in window) / n,
                  "grad_norm": window[-1].grad_norm,
                  "iteration_ms": seconds * 1000.0,
                  "tokens_per_sec": tokens_per_iter / seconds,
                  "tflops": flops_per_iter / seconds / 1e12,
                  "global_batch_size": self.cfg.training.global_batch_size}
        if val_loss is not None:
            record["val_loss"] = val_loss
        self.metrics.train_step(record)
        if val_loss is not None:
            self.metrics.validation(self.progress.iteration, val_loss)
