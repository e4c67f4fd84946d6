"""The training loop over a built :class:`~megatron_h2.training.build.Run`: steps, evaluation,
logging, checkpoints, numerical health and clean stops."""

from __future__ import annotations

import json
import os
import signal
import time
from types import FrameType

from megatron_h2.checkpointing.checkpoint_io import TrainProgress
from megatron_h2.checkpointing.housekeeping import apply_retention
from megatron_h2.monitoring.health import HealthMonitor, JobTrainingError
from megatron_h2.monitoring.metrics import memory_scalars
from megatron_h2.monitoring.torch_profiler import StepProfiler
from megatron_h2.training.build import Run
from megatron_h2.training.good_checkpoints import GoodCheckpoints
from megatron_h2.training.step import StepResult, world_sum


class ExitSignal:
    """Turns ``signals`` into a request to save and stop after the current iteration.

    Ctrl-C (SIGINT) always does; ``--exit-signal-handler`` adds ``--exit-signal`` (SIGTERM),
    which otherwise ends the process at once, as in Megatron.
    """

    def __init__(self, log, signals: tuple[signal.Signals, ...] = (signal.SIGINT,)) -> None:
        self.received: int | None = None
        self._log = log
        self._signals = signals
        self._previous: dict[int, object] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # second signal: stop now
            raise KeyboardInterrupt
        self.received = signum
        self._log(f"received signal {signal.Signals(signum).name}: saving and stopping after "
                  "this iteration (send again to stop at once)")

    def __enter__(self) -> ExitSignal:
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


FAULT_ENV = "MEGATRON_H2_INJECT_FAULT"


def injected_fault(rank: int) -> tuple[int, str] | None:
    """(iteration, mode) at which this rank must fail, from ``$MEGATRON_H2_INJECT_FAULT``:
    ``RANK:ITER`` (raise an error), ``RANK:ITER:kill`` (die at once from SIGKILL, as a lost chip
    would) or ``RANK:ITER:stop`` (SIGSTOP: the process stops responding, as a hung host).

    For rehearsing failure handling (tests, drills); unset in normal runs.
    """
    value = os.environ.get(FAULT_ENV, "")
    if not value:
        return None
    fault_rank, _, rest = value.partition(":")
    iteration, _, mode = rest.partition(":")
    if not (fault_rank.isdigit() and iteration.isdigit()) or int(fault_rank) != rank:
        return None
    return int(iteration), mode if mode in ("kill", "stop") else "raise"


class Trainer:
    """Trains a built :class:`Run` on this rank until its length (or a stop)."""

    def __init__(self, run: Run) -> None:
        cfg, progress = run.cfg, run.progress
        self.run, self.cfg, self.progress, self.log = run, cfg, progress, run.say
        self.runner, self.ckpt, self.metrics = run.runner, run.ckpt, run.metrics
        self.schedule, self.batch, self.train_iters = run.schedule, run.batch, run.iterations
        self.fault = injected_fault(run.topo.rank)
        self.started_at = progress.iteration
        # the newest checkpoint known good: the one loaded, then those verified by this run
        self.good = GoodCheckpoints(
            (cfg.training.load, progress.iteration) if progress.iteration else None,
            self.runner.params_norm() if cfg.training.save else 0.0, run.topo.rank, self.log)
        self.health = HealthMonitor(cfg.training, (run.tokenizer.vocab_size, cfg.model.vocab_size),
                                    self.log, self.good.describe)
        if progress.health is not None:  # the history the run before judged with
            self.health.load_state_dict(progress.health,
                                        f"iteration {progress.iteration} in {cfg.training.load}")
        self.profiler = StepProfiler(cfg.logging, run.topo.rank, run.accelerator.device_type,
                                     cfg.training.tensorboard_dir, self.log)

    def _report_first_iteration(self, iteration: int) -> None:
        """Tell an elastic launcher (``$MEGATRON_H2_ELASTIC_DIR``) when this run's first
        iteration finished: the end of a recovery."""
        folder = os.environ.get("MEGATRON_H2_ELASTIC_DIR")
        if not folder or self.run.topo.rank != 0:
            return
        note = {"iteration": iteration, "time": time.time(),
                "attempt": int(os.environ.get("MEGATRON_H2_ATTEMPT", "0") or 0)}
        tmp = os.path.join(folder, f".first_iteration.{os.getpid()}.tmp")
        with open(tmp, "w") as fh:
            json.dump(note, fh)
        os.replace(tmp, os.path.join(folder, "first_iteration.json"))

    def evaluate(self) -> float | None:
        t = self.cfg.training
        if self.run.valid_ds is None or t.eval_iters == 0:
            return None
        return self.runner.eval_loss(self.run.valid_ds, t.eval_iters)

    def save(self) -> None:
        """Save (collective), unless the state is suspect or its weights out of bounds: a bad
        state is never checkpointed."""
        save_dir, it = self.cfg.training.save, self.progress.iteration
        if not save_dir:
            return
        self.finish_background_save(blocking=True)  # one save at a time
        norm = self.runner.params_norm()  # collective: every rank decides alike
        problem = self.good.weights_problem(norm)
        if self.health.suspect or problem:
            why = problem or (f"{self.health.flat_why} for {self.health.flat_streak} "
                              "iteration(s)")
            self.log(f"not saving at iteration {it}: the state is suspect ({why}); the last "
                     f"good checkpoint is {self.good.describe(it)}")
            return
        start = time.perf_counter()
        self.progress.scheduler = self.schedule.state_dict()
        self.progress.grad_scaler = self.runner.grad_scaler_state()
        self.progress.health = self.health.state_dict()
        self.ckpt.protect = self.good.protected(save_dir)
        if self.cfg.training.async_save:
            self.ckpt.save(save_dir, self.progress, background=True)
            self.good.on_save(save_dir, it, norm, committed=False)
            self.log(f"saving checkpoint at iteration {it} in the background (state gathered "
                     f"and copied to host memory in {time.perf_counter() - start:.2f} s)")
            return
        path = self.ckpt.save(save_dir, self.progress)
        self.good.on_save(save_dir, it, norm, committed=True)
        self.log(f"saved checkpoint at iteration {it} to {path} "
                 f"({time.perf_counter() - start:.2f} s)")
        self._log_removed()

    def finish_background_save(self, blocking: bool) -> None:
        """Commit an ``--async-save`` checkpoint whose writes are done (collective)."""
        if self.cfg.training.save:
            self.ckpt.protect = self.good.protected(self.cfg.training.save)
        done = self.ckpt.finish_background_save(blocking)
        if done is None:
            return
        path, it, seconds = done
        self.good.on_commit(it)
        self.log(f"saved checkpoint at iteration {it} to {path} (written in the background in "
                 f"{seconds:.2f} s)")
        self._log_removed()

    def _log_removed(self) -> None:
        if self.ckpt.removed:
            self.log(f"removed checkpoints of iterations {', '.join(map(str, self.ckpt.removed))}"
                     " (--save-retain-interval / --most-recent-k)")

    def _stop_requested(self, stop: ExitSignal, it: int) -> str | None:
        """Why training must stop after iteration ``it`` (None: go on); the same on every rank."""
        t = self.cfg.training
        minutes = (time.perf_counter() - self.run.started) / 60.0
        # every rank must agree, or some would wait in the next step's collectives
        signalled, timed_out = world_sum(
            [1.0 if stop.received is not None else 0.0,
             1.0 if t.exit_duration_in_mins is not None and minutes > t.exit_duration_in_mins
             else 0.0], self.run.topo)
        if signalled:
            return "after receiving a signal"
        if timed_out:
            return f"after {minutes:.2f} minutes (--exit-duration-in-mins)"
        if t.exit_interval is not None and it % t.exit_interval == 0:
            return "at --exit-interval"
        return None

    def _exit_signals(self) -> tuple[signal.Signals, ...]:
        t = self.cfg.training
        extra = (signal.Signals[t.exit_signal],) if t.exit_signal_handler else ()
        return tuple(dict.fromkeys((signal.SIGINT, *extra)))

    def train(self) -> TrainProgress:
        """Train until the run's length (or an exit signal / ``--exit-interval``); on a stop for
        a bad iteration, this run's unverified checkpoints are set aside first."""
        try:
            return self._train()
        except JobTrainingError:
            self.good.on_stop(self.cfg.training.save)
            raise

    def _inject_fault(self, it: int) -> None:
        if self.fault[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.fault[1] == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # on SIGCONT, goes on where it stopped
        else:
            raise RuntimeError(f"injected fault at iteration {it} (${FAULT_ENV})")

    def _train(self) -> TrainProgress:
        t = self.cfg.training
        last_saved = self.progress.iteration
        window: list[StepResult] = []
        window_start = time.perf_counter()
        with ExitSignal(self.log, self._exit_signals()) as stop:
            while self.progress.iteration < self.train_iters:
                it = self.progress.iteration + 1
                if self.fault is not None and it == self.fault[0]:
                    self._inject_fault(it)
                batch = self.batch.batch_at(self.progress.consumed_samples)
                lr = self.schedule.apply(self.run.optimizer)
                self.profiler.before(it)
                result = self.runner.train_step(self.run.train_ds, self.progress.consumed_samples,
                                                it, lr, batch, self.health)
                self.profiler.after(it)
                window.append(result)
                if result.overflow:  # as Megatron: the schedule advances on updates only
                    self.health.count_overflow_skip(it, result.loss_scale)
                else:
                    self.schedule.step(batch)
                self.good.on_step(it, result.overflow or not (result.skipped
                                                              or self.health.suspect))
                if it % self.cfg.logging.tensorboard_log_interval == 0:
                    self._write_scalars(it, result)
                if it == self.started_at + 1:
                    self._report_first_iteration(it)
                self.progress.iteration = it
                self.progress.consumed_samples += batch
                self.finish_background_save(blocking=False)
                if self.run.precision is not None and it % t.precision_check_interval == 0:
                    check_start = time.perf_counter()
                    self.run.optimizer.finish_param_sync()  # nothing in flight while replayed
                    self.log(self.run.precision.run(it))  # collective: every rank checks its stage
                    window_start += time.perf_counter() - check_start  # not iteration time
                val_loss = self.evaluate() if it % t.eval_interval == 0 else None
                if it % t.log_interval == 0 or val_loss is not None or it == self.train_iters:
                    self.run.accelerator.synchronize()
                    self._log(window, time.perf_counter() - window_start, val_loss)
                    window, window_start = [], time.perf_counter()
                exiting = self._stop_requested(stop, it)
                if (t.save_interval and it % t.save_interval == 0) or exiting:
                    self.save()
                    last_saved = it
                if exiting:
                    self.log(f"stopping at iteration {it} {exiting}")
                    break
        self.profiler.close(self.progress.iteration)
        if self.progress.iteration != last_saved:
            self.save()
        self.finish_background_save(blocking=True)
        self._final_retention()
        return self.progress

    def _final_retention(self) -> None:
        """The run ended normally: the last good checkpoint needs no protection any more, so
        retention (--save-retain-interval / --most-recent-k) applies as in Megatron."""
        t = self.cfg.training
        if t.save and self.run.topo.rank == 0 and self.ckpt.protect is not None:
            self.ckpt.protect = None
            self.ckpt.removed = apply_retention(t.save, t.save_retain_interval, t.most_recent_k)
            self._log_removed()

    def _write_scalars(self, it: int, result: StepResult) -> None:
        """This iteration's figures to TensorBoard / Weights & Biases."""
        values = {"lm_loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                  "global_batch_size": float(result.global_batch_size)}
        if result.num_zeros is not None:
            values["num_zeros"] = float(result.num_zeros)
        if result.loss_scale is not None:
            values["loss_scale"] = result.loss_scale
        self.metrics.scalars(it, values)
        if result.moe is not None:  # Megatron's names, unprefixed
            self.metrics.scalars(it, result.moe.scalars(self.cfg.model.moe_per_layer_logging),
                                 prefix="")

    def _log(self, window: list[StepResult], elapsed: float, val_loss: float | None) -> None:
        cfg, lg, run = self.cfg, self.cfg.logging, self.run
        n = len(window)
        report = self.runner.window_report(elapsed, n, lg.timing_log_option)  # collective
        seconds = elapsed / n
        tokens = sum(r.global_batch_size for r in window) / n * cfg.model.seq_length
        record = {"iteration": self.progress.iteration,
                  "consumed_samples": self.progress.consumed_samples,
                  "lr": window[-1].lr,
                  "lm_loss": sum(r.loss for r in window) / n,
                  "grad_norm": window[-1].grad_norm,
                  "iteration_ms": seconds * 1000.0,
                  "tokens_per_sec": tokens / seconds,
                  "tflops": cfg.model.flops_per_token() * tokens / seconds / 1e12,
                  "global_batch_size": window[-1].global_batch_size,
                  "skipped_iterations": self.health.skipped_iterations}
        if self.runner.loss_scale is not None:
            record["loss_scale"] = self.runner.loss_scale
        if lg.log_throughput:  # Megatron's throughput per GPU: the job's FLOP/s per device
            record["throughput_per_gpu_tflops"] = record["tflops"] / run.topo.world_size
        if window[-1].num_zeros is not None:
            record["num_zeros"] = window[-1].num_zeros
        moe = window[-1].moe
        if moe is not None:  # the last iteration's, as Megatron's line
            record["moe_losses"] = moe.losses
            record["moe_tokens_per_expert"] = {str(k): v for k, v in
                                               moe.tokens_per_expert.items()}
            if cfg.model.moe_per_layer_logging:
                record["moe_per_layer_losses"] = {
                    name: {str(k): v for k, v in layers.items()}
                    for name, layers in moe.per_layer.items()}
        if lg.log_params_norm:
            record["params_norm"] = self.runner.params_norm()  # collective
        if val_loss is not None:
            record["val_loss"] = val_loss
        self.metrics.train_step(record)
        for line in report.timer_lines:
            self.log(line)
        self._write_log_scalars(record, report.timer_max)
        if report.stages:
            self.log(report.stages)
        if val_loss is not None:
            self.metrics.validation(self.progress.iteration, val_loss)

    def _write_log_scalars(self, record: dict, timer_max: dict[str, float]) -> None:
        """The log interval's figures to TensorBoard / Weights & Biases (Megatron's names for
        throughput, timers and memory)."""
        lg, it = self.cfg.logging, record["iteration"]
        self.metrics.scalars(it, {k: record[k] for k in ("iteration_ms", "tokens_per_sec",
                                                         "tflops")})
        extra = {}
        if lg.log_throughput:
            extra["throughput"] = record["throughput_per_gpu_tflops"]
        if "params_norm" in record:
            extra["params-norm"] = record["params_norm"]
        if lg.log_timers_to_tensorboard:
            extra["iteration-time"] = record["iteration_ms"]
            extra.update({f"{name}-time": ms for name, ms in timer_max.items()})
        if lg.log_memory_to_tensorboard:
            extra.update(memory_scalars(self.run.accelerator.memory_stats()))
        if extra:
            self.metrics.scalars(it, extra, prefix="")


def train(run: Run) -> TrainProgress:
    """Train ``run`` until its length (or a stop); returns where it stopped."""
    return Trainer(run).train()
