"""The optimizer and its learning-rate and weight-decay schedules (Megatron's flags)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_h2.config.flags import _positive, _required, check_range, flag
from megatron_h2.errors import ConfigError

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")
#: Largest learning rate, weight decay or clip accepted: an update of that size already
#: overflows float32 weights after a few steps; a larger value is a typo.
MAX_RATE = 1e10


@dataclass
class OptimizerConfig:
    """AdamW and Megatron's optimizer-parameter schedule: learning rate (warm-up from
    ``--lr-warmup-init``, then decay to ``--min-lr``) and weight decay (constant or increasing
    from ``--start-weight-decay`` to ``--end-weight-decay``), counted in samples as in
    Megatron (``megatron_h2.optimizer.lr_schedule``)."""

    optimizer: str = flag("adam", "Optimizer function (Adam with decoupled weight decay).",
                          choices=("adam",))
    lr: float = flag(1e-3, "Initial learning rate (the peak after warm-up).", required=True)
    min_lr: float = flag(0.0, "Minimum value for learning rate.")
    lr_warmup_iters: int = flag(0, "Number of iterations to linearly warm up the learning rate.",
                                unless=("train_samples", "lr_warmup_fraction"))
    lr_warmup_samples: int = flag(0, "Number of samples to linearly warm up the learning rate "
                                  "(sample-based training, --train-samples).")
    lr_warmup_fraction: float | None = flag(
        None, "Fraction of the decay length (--lr-decay-iters / --lr-decay-samples) to warm up "
        "over, instead of --lr-warmup-iters / --lr-warmup-samples.")
    lr_warmup_init: float = flag(0.0, "Initial value for learning rate warm-up; the scheduler "
                                 "starts warm-up from this value.")
    lr_decay_style: str = flag("linear", "Learning rate decay function.", choices=LR_DECAY_STYLES)
    lr_decay_iters: int | None = flag(None, "Iterations to decay the learning rate over; "
                                      "default: --train-iters.")
    lr_decay_samples: int | None = flag(None, "Samples to decay the learning rate over; "
                                        "default: --train-samples.")
    lr_wsd_decay_style: str = flag("exponential", "Decay style of the annealing phase of WSD.",
                                   choices=WSD_DECAY_STYLES)
    lr_wsd_decay_iters: int | None = flag(None, "Iterations of the annealing phase of WSD.")
    lr_wsd_decay_samples: int | None = flag(None, "Samples of the annealing phase of WSD.")
    decoupled_lr: float | None = flag(
        None, "Separate learning rate for the input embedding and output layer weights.")
    decoupled_min_lr: float | None = flag(
        None, "Minimum learning rate for the input embedding and output layer weights "
        "(with --decoupled-lr); default: --min-lr.")
    override_opt_param_scheduler: bool = flag(
        False, "On resume, take the schedule (learning rates, warm-up, decay length and style, "
        "weight decay) from this command line instead of the checkpoint.",
        name="--override-opt_param-scheduler", shortcuts=(
            ("--override-opt-param-scheduler", True, "Same as --override-opt_param-scheduler."),))
    use_checkpoint_opt_param_scheduler: bool = flag(
        False, "On resume, take the schedule from the checkpoint and ignore the command line's.",
        name="--use-checkpoint-opt_param-scheduler", shortcuts=(
            ("--use-checkpoint-opt-param-scheduler", True,
             "Same as --use-checkpoint-opt_param-scheduler."),))
    weight_decay: float = flag(0.01, "Weight decay coefficient for L2 regularization.")
    start_weight_decay: float | None = flag(
        None, "Initial weight decay coefficient (with --weight-decay-incr-style linear|cosine).")
    end_weight_decay: float | None = flag(
        None, "End-of-run weight decay coefficient (with --weight-decay-incr-style "
        "linear|cosine).")
    weight_decay_incr_style: str = flag("constant", "Weight decay increment function.",
                                        choices=WD_INCR_STYLES)
    adam_beta1: float = flag(0.9, "First coefficient for computing running averages of gradient "
                             "and its square.")
    adam_beta2: float = flag(0.999, "Second coefficient for computing running averages of "
                             "gradient and its square.")
    adam_eps: float = flag(1e-8, "Term added to the denominator to improve numerical stability.")
    clip_grad: float = flag(1.0, "Gradient clipping based on global L2 norm (0: off).")

    def __post_init__(self) -> None:
        _required(self, "lr")
        _positive(self, "lr")
        self._check_ranges()
        if not 0.0 <= self.min_lr <= self.lr:
            raise ConfigError(f"--min-lr {self.min_lr} must be between 0 and --lr {self.lr}")
        if not 0.0 <= self.lr_warmup_init <= self.lr:
            raise ConfigError(f"--lr-warmup-init {self.lr_warmup_init} must be between 0 and "
                              f"--lr {self.lr}")
        if self.lr_warmup_iters < 0 or self.lr_warmup_samples < 0:
            raise ConfigError("--lr-warmup-iters and --lr-warmup-samples must be >= 0")
        for name in ("lr_decay_iters", "lr_decay_samples", "lr_wsd_decay_iters",
                     "lr_wsd_decay_samples"):
            if getattr(self, name) is not None:
                _positive(self, name)
        if self.lr_warmup_fraction is not None and not 0.0 <= self.lr_warmup_fraction < 1.0:
            raise ConfigError(f"--lr-warmup-fraction {self.lr_warmup_fraction} must be in [0, 1)")
        for value, choices, name in ((self.lr_decay_style, LR_DECAY_STYLES, "lr-decay-style"),
                                     (self.lr_wsd_decay_style, WSD_DECAY_STYLES,
                                      "lr-wsd-decay-style"),
                                     (self.weight_decay_incr_style, WD_INCR_STYLES,
                                      "weight-decay-incr-style")):
            if value not in choices:
                raise ConfigError(f"--{name} must be one of {', '.join(choices)}, got {value!r}")
        if self.weight_decay < 0 or self.clip_grad < 0:
            raise ConfigError("--weight-decay and --clip-grad must be >= 0 (0 disables clipping)")
        self._check_decoupled()
        self._check_weight_decay_schedule()
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError("--override-opt_param-scheduler and "
                              "--use-checkpoint-opt_param-scheduler exclude each other; give one")

    def _check_ranges(self) -> None:
        """Every numeric flag within its range, before any arithmetic on it."""
        for name in ("lr", "min_lr", "lr_warmup_init", "decoupled_lr", "decoupled_min_lr",
                     "weight_decay", "start_weight_decay", "end_weight_decay", "clip_grad"):
            check_range(self, name, 0.0, MAX_RATE)
        check_range(self, "adam_beta1", 0.0, 1.0, high_open=True)
        check_range(self, "adam_beta2", 0.0, 1.0, high_open=True)
        check_range(self, "adam_eps", 0.0, 1.0, low_open=True)

    def _check_decoupled(self) -> None:
        if self.decoupled_lr is None:
            if self.decoupled_min_lr is not None:
                raise ConfigError("--decoupled-min-lr needs --decoupled-lr (the embedding and "
                                  "output layer otherwise follow --lr / --min-lr)")
            return
        low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
        if not 0.0 <= low <= self.decoupled_lr:
            raise ConfigError(f"the embedding/output layer minimum learning rate {low} "
                              "(--decoupled-min-lr, default --min-lr) must be between 0 and "
                              f"--decoupled-lr {self.decoupled_lr}")
        if self.lr_warmup_init > self.decoupled_lr:
            raise ConfigError(f"--lr-warmup-init {self.lr_warmup_init} exceeds --decoupled-lr "
                              f"{self.decoupled_lr}")

    def _check_weight_decay_schedule(self) -> None:
        start, end = self.start_weight_decay, self.end_weight_decay
        if self.weight_decay_incr_style == "constant":
            if start is not None or end is not None:
                raise ConfigError("--start-weight-decay / --end-weight-decay need "
                                  "--weight-decay-incr-style linear or cosine (the constant "
                                  "style uses --weight-decay)")
            return
        if start is None or end is None:
            raise ConfigError(f"--weight-decay-incr-style {self.weight_decay_incr_style} needs "
                              "both --start-weight-decay and --end-weight-decay")
        if not 0.0 <= start <= end:
            raise ConfigError(f"weight decay must increase: need 0 <= --start-weight-decay "
                              f"{start} <= --end-weight-decay {end}")

    @property
    def start_wd(self) -> float:
        """Weight decay at the first step (``--weight-decay`` unless it increases)."""
        return self.weight_decay if self.start_weight_decay is None else self.start_weight_decay

    @property
    def end_wd(self) -> float:
        """Weight decay at the end of training."""
        return self.weight_decay if self.end_weight_decay is None else self.end_weight_decay
