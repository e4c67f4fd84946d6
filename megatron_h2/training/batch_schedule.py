"""The global batch size as a function of consumed samples, and the length of the run.

Three modes, as Megatron-LM's micro-batch calculators:

* constant: ``--global-batch-size`` every iteration;
* ``--rampup-batch-size START INCREMENT SAMPLES`` (Megatron's ramp-up calculator): the batch
  starts at START and grows by INCREMENT each time another ``SAMPLES / n`` samples have been
  consumed, ``n = (global - START) / INCREMENT``, reaching ``--global-batch-size`` after SAMPLES;
* ``--step-batch-size-schedule "0:16 2.4B:320 ..."``: the batch of the last threshold (tokens,
  converted to samples with ``--seq-length``) not above the samples consumed.

An iteration's batch is the one for the samples consumed *before* it; every replica then runs
``batch / (micro-batch x DP)`` micro-batches, so the pipeline schedule sees a different number of
micro-batches per step while the batch grows. Every size the run can use must be divisible by
micro-batch x DP; that is checked before any process group starts. With ``--train-samples`` the
number of iterations follows from the batch sizes, as Megatron's ``update_train_iters``.
"""

from __future__ import annotations

from megatron_h2.config import RunConfig, TrainingConfig, parse_batch_size_schedule
from megatron_h2.errors import ConfigError
from megatron_h2.optimizer.lr_schedule import OptimizerParamScheduler


class BatchSchedule:
    """Global batch size by consumed samples (constant, ramp-up or step schedule)."""

    def __init__(self, global_batch_size: int, rampup: tuple[int, int, int] | None = None,
                 steps: list[tuple[int, int]] | None = None) -> None:
        """``rampup`` is ``(start, increment, samples)``; ``steps`` is ``[(threshold samples,
        batch), ...]`` starting at 0. ``global_batch_size`` is the final batch."""
        self.final = int(global_batch_size)
        self.rampup = rampup
        self.steps = steps
        if rampup is not None:
            start, increment, samples = rampup
            diff = self.final - start
            if diff <= 0 or diff % increment:
                raise ConfigError(
                    f"--rampup-batch-size start {start} must be below --global-batch-size "
                    f"{self.final} by a multiple of the increment {increment}")
            self._per_increment = samples / (diff // increment)

    @classmethod
    def from_config(cls, training: TrainingConfig, seq_length: int) -> BatchSchedule:
        """The schedule of a run whose ``global_batch_size`` the layout has set."""
        if training.global_batch_size is None:
            raise ValueError("global_batch_size is set from the layout before the batch schedule")
        steps = None
        if training.step_batch_size_schedule is not None:
            steps = [(tokens // seq_length, batch) for tokens, batch
                     in parse_batch_size_schedule(training.step_batch_size_schedule)]
            if any(a[0] >= b[0] for a, b in zip(steps, steps[1:])):
                raise ConfigError("--step-batch-size-schedule thresholds must be at least one "
                                  f"sequence ({seq_length} tokens) apart")
            if steps[-1][1] != training.global_batch_size:  # e.g. a --hetero-plan's batch
                raise ConfigError(f"the global batch size {training.global_batch_size} differs "
                                  f"from the last one of --step-batch-size-schedule "
                                  f"({steps[-1][1]}); make them equal")
        rampup = tuple(training.rampup_batch_size) if training.rampup_batch_size else None
        return cls(training.global_batch_size, rampup, steps)

    @property
    def constant(self) -> bool:
        return self.rampup is None and self.steps is None

    def batch_at(self, consumed: int) -> int:
        """The global batch of the iteration that starts after ``consumed`` samples."""
        if self.steps is not None:
            return next(batch for threshold, batch in reversed(self.steps)
                        if consumed >= threshold)
        if self.rampup is not None and consumed <= self.rampup[2]:
            start, increment, _ = self.rampup
            return start + int(consumed / self._per_increment) * increment
        return self.final

    def sizes(self) -> list[int]:
        """Every global batch size the run can use."""
        if self.steps is not None:
            return sorted({batch for _, batch in self.steps})
        if self.rampup is not None:
            return list(range(self.rampup[0], self.final + 1, self.rampup[1]))
        return [self.final]

    def check(self, micro_batch_size: int, data_parallel_size: int) -> None:
        """Every size must split into whole micro-batches on every data-parallel replica."""
        unit = micro_batch_size * data_parallel_size
        bad = [size for size in self.sizes() if size % unit]
        if bad:
            raise ConfigError(f"global batch size {bad[0]} (of the batch-size schedule) is not "
                              f"divisible by --micro-batch-size {micro_batch_size} x data-"
                              f"parallel size {data_parallel_size}; use multiples of {unit}")

    def _next_change(self, consumed: int) -> int | None:
        """Where a step schedule next changes the batch (None: never again)."""
        return next((t for t, _ in self.steps if t > consumed), None)

    def iterations_for(self, train_samples: int) -> int:
        """Iterations of a ``--train-samples`` run (Megatron's ``update_train_iters``)."""
        if self.steps is not None:  # until the samples are consumed (the last may overshoot)
            iterations = consumed = 0
            while consumed < train_samples:
                batch, change = self.batch_at(consumed), self._next_change(consumed)
                end = train_samples if change is None else min(change, train_samples)
                n = -(-(end - consumed) // batch)
                iterations, consumed = iterations + n, consumed + n * batch
            return iterations
        if self.rampup is None:
            return train_samples // self.final
        iterations = consumed = 0
        while consumed <= self.rampup[2] and consumed <= train_samples:  # ramp-up phase
            consumed += self.batch_at(consumed)
            iterations += 1
        if train_samples > consumed:  # constant phase; a partial last batch is dropped
            iterations += (train_samples - consumed) // self.final
        return iterations

    def samples_for(self, iterations: int) -> int:
        """Samples consumed by the first ``iterations`` iterations."""
        consumed = 0
        while iterations > 0:
            batch = self.batch_at(consumed)
            if self.steps is not None:
                change = self._next_change(consumed)
                n = iterations if change is None else min(iterations,
                                                          -(-(change - consumed) // batch))
            elif self.rampup is not None and consumed <= self.rampup[2]:
                n = 1
            else:
                n = iterations
            consumed, iterations = consumed + n * batch, iterations - n
        return consumed

    def train_iterations(self, training: TrainingConfig) -> int:
        """The run's length in iterations: ``--train-iters`` or from ``--train-samples``."""
        if training.train_iters is not None:
            return training.train_iters
        if training.train_samples is None:
            raise ConfigError("give --train-iters or --train-samples (the length of the run)")
        return self.iterations_for(training.train_samples)

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.steps is not None:
            return "step schedule " + " ".join(f"{t}:{b}" for t, b in self.steps) + " (samples)"
        if self.rampup is not None:
            start, increment, samples = self.rampup
            return (f"ramp-up from {start} by {increment} over {samples} samples to "
                    f"{self.final}")
        return f"constant {self.final}"


def check_run_schedule(cfg: RunConfig, micro_batch_size: int, data_parallel_size: int
                       ) -> tuple[BatchSchedule, int, OptimizerParamScheduler]:
    """The batch schedule, the number of iterations and the learning-rate schedule of a run
    whose layout is known, checked (one-line errors, before any process group starts)."""
    batch = BatchSchedule.from_config(cfg.training, cfg.model.seq_length)
    batch.check(micro_batch_size, data_parallel_size)
    iterations = batch.train_iterations(cfg.training)
    if iterations < 1:
        raise ConfigError(f"--train-samples {cfg.training.train_samples} is less than one global "
                          f"batch ({batch.batch_at(0)}); train for more samples")
    return batch, iterations, OptimizerParamScheduler.from_config(cfg.optimizer, cfg.training)


__all__ = ["BatchSchedule", "check_run_schedule"]
