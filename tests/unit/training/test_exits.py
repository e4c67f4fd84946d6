"""Timed exits: --exit-duration-in-mins saves and stops. (--exit-signal-handler, with a real
SIGTERM to a training process: tests/e2e/test_exits.py.)"""

from tests.helpers.tiny_runs import run


def test_exit_duration_saves_and_stops(corpus, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    rows = run(corpus, tmp_path, "--train-iters", "50", "--global-batch-size", "4",
               "--exit-duration-in-mins", "0.0001", "--save", str(ckpt))
    assert [r["iteration"] for r in rows] == [1]
    assert "stopping at iteration 1 after" in capsys.readouterr().out
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
