"""Build a shared artefact once when several processes want it at the same time.

Every rank of a job, or several jobs sharing a cache folder, may ask for the same corpus or
index cache at once. :func:`build_once` lets the first one build it while holding a file lock
(``filelock.FileLock``: ``flock`` on the lock file); the others wait for the lock and then find
the finished artefact. A builder that crashes or is killed cannot leave the others waiting
forever: the operating system drops a dead process's ``flock``, and on file systems without
``flock`` filelock falls back to a lock file that names its owner and is broken once that owner
is gone. The lock file itself stays (waiters must share its inode); it holds nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from filelock import FileLock, Timeout

REPORT_EVERY_S = 30.0
"""A waiting process says so this often."""


def build_once(lock_path: str, ready: Callable[[], bool], build: Callable[[], None], what: str,
               say: Callable[[str], None] = print,
               report_every_s: float = REPORT_EVERY_S) -> bool:
    """Run ``build`` unless ``ready()``; at most one process at a time per ``lock_path``.

    ``ready`` is checked before taking the lock and again once it is held, so a process that
    waited while another built returns without building. Returns whether this call built.
    The folder of ``lock_path`` must exist (OSError otherwise).
    """
    if ready():
        return False
    lock = FileLock(lock_path)
    waited = 0.0
    while True:
        try:
            lock.acquire(timeout=report_every_s, poll_interval=0.1)
            break
        except Timeout:
            waited += report_every_s
            say(f"waiting for another process to finish building {what} ({waited:.0f} s so far;"
                f" lock {lock_path})")
    try:
        if ready():
            return False
        build()
        return True
    finally:
        lock.release()
