"""One writing job per --save directory, leftovers of interrupted saves, retention."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_h2.checkpointing import begin_save, save_checkpoint, saved_iterations
from megatron_h2.checkpointing.housekeeping import (
    OWNER_FILE,
    OwnerRecord,
    acquire_save_dir,
    apply_retention,
    check_owner,
    clean_leftovers,
    process_start,
)
from megatron_h2.config import TrainingConfig
from megatron_h2.errors import ConfigError, TrainingError
from megatron_h2.training.main import main
from tests.helpers.tiny_runs import flags


def _record(pid: int, job: str, host: str | None = None, started: int | None = None,
            token: str = "ab" * 16) -> OwnerRecord:
    return OwnerRecord(host or socket.gethostname(), pid,
                       process_start(pid) if started is None else started, job,
                       time.time() - 3600, token)


def _write_owner(save: Path, record: OwnerRecord) -> None:
    save.mkdir(parents=True, exist_ok=True)
    (save / OWNER_FILE).write_text(json.dumps(record.__dict__))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_owner_refuses_a_second_job_in_one_line(tmp_path):
    logs: list[str] = []
    owner = acquire_save_dir(tmp_path, "job-A", logs.append)
    try:
        with pytest.raises(ConfigError) as err:
            acquire_save_dir(tmp_path, "job-B", logs.append)
        text = str(err.value)
        assert f"host {socket.gethostname()}, pid {os.getpid()}, job job-A, since " in text
        assert "in use by another running job" in text and "\n" not in text
        with pytest.raises(ConfigError, match="job job-A"):
            check_owner(tmp_path, "job-B")  # what every other rank of job B checks
        check_owner(tmp_path, "job-A")  # the owner's own ranks pass
        owner.check()
    finally:
        owner.release()
    assert not (tmp_path / OWNER_FILE).exists()
    acquire_save_dir(tmp_path, "job-B", logs.append).release()  # free again
    assert logs == []


def test_a_dead_owner_is_taken_over_and_said_so(tmp_path):
    _write_owner(tmp_path, _record(_dead_pid(), "job-old", started=123))
    logs: list[str] = []
    owner = acquire_save_dir(tmp_path, "job-new", logs.append)
    try:
        assert len(logs) == 1 and "took over" in logs[0] and "job job-old" in logs[0]
        assert json.loads((tmp_path / OWNER_FILE).read_text())["job_id"] == "job-new"
    finally:
        owner.release()


def test_a_reused_pid_does_not_keep_a_dead_owner_alive(tmp_path):
    mine = process_start(os.getpid())
    assert mine is not None
    _write_owner(tmp_path, _record(os.getpid(), "job-old", started=mine - 1))
    logs: list[str] = []
    acquire_save_dir(tmp_path, "job-new", logs.append).release()
    assert "took over" in logs[0]


def test_an_owner_on_another_host_lives_while_its_heartbeat_moves(tmp_path):
    token = "cd" * 16
    _write_owner(tmp_path, _record(1, "job-remote", host="elsewhere.example", started=1,
                                   token=token))
    beat = tmp_path / f".owner-{token}.heartbeat"
    beat.touch()
    with pytest.raises(ConfigError, match="host elsewhere.example"):
        acquire_save_dir(tmp_path, "job-new", print, patience_s=0.2)
    old = time.time() - 3600  # heartbeat an hour old and not moving: the owner is gone
    os.utime(beat, (old, old))
    logs: list[str] = []
    acquire_save_dir(tmp_path, "job-new", logs.append, patience_s=0.2).release()
    assert "took over" in logs[0] and not beat.exists()


def test_losing_the_directory_stops_the_next_save(tmp_path):
    owner = acquire_save_dir(tmp_path, "job-A", print)
    try:
        _write_owner(tmp_path, _record(os.getppid(), "job-B"))  # someone forced a takeover
        with pytest.raises(TrainingError, match="no longer belongs to this job"):
            owner.check()
    finally:
        owner.release()
    assert (tmp_path / OWNER_FILE).exists()  # not ours any more: left alone


def test_a_second_training_job_fails_at_start_naming_the_owner(corpus, tmp_path, capsys):
    save = tmp_path / "ckpt"
    parent = os.getppid()  # a live process on this host stands for the running first job
    _write_owner(save, _record(parent, "job-first"))
    assert main(flags(corpus, tmp_path, "--train-iters", "2", "--lr-warmup-iters", "1",
                      "--save", str(save))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --save ") and "\n" not in err
    assert f"pid {parent}, job job-first" in err
    assert not saved_iterations(save)


def test_leftovers_are_cleaned_and_a_dead_owner_taken_over_at_start(corpus, tmp_path, capsys):
    save = tmp_path / "ckpt"
    _write_owner(save, _record(_dead_pid(), "job-crashed", started=7))
    begin_save(save, 7)  # a save that was killed midway
    (save / "iter_0000005.old").mkdir()
    assert main(flags(corpus, tmp_path, "--train-iters", "2", "--lr-warmup-iters", "1",
                      "--save", str(save))) == 0
    out = capsys.readouterr().out
    assert "took over --save" in out and "job job-crashed" in out
    assert "removed leftovers of interrupted saves" in out and ".iter_0000007.incomplete" in out
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000002",
                                                     "latest_checkpointed_iteration.txt"]


def test_clean_leftovers_keeps_checkpoints(tmp_path):
    save_checkpoint(tmp_path, 3, {"w": torch.ones(2)}, None, {})
    begin_save(tmp_path, 4)
    (tmp_path / ".latest_checkpointed_iteration.txt.tmp-99").write_text("4")
    assert clean_leftovers(tmp_path) == [".iter_0000004.incomplete",
                                         ".latest_checkpointed_iteration.txt.tmp-99"]
    assert saved_iterations(tmp_path) == [3]


def _saves(root: Path, iterations) -> None:
    for it in iterations:
        save_checkpoint(root, it, {"w": torch.full((2,), float(it))}, None, {})


@pytest.mark.parametrize("retain, recent, kept", [
    (None, -1, list(range(1, 11))),          # default: keep everything
    (4, -1, [4, 8, 10]),                     # Megatron: the newest and multiples
    (None, 3, [8, 9, 10]),                   # the K newest
    (4, 2, [4, 8, 9, 10]),
])
def test_retention(tmp_path, retain, recent, kept):
    _saves(tmp_path, range(1, 11))
    apply_retention(tmp_path, retain, recent)
    assert saved_iterations(tmp_path) == kept


def test_retention_flags_are_checked():
    with pytest.raises(ConfigError, match="multiple of --save-interval 5"):
        TrainingConfig(save_interval=5, save_retain_interval=12)
    with pytest.raises(ConfigError, match="--most-recent-k"):
        TrainingConfig(most_recent_k=0)


def test_training_applies_retention(corpus, tmp_path):
    save = tmp_path / "ckpt"
    assert main(flags(corpus, tmp_path, "--train-iters", "6", "--lr-warmup-iters", "1",
                      "--save", str(save), "--save-interval", "1",
                      "--save-retain-interval", "3")) == 0
    assert saved_iterations(save) == [3, 6]
