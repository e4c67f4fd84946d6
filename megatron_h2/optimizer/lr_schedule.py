"""The learning-rate schedule: linear warm-up, then cosine / linear / constant decay."""

from __future__ import annotations

import math

import torch

from megatron_h2.config import OptimizerConfig
from megatron_h2.errors import ConfigError


class LRSchedule:
    """Linear warm-up to ``lr``, then cosine / linear / constant decay to ``min_lr``.

    ``lr_at(it)`` gives the rate used by iteration ``it`` (1-based), so the first step already
    moves the weights.
    """

    def __init__(self, config: OptimizerConfig, train_iters: int) -> None:
        self.config = config
        self.decay_iters = config.lr_decay_iters or train_iters
        if self.decay_iters < config.lr_warmup_iters:
            raise ConfigError(f"--lr-warmup-iters {config.lr_warmup_iters} exceeds the decay "
                              f"length {self.decay_iters} (--lr-decay-iters or --train-iters)")

    def lr_at(self, iteration: int) -> float:
        c = self.config
        if c.lr_warmup_iters > 0 and iteration <= c.lr_warmup_iters:
            return c.lr * iteration / c.lr_warmup_iters
        if c.lr_decay_style == "constant":
            return c.lr
        if iteration >= self.decay_iters:
            return c.min_lr
        ratio = (iteration - c.lr_warmup_iters) / max(1, self.decay_iters - c.lr_warmup_iters)
        if c.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        else:  # cosine
            coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
        return c.min_lr + coeff * (c.lr - c.min_lr)

    def apply(self, optimizer: torch.optim.Optimizer, iteration: int) -> float:
        lr = self.lr_at(iteration)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
