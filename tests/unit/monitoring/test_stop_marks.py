"""Workers mark a normal end for their launcher, which decides a stop by signal from the marks
(``megatron_h2.commands.torchrun``, the elastic launcher)."""

from __future__ import annotations

from megatron_h2.commands.torchrun import signal_verdict
from megatron_h2.monitoring.watchdog import STOPPED_ENV, mark_stopped, stopped_local_ranks


def test_marks_are_counted_per_local_rank(tmp_path, monkeypatch):
    mark_stopped(0)  # no folder given: nothing written, no error
    assert stopped_local_ranks(tmp_path) == []
    monkeypatch.setenv(STOPPED_ENV, str(tmp_path))
    mark_stopped(1)
    mark_stopped(0)
    (tmp_path / "x.stopped").touch()  # not a rank
    assert stopped_local_ranks(tmp_path) == [0, 1]


def test_a_stop_by_signal_is_0_only_when_every_worker_saved():
    assert signal_verdict("SIGTERM", 2, [0, 1]) == (
        0, "megatron_h2: SIGTERM received; all 2 workers of this node saved and stopped")
    code, line = signal_verdict("SIGTERM", 3, [1])
    assert code == 1 and line.startswith("error: SIGTERM received; local rank(s) 0, 2 of 3 did "
                                         "not save and stop")
