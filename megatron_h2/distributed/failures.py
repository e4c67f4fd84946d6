"""Why a rank stops: its own error, or the fallout of another rank's failure.

A rank that fails on its own records that in the job's rendezvous store, prints its error and
exits; the other ranks' pending communication then fails, and each of them should say only that
it is stopping. Telling the two apart by exception type alone is not possible with gloo:
torch raises :class:`torch.distributed.DistError` subclasses for store, network and NCCL
failures, but gloo reports a peer that died (``Connection closed by peer``, ``Connection reset
by peer``) and an operation that timed out as a plain ``RuntimeError``, the type of many of a
rank's own errors too (torch 2.13, sync and async collectives and point-to-point alike). So a
plain ``RuntimeError`` counts as fallout only when another rank has recorded a failure, or when
the store itself is gone (it went down with the rank that hosted it). A rank killed outright
(SIGKILL, a crash in native code) records nothing: the ranks that talked to it report gloo's
error as their own (and record it), and the ranks after them stop quietly.

gloo's peer-loss messages (:data:`PEER_LOST`) count as fallout too, and a heartbeat names the
rank: every rank adds to its own counter in the store every :data:`BEAT_S` seconds from a thread
(:meth:`JobFailures.start_heartbeat`), so a rank that was killed or stopped (SIGSTOP, a hung
host) is the one whose counter stands still. Rank 0 watches every rank and the others watch rank
0; a rank silent for ``--heartbeat-timeout`` seconds is named in one line (rank, host, stage)
and the job ends, long before the collective timeout. A rank whose collective failed names the
silent rank the same way before it stops.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch.distributed as dist

FAILED_RANKS_KEY = "failed_ranks"
STORE_TIMEOUT = timedelta(seconds=10)
"""How long a failing or stopping rank waits on the store (it may be unreachable too)."""
BEAT_S = 1.0
"""Seconds between two heartbeats of a rank."""
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "Connection refused")
"""gloo's words for a peer that is gone (a plain RuntimeError, see above)."""


class JobFailures:
    """This rank's access to the job's failure record; inert until :meth:`attach`."""

    def __init__(self) -> None:
        self.store: dist.Store | None = None

    def attach(self, store: dist.Store | None) -> None:
        """Use ``store`` (the job's rendezvous store, None for a single process)."""
        self.store = store

    def record_own_failure(self) -> None:
        """Note that this rank failed on its own. Best effort: the store may be gone too."""
        if self.store is None:
            return
        try:
            with _native_warnings_silenced():
                self.store.set_timeout(STORE_TIMEOUT)
                self.store.add(FAILED_RANKS_KEY, 1)
        except RuntimeError:  # DistError and its subclasses are RuntimeErrors
            pass

    def another_rank_failed(self) -> bool:
        """Whether some rank recorded a failure, or the store is no longer reachable."""
        if self.store is None:
            return False
        try:
            with _native_warnings_silenced():
                self.store.set_timeout(STORE_TIMEOUT)
                return self.store.add(FAILED_RANKS_KEY, 0) > 0
        except dist.DistError:
            return True  # the rank hosting the store is gone

    def is_fallout(self, exc: BaseException) -> bool:
        """Whether ``exc`` follows from another rank's failure or a lost connection, rather
        than from this rank's own error."""
        if isinstance(exc, dist.DistError):
            return True
        if type(exc) is not RuntimeError:
            return False
        return any(words in str(exc) for words in PEER_LOST) or self.another_rank_failed()

    def start_heartbeat(self, rank: int, world_size: int, who: str, timeout_s: float,
                        on_silent: Callable[[str], None]) -> None:
        """Beat from a thread and watch the peers (rank 0: all; others: rank 0). ``who`` says
        which rank this is (``rank 3 (host h, stage 1)``); ``on_silent`` gets the one-line
        report when a watched rank has been silent for ``timeout_s`` (0: no heartbeat)."""
        if self.store is None or timeout_s <= 0:
            return
        self.store.set(f"who/{rank}", who)
        watched = [r for r in range(world_size) if r != rank] if rank == 0 else [0]
        self._beat = threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat",
                                      args=(rank, watched, timeout_s, on_silent))
        self._beat.start()

    def stop_heartbeat(self, rank: int) -> None:
        """This rank ends normally: peers stop watching it."""
        if self.store is None:
            return
        with contextlib.suppress(RuntimeError):
            self.store.set(f"done/{rank}", "1")

    def _heartbeat(self, rank: int, watched: list[int], timeout_s: float,
                   on_silent: Callable[[str], None]) -> None:
        seen: dict[int, tuple[int, float]] = {}
        try:
            while True:
                self.store.add(f"hb/{rank}", 1)
                now = time.monotonic()
                for peer in watched:
                    count = self.store.add(f"hb/{peer}", 0)
                    if seen.get(peer, (None,))[0] != count:
                        seen[peer] = (count, now)
                    elif now - seen[peer][1] > timeout_s and not self._finished(peer):
                        self.store.set("lost", str(peer))  # the others name it too
                        on_silent(f"{self.describe(peer)} stopped responding: no heartbeat "
                                  f"for {now - seen[peer][1]:.0f} s (--heartbeat-timeout "
                                  f"{timeout_s:g}); stopping the job: restart it from the last "
                                  "checkpoint once that rank's host is healthy")
                        return
                time.sleep(BEAT_S)
        except RuntimeError:
            return  # the store is gone: the collectives report that

    def _finished(self, rank: int) -> bool:
        return self.store.check([f"done/{rank}"]) or self.store.add(FAILED_RANKS_KEY, 0) > 0

    def describe(self, rank: int) -> str:
        """``rank 3 (host h, stage 1)`` as that rank registered itself."""
        try:
            if self.store is not None and self.store.check([f"who/{rank}"]):
                return self.store.get(f"who/{rank}").decode()
        except RuntimeError:
            pass
        return f"rank {rank}"

    def silent_peers(self, rank: int, world_size: int, watch_s: float = 3 * BEAT_S) -> list[int]:
        """The rank a heartbeat watcher found silent, else the ranks whose heartbeat stood still
        for ``watch_s`` seconds (not finished ones): the lost ones, for this rank's stop line.
        Empty when the store is unreachable."""
        if self.store is None:
            return []
        try:
            with _native_warnings_silenced():
                self.store.set_timeout(STORE_TIMEOUT)
                if self.store.check(["lost"]):
                    return [int(self.store.get("lost"))]
                peers = [r for r in range(world_size) if r != rank]
                before = {r: self.store.add(f"hb/{r}", 0) for r in peers}
                time.sleep(watch_s)
                return [r for r in peers if self.store.add(f"hb/{r}", 0) == before[r]
                        and not self.store.check([f"done/{r}"])]
        except RuntimeError:
            return []


@contextlib.contextmanager
def _native_warnings_silenced() -> Iterator[None]:
    """Hide what native code writes to stderr meanwhile: a store whose host is gone makes torch
    log a warning with a native stack trace before it raises :class:`~torch.distributed.DistError`,
    and a stopping rank should print one line."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
