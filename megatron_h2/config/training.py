"""Batching, length of the run, precision, logging, checkpoint cadence and numerical health."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from megatron_h2.config.dtype_rules import Precision
from megatron_h2.config.flags import _positive, _required, flag, parse_batch_size_schedule
from megatron_h2.errors import ConfigError


@dataclass
class TrainingConfig:
    """Batching, length of the run, precision, logging and checkpoint cadence."""

    micro_batch_size: int = flag(4, "Batch size per model instance (local batch size).",
                                 required=True)
    global_batch_size: int | None = flag(
        None, "Training batch size (after any ramp-up); default: --micro-batch-size x "
        "data-parallel size, or the last batch size of --step-batch-size-schedule.",
        unless=("step_batch_size_schedule",))
    rampup_batch_size: list[int] | None = flag(
        None, "Batch size ramp-up START INCREMENT SAMPLES: start at global batch START and grow "
        "it by INCREMENT in equal shares of the first SAMPLES samples up to --global-batch-size "
        "(sample-based training, --train-samples).", nargs=3, metavar="N")
    step_batch_size_schedule: str | None = flag(
        None, "Global batch size by consumed tokens, \"THRESHOLD:BATCH ...\" with K/M/B/T "
        "suffixes, e.g. \"0:16 2.4B:320 12B:1536\" (a threshold is tokens, converted to samples "
        "with --seq-length).", metavar="SCHEDULE")
    train_iters: int | None = flag(None, "Total number of iterations to train over all training "
                                   "runs.", required=True, unless=("train_samples",))
    train_samples: int | None = flag(
        None, "Total number of samples to train over all training runs (instead of "
        "--train-iters; the iterations follow from the batch sizes).")
    seed: int = flag(1234, "Random seed used for python, numpy, torch and the data order.")
    # Mixed precision (Megatron's flags, defaults and meaning; see config/dtype_rules.py)
    bf16: bool = flag(False, "Run the model in bfloat16 mixed precision: bf16 weights, fp32 main "
                      "weights in the optimizer, gradients accumulated and reduced in fp32.")
    fp16: bool = flag(False, "Run the model in fp16 mixed precision: fp16 weights, fp32 main "
                      "weights in the optimizer, loss scaling (dynamic unless --loss-scale).")
    grad_reduce_in_bf16: bool = flag(False, "Reduce gradients in bfloat16 (with --bf16: "
                                     "the gradient buckets are bf16).")
    accumulate_allreduce_grads_in_fp32: bool = flag(
        False, "Gradient accumulation and all-reduce in fp32 (on by default with --bf16 unless "
        "--grad-reduce-in-bf16).")
    loss_scale: float | None = flag(
        None, "Static loss scaling, positive power of 2 values can improve fp16 convergence. "
        "If None, dynamic loss scaling is used.")
    initial_loss_scale: float = flag(2.0**32, "Initial loss-scale for dynamic loss scaling.")
    min_loss_scale: float = flag(1.0, "Minimum loss scale for dynamic loss scaling.")
    loss_scale_window: float = flag(1000.0, "Window over which to raise/lower dynamic scale.")
    hysteresis: int = flag(2, "hysteresis for dynamic loss scaling")
    device: str | None = flag(None, "Torch device type to train on (cpu, cuda, npu, mlu, xpu); "
                              "default: detect.")
    log_interval: int = flag(100, "Report loss and timing interval.")
    eval_interval: int = flag(1000, "Interval between running evaluation on validation set.")
    eval_iters: int = flag(100, "Number of iterations to run for evaluation (0: none).")
    save: str | None = flag(None, "Output directory to save checkpoints to.")
    load: str | None = flag(None, "Directory containing a model checkpoint.")
    save_interval: int | None = flag(None, "Number of iterations between checkpoint saves.")
    async_save: bool = flag(
        False, "Write checkpoints in the background: the state is copied to host memory and a "
        "writer thread saves it while training goes on; the next save (and the end of the run) "
        "waits for the previous one.")
    tensorboard_dir: str | None = flag(None, "Write TensorBoard logs to this directory.")
    log_jsonl: str | None = flag(None, "Append one JSON object per logged iteration to this file.")
    timeline_trace: str | None = flag(
        None, "Write a Chrome/Perfetto trace of every rank's forward, backward, send and receive "
        "per micro-batch.")
    exit_interval: int | None = flag(
        None, "Exit the program (after saving) when the iteration is divisible by this value.")
    exit_duration_in_mins: float | None = flag(
        None, "Exit the program (after saving) once it has run this many minutes.")
    exit_signal_handler: bool = flag(
        False, "On --exit-signal (SIGTERM), save a checkpoint and shut down after the current "
        "iteration; without this flag the signal ends the process at once.")
    exit_signal: str = flag("SIGTERM", "Signal for --exit-signal-handler.", choices=tuple(
        s.name for s in signal.Signals if s.name not in ("SIGKILL", "SIGSTOP")))
    calculate_per_token_loss: bool = flag(
        False, "Average the loss over all tokens of the global batch instead of over each "
        "micro-batch's tokens first (they differ when --eod-mask-loss masks tokens).")
    precision_check_interval: int | None = flag(
        None, "Every N iterations, re-run the last micro-batch of each pipeline stage with every "
        "operator replayed on the CPU in fp64 and log the worst operator error per stage (off by "
        "default; each check costs a forward and backward of a micro-batch plus its fp64 replay: "
        "3-7 training iterations of CPU time on small CPU models, see "
        "bench/bench_precision_check.py; overhead about that / N).")
    # Checkpoint integrity and retention (--save-retain-interval as in Megatron)
    verify_checkpoint: bool = flag(
        True, "Do not check the SHA-256 of every checkpoint part on load (sizes are still "
        "checked).", name="--no-verify-checkpoint", negative=True)
    save_retain_interval: int | None = flag(
        None, "Number of iterations between retained checkpoints (other checkpoints except the "
        "last are deleted).")
    most_recent_k: int = flag(-1, "Also keep the K newest checkpoints (-1: keep all).")
    # Numerical health (Megatron's --no-check-for-nan-in-loss-and-grad, --check-for-spiky-loss)
    check_for_nan_in_loss_and_grad: bool = flag(
        True, "Do not stop on NaN / Inf in the loss or the gradients (checked before every "
        "optimizer step).", name="--no-check-for-nan-in-loss-and-grad", negative=True)
    check_for_spiky_loss: bool = flag(
        False, "Treat a loss above --spiky-loss-factor x the running median as a bad step.")
    spiky_loss_factor: float = flag(10.0, "How many times the running median loss a spike is.")
    flat_line_iters: int = flag(
        5, "A run whose grad norm is 0 or whose loss sits at ln(vocabulary) for this many "
        "iterations has stalled (0: off).")
    skip_bad_steps: int = flag(
        0, "Skip up to this many bad steps (NaN / Inf, spike, flat line) without an update, "
        "then stop.")

    def __post_init__(self) -> None:
        _required(self, "micro_batch_size")
        self._check_precision()
        _positive(self, "micro_batch_size", "log_interval", "eval_interval")
        self._check_length_and_batch()
        if self.global_batch_size is not None:
            _positive(self, "global_batch_size")
        if self.eval_iters < 0:
            raise ConfigError("--eval-iters must be >= 0 (0 disables evaluation)")
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"--global-batch-size {self.global_batch_size} is not divisible by "
                f"--micro-batch-size {self.micro_batch_size}; make it a multiple")
        if self.save_interval is not None and self.save_interval <= 0:
            raise ConfigError("--save-interval must be a positive number of iterations")
        if self.exit_interval is not None and self.exit_interval <= 0:
            raise ConfigError("--exit-interval must be a positive number of iterations")
        if self.exit_duration_in_mins is not None and self.exit_duration_in_mins <= 0:
            raise ConfigError("--exit-duration-in-mins must be a positive number of minutes")
        if self.precision_check_interval is not None and self.precision_check_interval <= 0:
            raise ConfigError("--precision-check-interval must be a positive number of "
                              "iterations (leave it out to turn the check off)")
        self._check_health_and_retention()

    def _check_precision(self) -> None:
        """Megatron's rules: one of --bf16 / --fp16; --bf16 accumulates and reduces gradients in
        fp32 unless --grad-reduce-in-bf16; fp16 with dynamic loss scaling turns the NaN check
        off (a non-finite gradient is the scaler's signal to skip the step and back off)."""
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 exclude each other; give one")
        if self.grad_reduce_in_bf16:
            if not self.bf16:
                raise ConfigError("--grad-reduce-in-bf16 needs --bf16 (the gradients of fp32 / "
                                  "fp16 weights are not reduced in bf16)")
            if self.accumulate_allreduce_grads_in_fp32:
                raise ConfigError("--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32"
                                  " exclude each other; give one")
        elif self.bf16:
            self.accumulate_allreduce_grads_in_fp32 = True
        if self.loss_scale is not None and not self.loss_scale > 0:
            raise ConfigError(f"--loss-scale must be positive, got {self.loss_scale}")
        if not (self.initial_loss_scale > 0 and self.min_loss_scale > 0):
            raise ConfigError("--initial-loss-scale and --min-loss-scale must be positive")
        if self.fp16 and self.loss_scale is None:
            if self.min_loss_scale > self.initial_loss_scale:
                raise ConfigError(f"--min-loss-scale {self.min_loss_scale:g} exceeds "
                                  f"--initial-loss-scale {self.initial_loss_scale:g}")
            self.check_for_nan_in_loss_and_grad = False
        window = self.loss_scale_window
        if not (window >= 1 and float(window).is_integer()):
            raise ConfigError(f"--loss-scale-window must be a whole number of iterations >= 1, "
                              f"got {window:g}")
        if self.hysteresis < 1:
            raise ConfigError(f"--hysteresis must be >= 1, got {self.hysteresis}")

    @property
    def precision(self) -> Precision:
        """The dtypes of weights and gradient buckets these flags select."""
        params = "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"
        grads = "fp32" if params == "fp32" or self.accumulate_allreduce_grads_in_fp32 else params
        return Precision(params, grads)

    def _check_length_and_batch(self) -> None:
        """Iteration- or sample-based length, and at most one batch-size schedule (as Megatron)."""
        if self.train_iters is not None and self.train_samples is not None:
            raise ConfigError("give either --train-iters or --train-samples, not both")
        for name in ("train_iters", "train_samples"):
            if getattr(self, name) is not None:
                _positive(self, name)
        if self.rampup_batch_size is not None:
            if self.step_batch_size_schedule is not None:
                raise ConfigError("give either --rampup-batch-size or --step-batch-size-schedule, "
                                  "not both")
            if self.train_iters is not None:
                raise ConfigError("--rampup-batch-size needs sample-based training: use "
                                  "--train-samples instead of --train-iters")
            start, increment, samples = self.rampup_batch_size
            if min(start, increment, samples) <= 0:
                raise ConfigError(f"--rampup-batch-size {start} {increment} {samples} needs a "
                                  "positive start batch, increment and number of samples")
        if self.step_batch_size_schedule is not None:
            final = parse_batch_size_schedule(self.step_batch_size_schedule)[-1][1]
            if self.global_batch_size not in (None, final):
                raise ConfigError(f"--global-batch-size {self.global_batch_size} differs from "
                                  f"the last batch size {final} of --step-batch-size-schedule; "
                                  "drop --global-batch-size")
            self.global_batch_size = final

    def _check_health_and_retention(self) -> None:
        if self.save_retain_interval is not None:
            if self.save_retain_interval <= 0:
                raise ConfigError("--save-retain-interval must be a positive number of iterations")
            if self.save_interval and self.save_retain_interval % self.save_interval:
                raise ConfigError(f"--save-retain-interval {self.save_retain_interval} must be a "
                                  f"multiple of --save-interval {self.save_interval}")
        if self.most_recent_k == 0 or self.most_recent_k < -1:
            raise ConfigError("--most-recent-k must be a positive count, or -1 to keep all")
        if not self.spiky_loss_factor > 1.0:
            raise ConfigError(f"--spiky-loss-factor must be above 1, got {self.spiky_loss_factor}")
        if self.flat_line_iters < 0 or self.skip_bad_steps < 0:
            raise ConfigError("--flat-line-iters and --skip-bad-steps must be >= 0")

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step summed over DP replicas (after the layout set the batch)."""
        if self.global_batch_size is None:
            raise ValueError("global_batch_size is set from the layout at start-up")
        return self.global_batch_size // self.micro_batch_size
