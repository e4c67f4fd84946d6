"""Loss scaling for fp16 training, with Megatron-LM's semantics (not ``torch.amp.GradScaler``'s).

The loss is multiplied by the scale before backward, the gradients are divided by it before the
update, and a step whose gradients hold an Inf or NaN is skipped without an update. Which scaler
a run gets follows Megatron's ``get_megatron_optimizer``: ``--loss-scale`` gives a constant scale
(with ``--fp16``, ``--bf16`` or the distributed optimizer), ``--fp16`` without it the dynamic
scaler, anything else none.

:class:`DynamicGradScaler` differs from torch's in its hysteresis: an overflow lowers the scale
(by ``backoff``, not below ``min_scale``) only once ``hysteresis`` overflows have been seen since
the scale last grew, and from then on every further overflow lowers it at once until the scale
grows again (the hysteresis count is reset only when the scale grows). The scale grows (by
``growth``) after ``window`` iterations in a row without an overflow; an overflow restarts that
count. Skipped steps do not advance the learning-rate schedule (Megatron steps it only after a
successful update) but count as iterations and consume their samples.

The scale is kept as a Python float: it is a power of two times the initial scale, exactly
representable, and every rank holds the same value because the overflow verdict is reduced over
the whole job before :meth:`update`.
"""

from __future__ import annotations

from typing import Any

from megatron_h2.config import TrainingConfig
from megatron_h2.errors import ConfigError

GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
"""Megatron's fixed factors of the dynamic scale."""


class ConstantGradScaler:
    """``--loss-scale``: the same scale every step (overflowing steps are still skipped)."""

    dynamic = False

    def __init__(self, scale: float) -> None:
        if not scale > 0:
            raise ValueError(f"loss scale must be positive, got {scale}")
        self.scale = float(scale)

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """Nothing changes."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the scale is the command line's."""


class DynamicGradScaler:
    """The scale that grows after ``window`` clean iterations and backs off on overflows (see
    the module docstring for the hysteresis rule)."""

    dynamic = True

    def __init__(self, initial_scale: float, min_scale: float, window: int, hysteresis: int,
                 growth: float = GROWTH_FACTOR, backoff: float = BACKOFF_FACTOR) -> None:
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"need 0 < min_scale {min_scale} <= initial_scale {initial_scale}")
        if not (growth > 1.0 and 0.0 < backoff < 1.0 and window > 0 and hysteresis > 0):
            raise ValueError("need growth > 1, 0 < backoff < 1, window > 0 and hysteresis > 0")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth, self.backoff = growth, backoff
        self.window, self.hysteresis = int(window), int(hysteresis)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        """After each step, with the job-wide overflow verdict of its gradients."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.window:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state for checkpoints."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            scale = float(state["scale"])
            growth, hysteresis = int(state["growth_tracker"]), int(state["hysteresis_tracker"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"checkpoint loss-scaler state {state!r} is not valid; load with "
                              "--no-load-optim to start the scale afresh") from None
        if not scale > 0:
            raise ConfigError(f"checkpoint loss scale {scale} is not positive; load with "
                              "--no-load-optim to start the scale afresh")
        self.scale, self.growth_tracker, self.hysteresis_tracker = scale, growth, hysteresis


GradScaler = ConstantGradScaler | DynamicGradScaler


def build_grad_scaler(training: TrainingConfig,
                      distributed_optimizer: bool) -> GradScaler | None:
    """The scaler Megatron builds for these flags (None: the loss is not scaled)."""
    if training.loss_scale is not None:
        if training.fp16 or training.bf16 or distributed_optimizer:
            return ConstantGradScaler(training.loss_scale)
        return None  # Megatron's fp32 optimizer has no scaler: the flag has no effect
    if training.fp16:
        return DynamicGradScaler(training.initial_loss_scale, training.min_loss_scale,
                                 int(training.loss_scale_window), training.hysteresis)
    return None
