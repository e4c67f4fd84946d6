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
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

FAILED_RANKS_KEY = "failed_ranks"
STORE_TIMEOUT = timedelta(seconds=10)
"""How long a failing or stopping rank waits on the store (it may be unreachable too)."""


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
        return type(exc) is RuntimeError and self.another_rank_failed()


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
