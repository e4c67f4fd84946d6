"""The process table as /proc shows it (Linux), for tests that watch a launcher's workers."""

from __future__ import annotations

from pathlib import Path


def process_table() -> dict[int, tuple[str, int]]:
    """``{pid: (state, parent pid)}`` of every process (state as in /proc: R, S, T, Z, ...)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the process ended while the table was read
                continue
            table[int(entry.name)] = (fields[0], int(fields[1]))
    return table
