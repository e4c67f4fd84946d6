"""Workers never outlive their launcher.

A worker started by torchrun (or by the elastic launcher) watches its parent process. When the
parent disappears (``kill -9`` of the agent, a crashed launcher), the worker is re-parented and
the watchdog notices within a second: it asks the training loop to save and stop, exactly as
Ctrl-C (SIGINT) does (every rank is orphaned at once and the ranks agree on the stopping
iteration, so the checkpoint is complete), and ends the process outright if that has not
happened within a grace period (a peer may be gone too). Polling ``getppid`` works on every
POSIX system and, unlike Linux's parent-death signal, is not fooled by the exit of the thread
that started us.

The other direction: a launcher that is told to stop (SIGTERM from the user or SLURM) forwards
the signal to its workers and must then say whether every worker saved. Each worker that ends
normally marks that in the folder ``$MEGATRON_H2_STOPPED_DIR`` the launcher gave it
(:func:`mark_stopped`); the launcher counts the marks (:func:`stopped_local_ranks`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "MEGATRON_H2_WATCH_PARENT")
"""Set in a worker's environment by torchrun / by callers that want the watchdog."""
STOPPED_ENV = "MEGATRON_H2_STOPPED_DIR"
"""Folder where workers mark a normal end (set by our launchers)."""


def mark_stopped(local_rank: int) -> None:
    """This worker ended normally (trained to the end, or saved and stopped on a signal)."""
    folder = os.environ.get(STOPPED_ENV)
    if folder:
        try:
            Path(folder, f"{local_rank}.stopped").touch()
        except OSError:
            pass  # the launcher is gone with its folder: nobody to tell


def stopped_local_ranks(folder: str | os.PathLike) -> list[int]:
    """Local ranks that marked a normal end in ``folder``."""
    names = (p.name.removesuffix(".stopped") for p in Path(folder).glob("*.stopped"))
    return sorted(int(n) for n in names if n.isdigit())


def _watch(parent: int, poll_s: float, grace_s: float, log) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    log(f"the launcher (pid {parent}) is gone: saving and stopping (pid {os.getpid()} ends "
        f"within {grace_s:.0f} s at the latest)")
    os.kill(os.getpid(), signal.SIGINT)  # the training loop's save-and-stop request
    time.sleep(grace_s)
    os._exit(1)


def start_orphan_watchdog(log, grace_s: float = 660.0, poll_s: float = 0.5,
                          ) -> threading.Thread | None:
    """Start watching the parent when a launcher started this process; returns the thread.

    ``grace_s``: how long a save-and-stop may take before the process is ended (default: the
    default distributed timeout plus a minute).
    """
    if not any(os.environ.get(name) for name in LAUNCHER_ENV):
        return None
    thread = threading.Thread(target=_watch, args=(os.getppid(), poll_s, grace_s, log),
                              name="orphan-watchdog", daemon=True)
    thread.start()
    return thread
