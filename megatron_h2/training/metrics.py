"""Progress reporting: Megatron-style log lines, a JSON-lines file and TensorBoard scalars."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def log(message: str) -> None:
    """One progress line on stdout, flushed so that launchers show it at once."""
    print(f"[{_now()}] {message}", flush=True)


class MetricsWriter:
    """Writes each logged iteration to the console, ``--log-jsonl`` and ``--tensorboard-dir``."""

    def __init__(self, train_iters: int, jsonl_path: str | None = None,
                 tensorboard_dir: str | None = None, enabled: bool = True) -> None:
        """``enabled`` is False on every rank but the one that reports."""
        self.train_iters = train_iters
        self.enabled = enabled
        self.jsonl_path = Path(jsonl_path) if jsonl_path and enabled else None
        if self.jsonl_path:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        self.tb = None
        if tensorboard_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is heavy

            self.tb = SummaryWriter(log_dir=tensorboard_dir, max_queue=100)

    def train_step(self, record: dict[str, Any]) -> None:
        """``record`` holds iteration, consumed_samples, lr, lm_loss, grad_norm, iteration_ms,
        tokens_per_sec, tflops, global_batch_size and optionally extra keys."""
        if not self.enabled:
            return
        it = record["iteration"]
        line = (f"iteration {it:8d}/{self.train_iters:8d} | "
                f"consumed samples: {record['consumed_samples']:12d} | "
                f"elapsed time per iteration (ms): {record['iteration_ms']:.1f} | "
                f"throughput (tokens/s): {record['tokens_per_sec']:.0f} | "
                f"model TFLOP/s: {record['tflops']:.3f} | "
                f"learning rate: {record['lr']:.6E} | "
                f"global batch size: {record['global_batch_size']:5d} | "
                f"lm loss: {record['lm_loss']:.6E} | "
                f"grad norm: {record['grad_norm']:.3f} |")
        if "loss_scale" in record:
            line += f" loss scale: {record['loss_scale']:.1f} |"
        if record.get("skipped_iterations"):
            line += f" number of skipped iterations: {record['skipped_iterations']:3d} |"
        log(line)
        self._write_jsonl(record)
        if self.tb:
            for key in ("lm_loss", "lr", "grad_norm", "tokens_per_sec", "iteration_ms", "tflops",
                        "loss_scale"):
                if key in record:
                    self.tb.add_scalar(f"train/{key}", record[key], it)

    def validation(self, iteration: int, val_loss: float) -> None:
        if not self.enabled:
            return
        ppl = _perplexity(val_loss)
        log(f"validation loss at iteration {iteration} | lm loss value: {val_loss:.6E} | "
            f"lm loss PPL: {ppl:.6E} |")
        if self.tb:
            self.tb.add_scalar("validation/lm_loss", val_loss, iteration)

    def _write_jsonl(self, record: dict[str, Any]) -> None:
        if self.jsonl_path:
            with open(self.jsonl_path, "a") as fh:
                fh.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.tb:
            self.tb.flush()
            self.tb.close()


def _perplexity(loss: float) -> float:
    import math

    return math.exp(min(20.0, loss))
