"""Megatron's optimizer-parameter schedule: learning rate and weight decay by consumed samples.

As in Megatron-LM (``OptimizerParamScheduler``) the schedule counts *samples*: an iteration-based
run (``--train-iters``) turns ``--lr-warmup-iters`` / ``--lr-decay-iters`` into samples with the
(final) ``--global-batch-size``; a sample-based run (``--train-samples``) gives them directly.
``num_steps`` is the number of samples consumed so far, so the rate of an iteration is the one
for the samples consumed *before* it (the first iteration of a warm-up uses ``--lr-warmup-init``)
and a batch-size ramp-up advances the schedule by the real batch sizes.

Each parameter group may carry ``max_lr`` / ``min_lr`` (``--decoupled-lr`` for the embedding and
output layer) and ``wd_mult`` (0 for norms and biases); :meth:`OptimizerParamScheduler.apply`
writes every group's ``lr`` and ``weight_decay``.

The schedule is saved with each checkpoint (:meth:`~OptimizerParamScheduler.state_dict`).
Resuming with a schedule that differs from the checkpoint's is an error naming both values,
unless ``--override-opt_param-scheduler`` (this run's values win) or
``--use-checkpoint-opt_param-scheduler`` (the checkpoint's win) is given.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from megatron_h2.config import OptimizerConfig, TrainingConfig
from megatron_h2.errors import ConfigError


@dataclass
class ScheduleSettings:
    """The values that define the schedule (Megatron's scheduler state, less ``num_steps``)."""

    max_lr: float
    min_lr: float
    lr_warmup_steps: float
    lr_decay_steps: int
    lr_decay_style: str
    start_wd: float
    end_wd: float
    wd_incr_steps: int
    wd_incr_style: str


_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "warm-up samples: --lr-warmup-iters x --global-batch-size, "
                       "--lr-warmup-samples or --lr-warmup-fraction",
    "lr_decay_steps": "decay samples: --lr-decay-iters x --global-batch-size or "
                      "--lr-decay-samples",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--start-weight-decay or --weight-decay",
    "end_wd": "--end-weight-decay or --weight-decay",
    "wd_incr_steps": "weight-decay samples: --train-iters x --global-batch-size or "
                     "--train-samples",
    "wd_incr_style": "--weight-decay-incr-style",
}


def schedule_lengths(opt: OptimizerConfig, training: TrainingConfig) -> tuple[float, int, int,
                                                                               int | None]:
    """(warm-up, decay, weight-decay increment, WSD anneal) lengths in samples, as Megatron's
    ``get_optimizer_param_scheduler`` computes them."""
    gbs = training.global_batch_size
    if training.train_iters is not None and training.train_samples is None:
        if gbs is None:
            raise ValueError("global_batch_size is set from the layout before the schedule")
        decay = (opt.lr_decay_iters or training.train_iters) * gbs
        wd_incr = training.train_iters * gbs
        wsd = opt.lr_wsd_decay_iters * gbs if opt.lr_wsd_decay_iters is not None else None
        warmup = (opt.lr_warmup_fraction * decay if opt.lr_warmup_fraction is not None
                  else opt.lr_warmup_iters * gbs)
    elif training.train_samples is not None:
        decay = opt.lr_decay_samples or training.train_samples
        wd_incr = training.train_samples
        wsd = opt.lr_wsd_decay_samples
        warmup = (opt.lr_warmup_fraction * decay if opt.lr_warmup_fraction is not None
                  else opt.lr_warmup_samples)
    else:
        raise ConfigError("give --train-iters or --train-samples (the length of the run)")
    return warmup, decay, wd_incr, wsd


class OptimizerParamScheduler:
    """Learning rate (warm-up, then constant / linear / cosine / inverse-square-root / WSD decay)
    and weight decay (constant, linear or cosine increase) as functions of consumed samples."""

    def __init__(self, settings: ScheduleSettings, init_lr: float = 0.0,
                 wsd_decay_steps: int | None = None,
                 lr_wsd_decay_style: str = "exponential") -> None:
        self.settings = settings
        self.init_lr = init_lr
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.num_steps = 0
        s = settings
        if s.lr_decay_steps <= 0:
            raise ConfigError("the learning-rate decay length must be positive")
        if s.lr_warmup_steps >= s.lr_decay_steps:
            raise ConfigError(f"the warm-up ({s.lr_warmup_steps:g} samples) must end before the "
                              f"decay length ({s.lr_decay_steps} samples); shorten the warm-up")
        if s.lr_decay_style == "WSD" and not wsd_decay_steps:
            raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters (or "
                              "--lr-wsd-decay-samples)")

    @classmethod
    def from_config(cls, opt: OptimizerConfig, training: TrainingConfig
                    ) -> OptimizerParamScheduler:
        """The schedule of a run (``training.global_batch_size`` set by the layout)."""
        warmup, decay, wd_incr, wsd = schedule_lengths(opt, training)
        settings = ScheduleSettings(
            max_lr=float(opt.lr), min_lr=opt.min_lr, lr_warmup_steps=warmup, lr_decay_steps=decay,
            lr_decay_style=opt.lr_decay_style, start_wd=opt.start_wd, end_wd=opt.end_wd,
            wd_incr_steps=wd_incr, wd_incr_style=opt.weight_decay_incr_style)
        return cls(settings, init_lr=opt.lr_warmup_init, wsd_decay_steps=wsd,
                   lr_wsd_decay_style=opt.lr_wsd_decay_style)

    # ------------------------------------------------------------------------- values
    def lr(self, num_steps: float | None = None, max_lr: float | None = None,
           min_lr: float | None = None) -> float:
        """Learning rate after ``num_steps`` samples (default: the current position) for a group
        whose peak / floor are ``max_lr`` / ``min_lr`` (default: ``--lr`` / ``--min-lr``)."""
        s = self.settings
        steps = self.num_steps if num_steps is None else num_steps
        max_lr = s.max_lr if max_lr is None else max_lr
        min_lr = s.min_lr if min_lr is None else min_lr
        if s.lr_warmup_steps > 0 and steps <= s.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(steps) / s.lr_warmup_steps
        if s.lr_decay_style == "constant":
            return max_lr
        if steps > s.lr_decay_steps:
            return min_lr
        if s.lr_decay_style == "inverse-square-root":
            warmup = max(s.lr_warmup_steps, 1)
            return max(min_lr, max_lr * warmup ** 0.5 / max(steps, 1) ** 0.5)
        ratio = (steps - s.lr_warmup_steps) / (s.lr_decay_steps - s.lr_warmup_steps)
        if s.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif s.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: constant, then anneal over the last wsd_decay_steps samples
            coeff = self._wsd_coeff(steps)
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self, steps: float) -> float:
        anneal_start = self.settings.lr_decay_steps - self.wsd_decay_steps
        if steps <= anneal_start:
            return 1.0
        ratio = (steps - anneal_start) / self.wsd_decay_steps
        style = self.lr_wsd_decay_style
        if style == "linear":
            return 1.0 - ratio
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if style == "exponential":
            return 2.0 * math.pow(0.5, ratio) - 1.0
        return 1.0 - math.sqrt(ratio)  # minus_sqrt

    def weight_decay(self, num_steps: float | None = None) -> float:
        """Weight decay after ``num_steps`` samples (default: the current position)."""
        s = self.settings
        steps = self.num_steps if num_steps is None else num_steps
        if steps > s.wd_incr_steps or s.wd_incr_style == "constant":
            return s.end_wd
        ratio = steps / s.wd_incr_steps
        coeff = ratio if s.wd_incr_style == "linear" else \
            0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return s.start_wd + coeff * (s.end_wd - s.start_wd)

    def apply(self, optimizer) -> float:
        """Set every parameter group's ``lr`` and ``weight_decay`` for the current position;
        returns the base learning rate (the one logged)."""
        wd = self.weight_decay()
        for group in optimizer.param_groups:
            group["lr"] = self.lr(max_lr=group.get("max_lr"), min_lr=group.get("min_lr"))
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)
        return self.lr()

    def step(self, increment: int) -> None:
        """Advance by ``increment`` consumed samples (the iteration's global batch size)."""
        self.num_steps += increment

    # ------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Megatron's scheduler state: the settings and ``num_steps`` (samples consumed)."""
        return {**asdict(self.settings), "num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, Any], override: bool = False,
                        use_checkpoint: bool = False) -> None:
        """Resume from ``state``. A setting that differs from this run's is an error naming both,
        unless ``override`` (keep this run's) or ``use_checkpoint`` (take the checkpoint's)."""
        for f in fields(ScheduleSettings):
            if f.name not in state:
                continue
            mine, saved = getattr(self.settings, f.name), state[f.name]
            if override or mine == saved:
                continue
            if not use_checkpoint:
                raise ConfigError(
                    f"the checkpoint's schedule has {f.name} {saved} but this run has {mine} "
                    f"({_FLAGS[f.name]}); pass --override-opt_param-scheduler to "
                    "use this run's values or --use-checkpoint-opt_param-scheduler to keep the "
                    "checkpoint's")
            setattr(self.settings, f.name, saved)
        self.num_steps = int(state.get("num_steps", 0))


__all__ = ["OptimizerParamScheduler", "ScheduleSettings", "schedule_lengths"]
