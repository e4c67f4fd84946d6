"""What a run reports besides the loss: Megatron's logging, timing, profiling and Weights &
Biases flags (:class:`LoggingConfig`). The log interval, ``--tensorboard-dir`` and
``--log-jsonl`` stay with the training loop's settings (:class:`~.training.TrainingConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_h2.config.flags import flag
from megatron_h2.errors import ConfigError

TIMING_LOG_OPTIONS = ("max", "minmax", "all")


@dataclass
class LoggingConfig:
    """Extra figures in the log line, TensorBoard and Weights & Biases, timers, the Python
    logging level, and the torch.profiler window (Megatron's flags and defaults)."""

    log_params_norm: bool = flag(False, "Calculate and log the L2 norm of the parameters.")
    log_num_zeros_in_grad: bool = flag(
        False, "Calculate and log the number of zeros in the gradient (after clipping).")
    log_throughput: bool = flag(
        False, "Calculate and log the model TFLOP/s per device (throughput per GPU).")
    log_timers_to_tensorboard: bool = flag(
        False, "Write the iteration time and the timers of --timing-log-level to TensorBoard.")
    log_memory_to_tensorboard: bool = flag(
        False, "Write device memory (allocated, reserved, peak; the process's resident memory "
        "on the CPU) to TensorBoard.")
    log_validation_ppl_to_tensorboard: bool = flag(
        False, "Write the validation perplexity to TensorBoard.")
    timing_log_level: int = flag(
        0, "Granularity of timers: 0 only the iteration time, 1 operations run about once per "
        "iteration (forward-backward, gradient sync, optimizer), 2 also per micro-batch "
        "operations (forward and backward compute, pipeline communication waits); levels 1 and "
        "2 synchronise the device around what they time.", choices=(0, 1, 2))
    timing_log_option: str = flag(
        "minmax", "How timers are reported over ranks: max, minmax (min and max) or all.",
        choices=TIMING_LOG_OPTIONS)
    tensorboard_log_interval: int = flag(1, "Report to TensorBoard (and Weights & Biases) every "
                                         "this many iterations.")
    tensorboard_queue_size: int = flag(
        1000, "Pending TensorBoard events and summaries before an add call flushes them.")
    logging_level: int | None = flag(
        None, "Level of Python logging for megatron_h2's messages and the libraries' (10 debug, "
        "20 info, 30 warning, 40 error); iteration and validation lines are always printed; "
        "default: info.")
    wandb_project: str | None = flag(
        None, "Weights & Biases project to log to (needs the wandb package; WANDB_MODE=offline "
        "works without a network); without it nothing goes to Weights & Biases.")
    wandb_exp_name: str | None = flag(None, "Weights & Biases run name.")
    wandb_save_dir: str | None = flag(
        None, "Directory for the local Weights & Biases files; default: <--save>/wandb, or "
        "./wandb without --save.")
    wandb_entity: str | None = flag(None, "Weights & Biases entity (team or user).")
    profile: bool = flag(
        False, "Profile iterations --profile-step-start + 1 .. --profile-step-end of the ranks "
        "--profile-ranks with torch.profiler and write a Chrome trace per rank to "
        "<--tensorboard-dir>/../torch_profile/rank-<R>.json.gz (./torch_profile without "
        "--tensorboard-dir); on CUDA the same steps are also an nsys capture range "
        "(--capture-range=cudaProfilerApi).")
    use_pytorch_profiler: bool = flag(
        False, "With --profile: torch.profiler only, no nsys capture range on CUDA.")
    profile_step_start: int = flag(10, "Global step to start profiling (steps done before the "
                                   "profiled iterations).")
    profile_step_end: int = flag(12, "Global step to stop profiling.")
    profile_ranks: list[int] = flag([0], "Global ranks to profile.")

    def __post_init__(self) -> None:
        if self.timing_log_level not in (0, 1, 2):
            raise ConfigError(f"--timing-log-level must be 0, 1 or 2, got {self.timing_log_level}")
        if self.timing_log_option not in TIMING_LOG_OPTIONS:
            raise ConfigError(f"--timing-log-option must be one of "
                              f"{', '.join(TIMING_LOG_OPTIONS)}, got {self.timing_log_option!r}")
        if self.tensorboard_log_interval <= 0 or self.tensorboard_queue_size <= 0:
            raise ConfigError("--tensorboard-log-interval and --tensorboard-queue-size must be "
                              "positive")
        if self.logging_level is not None and self.logging_level < 0:
            raise ConfigError(f"--logging-level must be >= 0 (10 debug, 20 info, 30 warning), got "
                              f"{self.logging_level}")
        if any(rank < 0 for rank in self.profile_ranks):
            raise ConfigError(f"--profile-ranks must be ranks >= 0, got {self.profile_ranks}")
        if self.profile and not 0 <= self.profile_step_start < self.profile_step_end:
            raise ConfigError(f"--profile needs 0 <= --profile-step-start "
                              f"({self.profile_step_start}) < --profile-step-end "
                              f"({self.profile_step_end})")

    @property
    def wandb(self) -> bool:
        """Whether this run logs to Weights & Biases."""
        return bool(self.wandb_project)
