"""Numerical health survives a resume, and the checkpoint a stopped run recommends is good: the
spike detector's history is in every checkpoint, a run with no history compares against
ln(vocabulary), a state revealed as bad one iteration later is set aside (``latest`` goes back to
the last verified checkpoint), and the documented fault injection (``$MEGATRON_H2_INJECT_NUMERIC``)
drives each check directly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_h2.checkpointing import (
    find_latest_iteration,
    load_checkpoint,
    read_metadata,
    saved_iterations,
)
from megatron_h2.training.main import main
from tests.helpers.tiny_runs import flags, records

INJECT = "MEGATRON_H2_INJECT_NUMERIC"


def _save_flags(ckpt: Path, *extra: str) -> list[str]:
    return ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "1",
            "--log-interval", "1", "--min-lr", "0", "--lr-warmup-iters", "0", *extra]


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_a_diverging_run_after_a_resume_is_stopped_and_never_checkpointed(corpus, tmp_path,
                                                                            capsys):
    """Issue reproduction 1: resumed with ``--lr 3``, the loss went 5.4 -> 196 unflagged and
    the diverged states were checkpointed, ``latest`` pointing at them."""
    ckpt = tmp_path / "ckpt"
    assert main(flags(corpus, tmp_path, *_save_flags(ckpt, "--lr", "1e-3", "--train-iters",
                                                     "12", "--exit-interval", "6",
                                                     "--async-save"))) == 0
    before = records(tmp_path)
    health = read_metadata(ckpt / "iter_0000006")["health"]
    assert health["recent"] == pytest.approx([before[i] for i in range(1, 7)], rel=1e-6)
    capsys.readouterr()
    assert main(flags(corpus, tmp_path, *_save_flags(
        ckpt, "--lr", "3", "--override-opt_param-scheduler", "--check-for-spiky-loss",
        "--train-iters", "12", "--async-save"))) == 2
    err = _err(capsys)
    assert "x the running median" in err and "at iteration 8" in err, err
    assert f"last good checkpoint is iteration 6 in {ckpt}" in err
    assert find_latest_iteration(ckpt) == 6
    assert saved_iterations(ckpt) == [1, 2, 3, 4, 5, 6]  # 7 was never committed


def test_without_history_a_loss_far_above_ln_vocabulary_is_a_spike(corpus, tmp_path, capsys,
                                                                     monkeypatch):
    """A fresh run (or a checkpoint without history) is not blind for its first 5 losses."""
    monkeypatch.setenv(INJECT, "2:spike:30")
    assert main(flags(corpus, tmp_path, "--train-iters", "4", "--check-for-spiky-loss")) == 2
    err = _err(capsys)
    assert "is above 10 x ln(vocabulary) = 55.45, the bound until 5 losses are known" in err
    assert "at iteration 2" in err


def test_exploded_weights_are_not_recommended_and_the_advice_does_not_loop(corpus, tmp_path,
                                                                          capsys):
    """Issue reproduction 2: ``--lr 1e6`` stopped naming iteration 1, which already held the
    exploded weights (max |w| = 1e6); resuming from it as advised stopped at once again."""
    ckpt = tmp_path / "ckpt"
    assert main(flags(corpus, tmp_path, *_save_flags(ckpt, "--lr", "1e6", "--train-iters",
                                                     "8", "--async-save"))) == 2
    err = _err(capsys)
    assert "last good checkpoint is none: this run started from scratch" in err, err
    assert saved_iterations(ckpt) == [] and find_latest_iteration(ckpt) is None
    # the advice, followed with a saner learning rate, trains
    assert main(flags(corpus, tmp_path, *_save_flags(ckpt, "--lr", "1e-3", "--train-iters",
                                                     "3"))) == 0
    assert find_latest_iteration(ckpt) == 3


@pytest.mark.parametrize("fault, says", [("4:nan-loss", "loss nan / grad norm"),
                                         ("4:nan-grad", "grad norm nan is not finite"),
                                         ("4:spike", "(spike; --spiky-loss-factor 10)")])
def test_injected_faults_stop_at_their_iteration_and_set_the_unverified_aside(
        corpus, tmp_path, capsys, monkeypatch, fault, says):
    """Checkpoint 3 was saved (synchronously) before iteration 4 revealed the bad state: set
    aside, latest 2. (With --async-save it is not committed yet when iteration 4 fails.)"""
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv(INJECT, fault)
    extra = ["--check-for-spiky-loss"] if "spike" in fault else []
    assert main(flags(corpus, tmp_path, *_save_flags(ckpt, "--lr", "1e-3", "--train-iters",
                                                     "8", *extra))) == 2
    err = _err(capsys)
    assert says in err and "at iteration 4" in err, err
    assert (f"last good checkpoint is iteration 2 in {ckpt} (iteration(s) 3, saved before "
            "iteration 4 revealed the bad state, set aside as iter_*.unverified)") in err
    assert saved_iterations(ckpt) == [1, 2] and find_latest_iteration(ckpt) == 2
    assert (ckpt / "iter_0000003.unverified").is_dir()


def test_retention_keeps_the_last_good_checkpoint(corpus, tmp_path, capsys, monkeypatch):
    """--most-recent-k 1 would have deleted checkpoint 2 when 3 was saved; the stop goes back
    to 2, so retention keeps it."""
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv(INJECT, "4:nan-loss")
    assert main(flags(corpus, tmp_path, *_save_flags(ckpt, "--lr", "1e-3", "--train-iters",
                                                     "8", "--most-recent-k", "1"))) == 2
    assert f"last good checkpoint is iteration 2 in {ckpt}" in _err(capsys)
    assert saved_iterations(ckpt) == [2] and find_latest_iteration(ckpt) == 2
    assert load_checkpoint(ckpt).iteration == 2


def test_a_malformed_fault_injection_is_one_line(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(INJECT, "4:nan")
    assert main(flags(corpus, tmp_path, "--train-iters", "2")) == 2
    assert "should be ITER:KIND[:FACTOR] with KIND one of nan-loss, nan-grad, spike" in \
        _err(capsys)


def test_the_history_is_restored_exactly(corpus, tmp_path):
    """A resumed run saves the history it was given plus its own losses."""
    ckpt = tmp_path / "ckpt"
    assert main(flags(corpus, tmp_path, *_save_flags(ckpt, "--train-iters", "6",
                                                     "--exit-interval", "3"))) == 0
    assert main(flags(corpus, tmp_path, *_save_flags(ckpt, "--train-iters", "6"))) == 0
    losses = [json.loads(x)["lm_loss"] for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    saved = read_metadata(ckpt / "iter_0000006")["health"]
    assert saved["recent"] == pytest.approx(losses[-6:], rel=1e-6) and saved["flat_streak"] == 0
