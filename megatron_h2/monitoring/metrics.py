"""Progress reporting: Megatron-style log lines, a JSON-lines file, TensorBoard scalars and
Weights & Biases.

Messages go through Python logging (logger ``megatron_h2``, level ``--logging-level``, default
info); the iteration and validation lines are printed whatever the level, as Megatron prints
them. TensorBoard and Weights & Biases get the same scalars.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
from pathlib import Path
from typing import Any

from megatron_h2.config import LoggingConfig
from megatron_h2.errors import ConfigError

LOGGER = "megatron_h2"


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


class _Stdout(logging.Handler):
    """Prints to the current ``sys.stdout`` (which tests and launchers may swap)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), flush=True)


def configure_logging(level: int | None = None) -> None:
    """megatron_h2's messages at ``level`` (default info) on stdout; a given ``level`` is also
    the root logger's, so libraries' messages follow it (Megatron's ``--logging-level``)."""
    logger = logging.getLogger(LOGGER)
    if not any(isinstance(h, _Stdout) for h in logger.handlers):
        handler = _Stdout()
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s",
                                               "%Y-%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if level is None else level)
    if level is not None:
        logging.getLogger().setLevel(level)


def log(message: str) -> None:
    """One progress message (info level), flushed so that launchers show it at once."""
    logger = logging.getLogger(LOGGER)
    if not logger.handlers:
        configure_logging()
    logger.info(message)


def print_line(message: str) -> None:
    """An iteration or validation line: printed at every logging level."""
    print(f"[{_now()}] {message}", flush=True)


def check_wandb(cfg: LoggingConfig) -> None:
    """``--wandb-project`` needs the wandb package (checked before any process group)."""
    if not cfg.wandb:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError("--wandb-project needs the wandb package, which is not installed: "
                          "pip install wandb (or pip install 'megatron_h2[wandb]'), or drop the "
                          "--wandb-* flags") from None


def memory_scalars(stats: dict[str, float]) -> dict[str, float]:
    """Megatron's memory scalars in bytes from an accelerator's ``memory_stats()`` (GiB);
    on the CPU, which has none, the process's resident memory now and at its peak."""
    gib = 1024**3
    if stats:
        return {"mem-allocated-bytes": stats["allocated_gib"] * gib,
                "mem-reserved-bytes": stats["reserved_gib"] * gib,
                "mem-max-allocated-bytes": stats["peak_gib"] * gib}
    with open("/proc/self/statm") as fh:
        resident = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"mem-rss-bytes": float(resident), "mem-max-rss-bytes": float(peak)}


class MetricsWriter:
    """Writes each logged iteration to the console, ``--log-jsonl``, ``--tensorboard-dir`` and
    Weights & Biases (``--wandb-project``)."""

    def __init__(self, train_iters: int, jsonl_path: str | None = None,
                 tensorboard_dir: str | None = None, enabled: bool = True,
                 logging_cfg: LoggingConfig | None = None, save_dir: str | None = None,
                 run_config: dict[str, Any] | None = None) -> None:
        """``enabled`` is False on every rank but the one that reports."""
        self.train_iters = train_iters
        self.enabled = enabled
        self.cfg = logging_cfg or LoggingConfig()
        self.jsonl_path = Path(jsonl_path) if jsonl_path and enabled else None
        if self.jsonl_path:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        self.tb = None
        if tensorboard_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is heavy

            self.tb = SummaryWriter(log_dir=tensorboard_dir,
                                    max_queue=self.cfg.tensorboard_queue_size)
        self.wandb = None
        if self.cfg.wandb and enabled:
            import wandb

            folder = self.cfg.wandb_save_dir or str(Path(save_dir or ".") / "wandb")
            Path(folder).mkdir(parents=True, exist_ok=True)
            self.wandb = wandb.init(project=self.cfg.wandb_project, name=self.cfg.wandb_exp_name,
                                    entity=self.cfg.wandb_entity, dir=folder,
                                    config=run_config or {})

    def scalars(self, iteration: int, values: dict[str, float], prefix: str = "train/") -> None:
        """``values`` to TensorBoard (``prefix`` + name) and Weights & Biases at ``iteration``."""
        if not self.enabled:
            return
        if self.tb:
            for key, value in values.items():
                self.tb.add_scalar(prefix + key, value, iteration)
        if self.wandb is not None:
            self.wandb.log({prefix + key: value for key, value in values.items()},
                           step=iteration)

    def train_step(self, record: dict[str, Any]) -> None:
        """``record`` holds iteration, consumed_samples, lr, lm_loss, grad_norm, iteration_ms,
        tokens_per_sec, tflops, global_batch_size and optionally throughput_per_gpu_tflops,
        num_zeros, params_norm, loss_scale, skipped_iterations, moe_losses (a MoE model's aux
        and z losses by Megatron's names, shown after the loss) and extra keys."""
        if not self.enabled:
            return
        it = record["iteration"]
        line = (f"iteration {it:8d}/{self.train_iters:8d} | "
                f"consumed samples: {record['consumed_samples']:12d} | "
                f"elapsed time per iteration (ms): {record['iteration_ms']:.1f} | ")
        if "throughput_per_gpu_tflops" in record:
            per_gpu = record["throughput_per_gpu_tflops"]
            line += f"throughput per GPU (TFLOP/s/GPU): {per_gpu:.1f} | "
        line += (f"throughput (tokens/s): {record['tokens_per_sec']:.0f} | "
                 f"model TFLOP/s: {record['tflops']:.3f} | "
                 f"learning rate: {record['lr']:.6E} | "
                 f"global batch size: {record['global_batch_size']:5d} | "
                 f"lm loss: {record['lm_loss']:.6E} |")
        for name, value in record.get("moe_losses", {}).items():  # Megatron's MoE figures
            line += f" {name}: {value:.2f} |"
        line += f" grad norm: {record['grad_norm']:.3f} |"
        if record.get("num_zeros") is not None:
            line += f" num zeros: {record['num_zeros']:.1f} |"
        if record.get("params_norm") is not None:
            line += f" params norm: {record['params_norm']:.3f} |"
        if "loss_scale" in record:
            line += f" loss scale: {record['loss_scale']:.1f} |"
        if record.get("skipped_iterations"):
            line += f" number of skipped iterations: {record['skipped_iterations']:3d} |"
        print_line(line)
        self._write_jsonl(record)

    def validation(self, iteration: int, val_loss: float) -> None:
        if not self.enabled:
            return
        ppl = _perplexity(val_loss)
        print_line(f"validation loss at iteration {iteration} | lm loss value: {val_loss:.6E} | "
                   f"lm loss PPL: {ppl:.6E} |")
        values = {"lm_loss": val_loss}
        if self.cfg.log_validation_ppl_to_tensorboard:
            values["lm_loss_ppl"] = ppl
        self.scalars(iteration, values, prefix="validation/")

    def _write_jsonl(self, record: dict[str, Any]) -> None:
        """One JSON object per row, with ``time``: Unix seconds when it was written (for an
        iteration, its end), so runs side by side can be aligned."""
        if self.jsonl_path:
            with open(self.jsonl_path, "a") as fh:
                fh.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")

    def close(self) -> None:
        if self.tb:
            self.tb.flush()
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _perplexity(loss: float) -> float:
    return math.exp(min(20.0, loss))
