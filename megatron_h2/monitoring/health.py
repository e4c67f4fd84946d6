"""Numerical health of a run: every step is judged before its optimizer update.

A step is *bad* when (checks after Megatron's ``--check-for-nan-in-loss-and-grad`` and
``--check-for-spiky-loss``, whose rerun state machine is the model here):

* its loss or gradient norm is NaN or Inf (on by default; ``--no-check-for-nan-in-loss-and-grad``
  turns it off);
* ``--check-for-spiky-loss``: its loss is above ``--spiky-loss-factor`` (default 10) times the
  median of the last accepted losses; until 5 losses are known (a fresh run, or a checkpoint
  saved before the history was kept) above the factor times ln(vocabulary), the loss of uniform
  predictions, which no sane step exceeds by that much;
* the run has flat-lined: for ``--flat-line-iters`` (default 5) iterations in a row the gradient
  norm was zero or the loss sat at ln(vocabulary), the loss of uniform predictions (a diverged
  model that saturated).

A bad step is skipped (no update; its batch counts as consumed, as Megatron counts skipped
iterations) while ``--skip-bad-steps`` allows, otherwise training stops with one line that names
the last good checkpoint. A state with a flat-line streak under way is *suspect*: no checkpoint is
written from it, so a stalled run never overwrites its good checkpoints.

The monitor's history (accepted losses, flat-line streak, skip counts) is training state: it is
saved in every checkpoint (:meth:`HealthMonitor.state_dict`) and restored on resume, so the first
iteration after a resume is judged as the run before would have judged it.

Every figure judged here (loss, gradient norm) is reduced over the whole job first, so every
rank reaches the same verdict at the same iteration without further communication.

Fault injection (drills and tests; see docs/faults.md): ``$MEGATRON_H2_INJECT_NUMERIC`` =
``ITER:nan-loss``, ``ITER:nan-grad`` or ``ITER:spike[:FACTOR]`` replaces what the check sees at
iteration ``ITER`` (a NaN loss, a NaN gradient norm, the loss times FACTOR, default 100).

Hook for fp16 loss scaling: a loss scaler that skips a step on overflow calls
:meth:`HealthMonitor.count_overflow_skip`; the step counts in ``skipped_iterations`` (logged every
log interval) and gets one log line, and it does not use the ``--skip-bad-steps`` budget.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from collections.abc import Callable
from typing import Any

from megatron_h2.config import TrainingConfig
from megatron_h2.errors import ConfigError, TrainingError

SPIKE_WINDOW = 50
"""Accepted losses that the running median is taken over."""
SPIKE_MIN_HISTORY = 5
"""Losses needed before a spike can be called."""
FLAT_GRAD_NORM = 1e-8
"""A gradient norm at or below this counts as zero."""
FLAT_LOSS_TOLERANCE = 1e-3
"""A loss within this (nats) of ln(vocabulary) counts as uniform predictions."""


NUMERIC_FAULT_ENV = "MEGATRON_H2_INJECT_NUMERIC"
NUMERIC_FAULTS = ("nan-loss", "nan-grad", "spike")


class JobTrainingError(TrainingError):
    """Training stops on every rank alike (the verdict uses job-wide figures); rank 0 reports."""


def injected_numeric_fault() -> tuple[int, str, float] | None:
    """``(iteration, kind, factor)`` from ``$MEGATRON_H2_INJECT_NUMERIC`` (``ITER:KIND[:FACTOR]``,
    KIND one of nan-loss, nan-grad, spike), None when unset; a malformed value is a ConfigError."""
    value = os.environ.get(NUMERIC_FAULT_ENV, "").strip()
    if not value:
        return None
    parts = value.split(":")
    try:
        iteration, kind = int(parts[0]), parts[1]
        factor = float(parts[2]) if len(parts) > 2 else 100.0
        if kind not in NUMERIC_FAULTS or iteration < 1 or len(parts) > 3 or not factor > 0:
            raise ValueError(value)
    except (ValueError, IndexError):
        raise ConfigError(f"${NUMERIC_FAULT_ENV}={value!r} should be ITER:KIND[:FACTOR] with KIND "
                          f"one of {', '.join(NUMERIC_FAULTS)}, such as 12:nan-loss") from None
    return iteration, kind, factor


class HealthMonitor:
    """Judges every step (``__call__``), counts skips and says whether a save would be safe.

    Args:
        cfg: the training config (health flags).
        vocab_sizes: vocabulary sizes whose ln marks a flat-lined loss (the tokenizer's and the
            padded one: a saturated model predicts uniformly over either).
        log: where to write one-line notices.
        last_good: given the bad iteration, returns a phrase naming the last good checkpoint and
            how to resume from it, for the stop message.
    """

    def __init__(self, cfg: TrainingConfig, vocab_sizes: tuple[int, ...], log,
                 last_good: Callable[[int], str]) -> None:
        self.cfg, self.log, self.last_good = cfg, log, last_good
        self.uniform_losses = sorted({math.log(v) for v in vocab_sizes if v and v > 1})
        self.recent: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self.flat_streak = 0
        self.flat_why = ""
        self.skipped = 0
        self.overflow_skipped = 0
        self.fault = injected_numeric_fault()

    def state_dict(self) -> dict[str, Any]:
        """What the verdicts depend on, JSON-ready (saved in every checkpoint)."""
        return {"recent": list(self.recent), "flat_streak": self.flat_streak,
                "flat_why": self.flat_why, "skipped": self.skipped,
                "overflow_skipped": self.overflow_skipped}

    def load_state_dict(self, state: Any, where: str) -> None:
        """Restore :meth:`state_dict` from the checkpoint ``where`` (one-line ConfigError if it
        is damaged)."""
        try:
            recent = [float(x) for x in state["recent"]]
            counts = [state[k] for k in ("flat_streak", "skipped", "overflow_skipped")]
            if (not all(math.isfinite(x) for x in recent) or len(recent) > SPIKE_WINDOW
                    or any(isinstance(c, bool) or not isinstance(c, int) or c < 0
                           for c in counts) or not isinstance(state["flat_why"], str)):
                raise ValueError(state)
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"checkpoint {where} has a damaged 'health' entry in its metadata; "
                              "load another iteration") from None
        self.recent = deque(recent, maxlen=SPIKE_WINDOW)
        self.flat_streak, self.skipped, self.overflow_skipped = counts
        self.flat_why = state["flat_why"]

    @property
    def skipped_iterations(self) -> int:
        """Steps that did not update the model: bad steps skipped plus fp16 overflows."""
        return self.skipped + self.overflow_skipped

    @property
    def suspect(self) -> bool:
        """True while a flat-line streak is under way: do not checkpoint this state."""
        return self.flat_streak > 0

    def _flat(self, loss: float, grad_norm: float) -> str | None:
        if grad_norm <= FLAT_GRAD_NORM:
            return f"grad norm {grad_norm:.3g}"
        for uniform in self.uniform_losses:
            if abs(loss - uniform) < FLAT_LOSS_TOLERANCE:
                return f"loss {loss:.6f} = ln({round(math.exp(uniform))}), uniform predictions"
        return None

    def _spike(self, loss: float) -> str | None:
        factor = self.cfg.spiky_loss_factor
        if len(self.recent) >= SPIKE_MIN_HISTORY:
            median = statistics.median(self.recent)
            if median > 0 and loss > factor * median:
                return (f"loss {loss:.4g} is {loss / median:.1f}x the running median "
                        f"{median:.4g} (spike; --spiky-loss-factor {factor:g})")
            return None
        if self.uniform_losses:  # no history yet: against uniform predictions' loss
            bound = factor * self.uniform_losses[-1]
            if loss > bound:
                return (f"loss {loss:.4g} is above {factor:g} x ln(vocabulary) = {bound:.4g}, the "
                        f"bound until {SPIKE_MIN_HISTORY} losses are known (spike; "
                        f"--spiky-loss-factor {factor:g})")
        return None

    def _inject(self, iteration: int, loss: float, grad_norm: float) -> tuple[float, float]:
        if self.fault is None or self.fault[0] != iteration:
            return loss, grad_norm
        kind, factor = self.fault[1], self.fault[2]
        self.log(f"iteration {iteration}: injecting {kind} (${NUMERIC_FAULT_ENV})")
        if kind == "nan-loss":
            return float("nan"), grad_norm
        if kind == "nan-grad":
            return loss, float("nan")
        return loss * factor, grad_norm

    def judge(self, loss: float, grad_norm: float) -> str | None:
        """Why this step is bad, or None (updates the flat-line streak)."""
        cfg = self.cfg
        if cfg.check_for_nan_in_loss_and_grad and not (math.isfinite(loss)
                                                       and math.isfinite(grad_norm)):
            return f"loss {loss} / grad norm {grad_norm} is not finite"
        if cfg.check_for_spiky_loss:
            spike = self._spike(loss)
            if spike:
                return spike
        flat = self._flat(loss, grad_norm) if cfg.flat_line_iters else None
        self.flat_streak = self.flat_streak + 1 if flat else 0
        self.flat_why = flat or ""
        if flat and self.flat_streak >= cfg.flat_line_iters:
            return f"the run has flat-lined ({flat} for {self.flat_streak} iterations)"
        return None

    def __call__(self, iteration: int, loss: float, grad_norm: float) -> bool:
        """True: apply this step's update. False: skip it. Raises JobTrainingError to stop."""
        loss, grad_norm = self._inject(iteration, loss, grad_norm)
        reason = self.judge(loss, grad_norm)
        if reason is None:
            if math.isfinite(loss):
                self.recent.append(loss)
            return True
        budget = self.cfg.skip_bad_steps
        if self.skipped < budget:
            self.skipped += 1
            self.log(f"iteration {iteration}: {reason}; skipping this step without an update "
                     f"({self.skipped} of --skip-bad-steps {budget} used)")
            return False
        used = f"{self.skipped} bad steps already skipped; " if budget else ""
        raise JobTrainingError(f"{reason} at iteration {iteration}; {used}stopping. The last "
                               f"good checkpoint is {self.last_good(iteration)} (or allow "
                               "--skip-bad-steps)")

    def count_overflow_skip(self, iteration: int, loss_scale: float) -> None:
        """For fp16 loss scaling: the scaler skipped this step on an overflow."""
        self.overflow_skipped += 1
        self.log(f"iteration {iteration}: fp16 gradient overflow at loss scale {loss_scale:g}; "
                 f"step skipped ({self.overflow_skipped} overflow skips so far)")
