"""Verified-good checkpoints: which checkpoint a stopped run recommends, and where ``latest``
points after a stop.

A checkpoint of iteration ``k`` holds the weights after ``k``'s update; a bad update shows only in
iteration ``k + 1`` (its loss or gradient is NaN, a spike, or the flat-line pattern of saturated
weights). So a checkpoint is *good* only once the iteration after it passed the health checks,
and it is written only when its weights are finite and their norm is within
:data:`WEIGHT_GROWTH` times that of the last good state (the state loaded, or the start). When
training stops on a bad iteration, the checkpoints this run wrote that were not verified are set
aside as ``iter_*.unverified`` and ``latest`` goes back to the newest good one, which the stop
message names with the command to resume from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from megatron_h2.checkpointing.format import set_aside

WEIGHT_GROWTH = 100.0
"""A state whose weights' L2 norm exceeds this multiple of the last good one's is not saved."""


@dataclass
class _Saved:
    where: str
    norm: float
    committed: bool
    clean: bool | None = None  # did the next iteration pass the checks?


class GoodCheckpoints:
    """Tracks the checkpoints of this run until the iteration after each is judged.

    Args:
        loaded: ``(directory, iteration)`` of the checkpoint the run resumed from, or None.
        norm: the weights' norm at the start (the reference for :meth:`weights_problem`).
        rank: this process's rank (rank 0 moves files).
        log: where to write one-line notices.
    """

    def __init__(self, loaded: tuple[str, int] | None, norm: float, rank: int,
                 log: Callable[[str], None]) -> None:
        self.last_good, self.good_norm, self.rank, self.log = loaded, norm, rank, log
        self.saved: dict[int, _Saved] = {}
        self.rejected: list[tuple[str, int]] = []

    def protected(self, save_dir: str) -> int | None:
        """The iteration in ``save_dir`` that retention must keep: the newest good one."""
        if self.last_good is not None and self.last_good[0] == save_dir:
            return self.last_good[1]
        return None

    def weights_problem(self, norm: float) -> str | None:
        """Why a state with weights of L2 norm ``norm`` must not be saved (None: it may)."""
        if not math.isfinite(norm):
            return f"the weights' norm is {norm}"
        if self.good_norm > 0 and norm > WEIGHT_GROWTH * self.good_norm:
            return (f"the weights' norm {norm:.4g} is {norm / self.good_norm:.3g}x that of the "
                    f"last good state ({self.good_norm:.4g}; the bound is {WEIGHT_GROWTH:g}x)")
        return None

    def on_save(self, where: str, iteration: int, norm: float, committed: bool) -> None:
        """A save of ``iteration`` began (``committed``: and finished, as a synchronous one)."""
        self.saved[iteration] = _Saved(where, norm, committed)
        self._settle()

    def on_commit(self, iteration: int) -> None:
        """The background save of ``iteration`` was committed."""
        if iteration in self.saved:
            self.saved[iteration].committed = True
        self._settle()

    def on_step(self, iteration: int, clean: bool) -> None:
        """Iteration ``iteration`` was judged: ``clean`` if it passed every check."""
        entry = self.saved.get(iteration - 1)
        if entry is not None and entry.clean is None:
            entry.clean = clean
        self._settle()

    def _settle(self) -> None:
        for iteration in sorted(self.saved):
            entry = self.saved[iteration]
            if not entry.committed or entry.clean is None:
                continue
            del self.saved[iteration]
            if entry.clean:
                self.last_good, self.good_norm = (entry.where, iteration), entry.norm
                self.rejected = [r for r in self.rejected if r[1] > iteration]
            else:
                self.rejected.append((entry.where, iteration))

    def _unverified(self) -> list[tuple[str, int]]:
        """Committed checkpoints of this run newer than the last good one."""
        newest = self.last_good[1] if self.last_good else -1
        found = self.rejected + [(e.where, it) for it, e in self.saved.items() if e.committed]
        return sorted((w, it) for w, it in found if it > newest)

    def describe(self, bad_iteration: int) -> str:
        """The stop message's phrase: the newest good checkpoint and how to resume from it."""
        unverified = self._unverified()
        aside = ""
        if unverified:
            names = ", ".join(str(it) for _, it in unverified)
            aside = (f" (iteration(s) {names}, saved before iteration {bad_iteration} revealed "
                     "the bad state, set aside as iter_*.unverified)")
        if self.last_good is None:
            return ("none: this run started from scratch and no checkpoint of it was followed "
                    f"by a good iteration{aside}; start again with a lower --lr")
        where, it = self.last_good
        return (f"iteration {it} in {where}{aside}; resume from it with --load {where} "
                f"--ckpt-step {it} --override-opt_param-scheduler and a lower --lr")

    def on_stop(self, save_dir: str | None) -> None:
        """Training stopped on a bad iteration: set this run's unverified checkpoints aside and
        point ``latest`` at the newest good one (rank 0; the others have nothing to do)."""
        if self.rank != 0 or not save_dir:
            return
        mine = [it for where, it in self._unverified() if where == save_dir]
        if not mine:
            return
        keep = self.last_good[1] if self.last_good and self.last_good[0] == save_dir else None
        moved = set_aside(save_dir, mine, keep)
        self.log(f"set aside unverified checkpoint(s) {', '.join(moved)} in {save_dir}; latest "
                 f"is now {keep if keep is not None else 'the newest checkpoint left, if any'}")
