"""Megatron's optimizer-parameter schedule in runs: decoupled learning rates for the embedding
and output layer, the schedule saved in checkpoints and checked on resume (or overridden, or
taken from the checkpoint), and weight decay increments."""

from pathlib import Path

import pytest

from megatron_h2.checkpointing import open_checkpoint
from tests.helpers.tiny_runs import run, run_error


def _tensors(ckpt: Path, iteration: int) -> dict:
    return open_checkpoint(str(ckpt), iteration).load_all("model")


def test_decoupled_lr_moves_only_embedding_and_output(corpus, tmp_path):
    """--decoupled-lr 0: the embedding and output layer stay put while the rest trains."""
    ckpt = tmp_path / "ckpt"
    run(corpus, tmp_path, "--train-iters", "2", "--global-batch-size", "4", "--decoupled-lr",
        "0", "--save", str(ckpt), "--save-interval", "1")
    first, second = _tensors(ckpt, 1), _tensors(ckpt, 2)
    for name in first:
        same = bool((first[name] == second[name]).all())
        assert same == (name in ("embedding.word_embeddings.weight", "output_layer.weight")), name


def test_schedule_is_saved_and_checked_on_resume(corpus, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    common = ["--global-batch-size", "4", "--lr-warmup-iters", "2", "--save", str(ckpt),
              "--load", str(ckpt)]
    run(corpus, tmp_path, *common, "--train-iters", "4", "--exit-interval", "2")
    meta = open_checkpoint(str(ckpt), 2).metadata["opt_param_scheduler"]
    assert meta["num_steps"] == 8 and meta["lr_decay_steps"] == 16 and meta["max_lr"] == 3e-3
    err = run_error(corpus, tmp_path, capsys, *common, "--train-iters", "4", "--lr", "1e-3")
    assert ("the checkpoint's schedule has max_lr 0.003 but this run has 0.001 (--lr); pass "
            "--override-opt_param-scheduler") in err
    err = run_error(corpus, tmp_path, capsys, *common, "--train-iters", "6")
    assert "lr_decay_steps 16 but this run has 24" in err
    rows = run(corpus, tmp_path, *common, "--train-iters", "4", "--lr", "1e-3",
               "--use-checkpoint-opt_param-scheduler")
    assert [r["lr"] for r in rows] == pytest.approx([3e-3, 3e-3 * 0.5])
    rows = run(corpus, tmp_path, *common, "--train-iters", "6", "--lr", "1e-3",
               "--override-opt-param-scheduler")
    assert [r["iteration"] for r in rows] == [5, 6]
    assert rows[0]["lr"] == pytest.approx(1e-3 * (1 - (16 - 8) / (24 - 8)))
    # --no-load-optim drops the optimizer and, as in Megatron, its schedule: warm-up again
    rows = run(corpus, tmp_path, *common, "--train-iters", "8", "--lr", "2e-3",
               "--no-load-optim")
    assert rows[0]["iteration"] == 7 and rows[0]["lr"] == 0.0


def test_weight_decay_increment_reaches_the_checkpointed_state(corpus, tmp_path):
    ckpt = tmp_path / "ckpt"
    run(corpus, tmp_path, "--train-iters", "3", "--global-batch-size", "4", "--save", str(ckpt),
        "--weight-decay-incr-style", "linear", "--start-weight-decay", "0.0",
        "--end-weight-decay", "0.3")
    meta = open_checkpoint(str(ckpt), 3).metadata["opt_param_scheduler"]
    assert (meta["start_wd"], meta["end_wd"], meta["wd_incr_steps"]) == (0.0, 0.3, 12)
