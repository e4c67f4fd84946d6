"""Numerical health: NaN / Inf, spikes and flat lines are judged before the optimizer step, bad
steps are skipped or stop the run, and a bad state is never checkpointed."""

import json
import math

import pytest
import torch

from megatron_h2.checkpointing import (
    find_latest_iteration,
    load_checkpoint,
    save_checkpoint,
    saved_iterations,
)
from megatron_h2.config import TrainingConfig
from megatron_h2.monitoring.health import HealthMonitor, JobTrainingError
from megatron_h2.training.main import main
from megatron_h2.training.step import StepRunner
from tests.helpers.tiny_runs import flags


def _monitor(**kw) -> tuple[HealthMonitor, list[str]]:
    logs: list[str] = []
    return HealthMonitor(TrainingConfig(**kw), (257, 384), logs.append,
                         lambda iteration: "iteration 10 in ckpt"), logs


def test_nan_or_inf_stops_before_the_update_naming_the_last_good_checkpoint():
    health, _ = _monitor()
    assert health(1, 5.0, 1.0)
    for loss, norm in ((float("nan"), 1.0), (3.0, float("inf"))):
        with pytest.raises(JobTrainingError) as err:
            health(2, loss, norm)
        assert "not finite at iteration 2" in str(err.value)
        assert "last good checkpoint is iteration 10 in ckpt" in str(err.value)


def test_bad_steps_are_skipped_up_to_the_budget():
    health, logs = _monitor(skip_bad_steps=2)
    assert health(1, 5.0, 1.0)
    assert not health(2, float("nan"), 1.0)
    assert not health(3, 5.0, float("nan"))
    assert health(4, 4.9, 1.0)
    with pytest.raises(JobTrainingError, match="2 bad steps already skipped"):
        health(5, float("nan"), 1.0)
    assert health.skipped == 2 and "(2 of --skip-bad-steps 2 used)" in logs[-1]


def test_the_nan_check_can_be_turned_off():
    health, _ = _monitor(check_for_nan_in_loss_and_grad=False)
    assert health(1, float("nan"), float("nan"))


def test_a_spike_is_a_loss_far_above_the_running_median():
    health, _ = _monitor(check_for_spiky_loss=True, skip_bad_steps=1)
    assert health(1, 50.0, 1.0)  # no history yet: only above 10 x ln(384) = 59.5 is a spike
    for it, loss in enumerate([5.0, 4.8, 4.6, 4.5, 4.4, 4.3], start=2):
        assert health(it, loss, 1.0)
    assert not health(8, 50.0, 1.0)  # > 10 x the median (4.6)
    assert health(9, 4.2, 1.0)
    off, _ = _monitor()
    for it, loss in enumerate([5.0, 4.8, 4.6, 4.5, 4.4, 4.3, 50.0], start=1):
        assert off(it, loss, 1.0)  # --check-for-spiky-loss is off by default, as in Megatron


@pytest.mark.parametrize("loss, norm", [(4.0, 0.0), (math.log(384) + 1e-6, 0.3),
                                        (math.log(257), 0.2)])
def test_a_flat_line_is_suspect_at_once_and_bad_after_n_iterations(loss, norm):
    health, _ = _monitor(flat_line_iters=3)
    assert health(1, 5.0, 1.0) and not health.suspect
    assert health(2, loss, norm) and health.suspect
    assert health(3, loss, norm)
    with pytest.raises(JobTrainingError, match="flat-lined .* for 3 iterations"):
        health(4, loss, norm)
    health.flat_streak = 0
    assert health(5, 5.0, 1.0) and not health.suspect  # a healthy step ends the streak


def test_overflow_skips_are_counted_for_fp16_loss_scaling():
    health, logs = _monitor()
    health.count_overflow_skip(7, 65536.0)
    assert health.skipped_iterations == 1 and "loss scale 65536" in logs[-1]


def test_a_diverged_run_is_stopped_and_never_checkpointed(corpus, tmp_path, capsys):
    """Weights that make every prediction uniform (loss = ln(vocab), grad norm 0) are what a
    saturated, diverged model looks like: the run stops and saves none of those states."""
    ckpt = tmp_path / "ckpt"
    assert main(flags(corpus, tmp_path, "--train-iters", "2", "--lr-warmup-iters", "1",
                      "--save", str(ckpt), "--untie-embeddings-and-output-weights")) == 0
    state = load_checkpoint(ckpt)
    for name in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias",
                 "output_layer.weight"):
        state.model[name].zero_()
    save_checkpoint(ckpt, 2, state.model, state.optimizer,
                    {k: v for k, v in state.metadata.items() if k != "parts"})
    capsys.readouterr()
    assert main(flags(corpus, tmp_path, "--train-iters", "20", "--lr-warmup-iters", "1",
                      "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "1",
                      "--log-interval", "1", "--no-load-optim",
                      "--untie-embeddings-and-output-weights")) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "flat-lined (grad norm 0 for 5 iterations) at iteration 7" in err and "\n" not in err
    assert f"last good checkpoint is iteration 2 in {ckpt}" in err
    assert "not saving at iteration 3: the state is suspect" in captured.out
    assert saved_iterations(ckpt) == [2]


def _nan_grad_norm_at(monkeypatch, iteration: int) -> None:
    real = StepRunner._grad_norm
    calls = {"n": 0}

    def grad_norm(self):
        calls["n"] += 1
        value = real(self)
        return float("nan") if calls["n"] == iteration else value

    monkeypatch.setattr(StepRunner, "_grad_norm", grad_norm)


def test_nan_gradients_stop_the_run_with_the_last_good_checkpoint(corpus, tmp_path, capsys,
                                                                  monkeypatch):
    """Iteration 2's checkpoint was followed by the bad iteration 3: not good, set aside."""
    _nan_grad_norm_at(monkeypatch, 3)
    ckpt = tmp_path / "ckpt"
    assert main(flags(corpus, tmp_path, "--train-iters", "6", "--lr-warmup-iters", "1",
                      "--save", str(ckpt), "--save-interval", "1")) == 2
    err = capsys.readouterr().err.strip()
    assert "grad norm nan is not finite at iteration 3" in err
    assert (f"last good checkpoint is iteration 1 in {ckpt} (iteration(s) 2, saved before "
            "iteration 3 revealed the bad state, set aside as iter_*.unverified); resume from it "
            f"with --load {ckpt} --ckpt-step 1 --override-opt_param-scheduler and a lower --lr"
            in err) and "\n" not in err
    assert saved_iterations(ckpt) == [1] and (ckpt / "iter_0000002.unverified").is_dir()
    assert find_latest_iteration(ckpt) == 1


def test_a_skipped_step_consumes_its_batch_without_an_update(corpus, tmp_path, capsys,
                                                             monkeypatch):
    _nan_grad_norm_at(monkeypatch, 3)
    ckpt = tmp_path / "ckpt"
    assert main(flags(corpus, tmp_path, "--train-iters", "4", "--lr-warmup-iters", "1",
                      "--save", str(ckpt), "--skip-bad-steps", "1", "--log-interval", "1")) == 0
    out = capsys.readouterr().out
    assert "iteration 3: loss" in out and "skipping this step without an update" in out
    rows = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["skipped_iterations"] for r in rows] == [0, 0, 1, 1]
    assert [r["consumed_samples"] for r in rows] == [8, 16, 24, 32]
    final = load_checkpoint(ckpt)
    assert final.metadata["consumed_samples"] == 32
    assert all(bool(torch.isfinite(t).all()) for t in final.model.values())
