"""The training loop: schedule, evaluation, logging, checkpoints and clean stops."""

from __future__ import annotations

import os
import signal
import time
from types import FrameType

from megatron_h2.checkpointing.distributed import CheckpointIO, TrainProgress
from megatron_h2.config import RunConfig
from megatron_h2.models.gpt import flops_per_token
from megatron_h2.optimizer.lr_schedule import LRSchedule
from megatron_h2.training.metrics import MetricsWriter
from megatron_h2.training.precision import PrecisionMonitor
from megatron_h2.training.stage_clock import stage_report
from megatron_h2.training.step import StepResult, StepRunner, world_sum


class ExitSignal:
    """Turns SIGTERM / SIGINT into a request to save and stop after the current iteration."""

    def __init__(self, log) -> None:
        self.received: int | None = None
        self._log = log
        self._previous: dict[int, object] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # second signal: stop now
            raise KeyboardInterrupt
        self.received = signum
        self._log(f"received signal {signal.Signals(signum).name}: saving and stopping after "
                  "this iteration (send again to stop at once)")

    def __enter__(self) -> ExitSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


FAULT_ENV = "MEGATRON_H2_INJECT_FAULT"


def injected_fault(rank: int) -> int | None:
    """Iteration at which this rank must fail, from ``$MEGATRON_H2_INJECT_FAULT=RANK:ITER``.

    For rehearsing failure handling (tests, drills); unset in normal runs.
    """
    value = os.environ.get(FAULT_ENV, "")
    if not value:
        return None
    fault_rank, _, iteration = value.partition(":")
    return int(iteration) if fault_rank.isdigit() and int(fault_rank) == rank else None


class Trainer:
    """Runs training of this rank's part of the model until ``train_iters``."""

    def __init__(self, cfg: RunConfig, runner: StepRunner, train_ds, valid_ds,
                 metrics: MetricsWriter, progress: TrainProgress, ckpt: CheckpointIO,
                 log, precision: PrecisionMonitor | None = None) -> None:
        self.cfg, self.runner, self.precision = cfg, runner, precision
        self.schedule = LRSchedule(cfg.optimizer, cfg.training.train_iters)
        self.train_ds, self.valid_ds = train_ds, valid_ds
        self.metrics, self.progress, self.ckpt, self.log = metrics, progress, ckpt, log
        self.fault_at = injected_fault(runner.topo.rank)

    def evaluate(self) -> float | None:
        t = self.cfg.training
        if self.valid_ds is None or t.eval_iters == 0:
            return None
        return self.runner.eval_loss(self.valid_ds, t.eval_iters)

    def save(self) -> None:
        if self.cfg.training.save:
            start = time.perf_counter()
            path = self.ckpt.save(self.cfg.training.save, self.progress)
            self.log(f"saved checkpoint at iteration {self.progress.iteration} to {path} "
                     f"({time.perf_counter() - start:.2f} s)")

    def _stop_requested(self, stop: ExitSignal, it: int) -> bool:
        t = self.cfg.training
        if t.exit_interval is not None and it % t.exit_interval == 0:
            return True
        # every rank must agree, or some would wait in the next step's collectives
        return world_sum([1.0 if stop.received is not None else 0.0], self.runner.topo)[0] > 0

    def run(self) -> TrainProgress:
        """Train until ``train_iters`` (or an exit signal / ``--exit-interval``)."""
        t = self.cfg.training
        last_saved = self.progress.iteration
        window: list[StepResult] = []
        window_start = time.perf_counter()
        with ExitSignal(self.log) as stop:
            while self.progress.iteration < t.train_iters:
                it = self.progress.iteration + 1
                if it == self.fault_at:
                    raise RuntimeError(f"injected fault at iteration {it} (${FAULT_ENV})")
                window.append(self.runner.train_step(self.train_ds, self.progress.consumed_samples,
                                                     it, self.schedule.lr_at(it)))
                self.progress.iteration = it
                self.progress.consumed_samples += t.global_batch_size
                if self.precision is not None and it % t.precision_check_interval == 0:
                    check_start = time.perf_counter()
                    self.log(self.precision.run(it))  # collective: every rank checks its stage
                    window_start += time.perf_counter() - check_start  # not iteration time
                val_loss = self.evaluate() if it % t.eval_interval == 0 else None
                if it % t.log_interval == 0 or val_loss is not None or it == t.train_iters:
                    self.runner.acc.synchronize()
                    self._log(window, time.perf_counter() - window_start, val_loss)
                    window, window_start = [], time.perf_counter()
                exiting = self._stop_requested(stop, it)
                if (t.save_interval and it % t.save_interval == 0) or exiting:
                    self.save()
                    last_saved = it
                if exiting:
                    self.log(f"stopping at iteration {it} as requested")
                    break
        if self.progress.iteration != last_saved:
            self.save()
        return self.progress

    def _log(self, window: list[StepResult], elapsed: float, val_loss: float | None) -> None:
        cfg = self.cfg
        n = len(window)
        runner = self.runner
        compute, comm = runner.clock.take(), runner.comm.stats()
        runner.comm.reset_stats()
        # collective: every rank logs at the same iterations
        stages = stage_report(runner.topo, compute, elapsed, comm, n) \
            if runner.topo.pp_size > 1 else None
        seconds = elapsed / n
        tokens = cfg.training.global_batch_size * cfg.model.seq_length
        record = {"iteration": self.progress.iteration,
                  "consumed_samples": self.progress.consumed_samples,
                  "lr": window[-1].lr,
                  "lm_loss": sum(r.loss for r in window) / n,
                  "grad_norm": window[-1].grad_norm,
                  "iteration_ms": seconds * 1000.0,
                  "tokens_per_sec": tokens / seconds,
                  "tflops": flops_per_token(cfg.model) * tokens / seconds / 1e12,
                  "global_batch_size": cfg.training.global_batch_size}
        if val_loss is not None:
            record["val_loss"] = val_loss
        self.metrics.train_step(record)
        if stages:
            self.log(stages)
        if val_loss is not None:
            self.metrics.validation(self.progress.iteration, val_loss)
