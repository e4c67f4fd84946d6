"""Megatron's run-length, batch-size and optimizer-parameter schedules, end to end: sample-based
runs, batch ramp-up and step schedules (also under PP x DP), decoupled learning rates, weight
decay increments, the schedule saved in checkpoints and checked on resume, timed exits."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_h2.checkpointing import open_checkpoint
from megatron_h2.config import TrainingConfig
from megatron_h2.errors import ConfigError
from megatron_h2.training.batch_schedule import BatchSchedule
from megatron_h2.training.main import main
from tests.helpers.dist_utils import losses, torchrun
from tests.helpers.paths import ROOT

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--num-query-groups", "2",
         "--ffn-hidden-size", "128", "--seq-length", "32", "--max-position-embeddings", "32",
         "--micro-batch-size", "2", "--lr", "3e-3", "--seed", "11", "--log-interval", "1",
         "--eval-interval", "1000", "--eval-iters", "0", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "256", "--split", "90,10,0"]


def run(corpus: str, tmp: Path, *extra: str) -> list[dict]:
    """Train in this process; returns the --log-jsonl records."""
    log = tmp / "log.jsonl"
    if log.exists():
        log.unlink()
    assert main([*MODEL, "--data-path", corpus, "--data-cache-path", str(tmp / "cache"),
                 "--log-jsonl", str(log), *extra]) == 0
    return [json.loads(line) for line in log.read_text().splitlines()]


def run_error(corpus: str, tmp: Path, capsys, *extra: str) -> str:
    assert main([*MODEL, "--data-path", corpus, "--data-cache-path", str(tmp / "cache"),
                 *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


# ------------------------------------------------------------------------- batch schedules
def _batch(**training) -> BatchSchedule:
    return BatchSchedule.from_config(TrainingConfig(micro_batch_size=1, **training), 32)


def test_rampup_follows_megatrons_calculator():
    """START 4, INCREMENT 4 over 40 samples to 16: 3 increments of 40/3 samples each."""
    ramp = _batch(global_batch_size=16, train_samples=100, rampup_batch_size=[4, 4, 40])
    assert [ramp.batch_at(c) for c in (0, 13, 14, 26, 27, 40, 41)] == [4, 4, 8, 8, 12, 16, 16]
    assert ramp.sizes() == [4, 8, 12, 16]
    # Megatron's update_train_iters: the ramp-up consumes 4,4,4,4,8,8,12 (to 44 > 40), then
    # (100 - 44) // 16 iterations of 16
    assert ramp.iterations_for(100) == 7 + 3
    assert ramp.samples_for(7) == 44 and ramp.samples_for(10) == 92
    with pytest.raises(ConfigError, match="by a multiple of the increment 5"):
        _batch(global_batch_size=16, train_samples=100, rampup_batch_size=[4, 5, 40])
    with pytest.raises(ConfigError, match="divisible by --micro-batch-size 2 x data-parallel "
                                          "size 2; use multiples of 4"):
        _batch(global_batch_size=16, train_samples=100, rampup_batch_size=[6, 5, 40]).check(2, 2)


def test_step_schedule_thresholds_are_tokens():
    steps = _batch(step_batch_size_schedule="0:4 320:8 1.28K:16", train_samples=100)
    assert steps.steps == [(0, 4), (10, 8), (40, 16)] and steps.final == 16
    assert [steps.batch_at(c) for c in (0, 9, 10, 39, 40)] == [4, 4, 8, 8, 16]
    # 0,4,8 (12) -> 8-batches to 44 -> 16-batches to >= 100: 3 + 4 + 4 iterations
    assert steps.iterations_for(100) == 11 and steps.samples_for(11) == 108
    assert steps.iterations_for(44) == 7 and steps.samples_for(3) == 12
    with pytest.raises(ConfigError, match="at least one sequence"):
        _batch(step_batch_size_schedule="0:4 10:8", train_iters=5)
    planned = TrainingConfig(micro_batch_size=1, step_batch_size_schedule="0:4 320:8",
                             train_iters=5)
    planned.global_batch_size = 16  # as a --hetero-plan with another batch would set it
    with pytest.raises(ConfigError, match="16 differs from the last one"):
        BatchSchedule.from_config(planned, 32)


def test_sample_based_rampup_run(corpus, tmp_path):
    """--train-samples with --rampup-batch-size: each iteration's batch, consumed samples and
    learning rate (warm-up counted in samples from --lr-warmup-init) follow the schedules."""
    rows = run(corpus, tmp_path, "--global-batch-size", "16", "--train-samples", "100",
               "--rampup-batch-size", "4", "4", "40", "--lr-warmup-samples", "8",
               "--lr-warmup-init", "1e-3", "--lr-decay-style", "constant")
    assert [r["global_batch_size"] for r in rows] == [4, 4, 4, 4, 8, 8, 12, 16, 16, 16]
    assert [r["consumed_samples"] for r in rows] == [4, 8, 12, 16, 24, 32, 44, 60, 76, 92]
    lrs = [r["lr"] for r in rows]
    assert lrs[:3] == pytest.approx([1e-3, 2e-3, 3e-3]) and lrs[3:] == [3e-3] * 7


def test_step_schedule_run_with_matching_global_batch(corpus, tmp_path):
    rows = run(corpus, tmp_path, "--train-iters", "4", "--global-batch-size", "8",
               "--step-batch-size-schedule", "0:4 256:8")
    assert [r["global_batch_size"] for r in rows] == [4, 4, 8, 8]


@pytest.mark.e2e
def test_rampup_under_pipeline_and_data_parallel_matches_one_process(corpus, tmp_path):
    """PP 2 x DP 2: micro-batches per replica grow 1, 2, 3, 4 with the batch (fewer than the
    pipeline's stages at first); the loss counts tokens over the whole batch, across replicas
    (--eod-mask-loss --calculate-per-token-loss)."""
    flags = [*MODEL, "--data-path", corpus, "--global-batch-size", "16", "--train-samples",
             "120", "--rampup-batch-size", "4", "4", "30", "--eod-mask-loss",
             "--calculate-per-token-loss"]
    assert main([*flags, "--log-jsonl", str(tmp_path / "one.jsonl")]) == 0
    proc = torchrun(4, [*flags, "--pipeline-model-parallel-size", "2", "--log-jsonl",
                        str(tmp_path / "pp_dp.jsonl")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, got = losses(tmp_path / "one.jsonl"), losses(tmp_path / "pp_dp.jsonl")
    assert sorted(got) == sorted(want)
    assert all(abs(got[i] - want[i]) <= 1e-5 * abs(want[i]) for i in want)
    sizes = [json.loads(x)["global_batch_size"] for x in
             (tmp_path / "pp_dp.jsonl").read_text().splitlines()]
    assert sizes[:6] == [4, 4, 4, 8, 12, 16] and len(sizes) == 10


# ------------------------------------------------------------- optimizer-parameter schedule
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


# --------------------------------------------------------------------------- exits
def test_exit_duration_saves_and_stops(corpus, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    rows = run(corpus, tmp_path, "--train-iters", "50", "--global-batch-size", "4",
               "--exit-duration-in-mins", "0.0001", "--save", str(ckpt))
    assert [r["iteration"] for r in rows] == [1]
    assert "stopping at iteration 1 after" in capsys.readouterr().out
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def _signal_run(tmp: Path, corpus: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    log, ckpt = tmp / "log.jsonl", tmp / "ckpt"
    argv = [sys.executable, str(ROOT / "pretrain_gpt.py"), *MODEL, "--data-path", corpus,
            "--train-iters", "100000", "--global-batch-size", "4", "--save", str(ckpt),
            "--log-jsonl", str(log), *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (log.exists() and log.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    return proc, ckpt


@pytest.mark.e2e
def test_exit_signal_handler(corpus, tmp_path):
    """With --exit-signal-handler SIGTERM saves and stops cleanly; without it the process ends
    at once (Megatron's default), leaving no checkpoint."""
    proc, ckpt = _signal_run(tmp_path / "on", corpus, "--exit-signal-handler")
    assert proc.returncode == 0
    assert int((ckpt / "latest_checkpointed_iteration.txt").read_text()) >= 2
    proc, ckpt = _signal_run(tmp_path / "off", corpus)
    assert proc.returncode == -signal.SIGTERM and not list(ckpt.glob("iter_*"))


# ------------------------------------------------------------------- loss normalisation
def _runner(per_token: bool, eod: int | None):
    import torch

    from megatron_h2.config import ModelConfig, OptimizerConfig, RunConfig
    from megatron_h2.devices import get_accelerator
    from megatron_h2.distributed.topology import build_topology
    from megatron_h2.models.gpt import GPTModel, init_parameters
    from megatron_h2.optimizer import build_data_parallel_optimizer
    from megatron_h2.training.layout import uniform_plan
    from megatron_h2.training.step import StepRunner

    cfg = RunConfig(model=ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                      seq_length=8, ffn_hidden_size=64, vocab_size=64,
                                      hidden_dropout=0.0, attention_dropout=0.0),
                    optimizer=OptimizerConfig(lr=1e-3, clip_grad=0.0),
                    training=TrainingConfig(micro_batch_size=1, global_batch_size=4,
                                            train_iters=1, calculate_per_token_loss=per_token))
    acc = get_accelerator("cpu")
    topo = build_topology(uniform_plan(cfg.parallel, cfg.model, cfg.training, 1, "cpu"), 0, 1)
    tp = topo.tp_context(False)
    models = []
    for _ in range(2):  # one trained by the runner, one for the reference gradient
        models.append(GPTModel(cfg.model, acc.kernels, topo.layer_range, True, True, tp))
        init_parameters(models[-1], cfg.model, 0)
    opt = build_data_parallel_optimizer(models[0], cfg.optimizer, None)
    return StepRunner(cfg, acc, topo, tp, models[0], opt, eod_mask=eod), models, torch


@pytest.mark.parametrize("per_token", [False, True])
def test_eod_mask_and_per_token_loss_match_megatrons_normalisation(per_token):
    """--eod-mask-loss drops positions whose input is eod; without --calculate-per-token-loss
    each micro-batch averages over its own counted tokens (then over micro-batches), with it
    the whole batch's counted tokens share one denominator. The reported loss is per counted
    token either way."""
    import numpy as np

    eod = 63
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 60, 9) for _ in range(4)]
    for sample, n in zip(data, (0, 1, 3, 5)):  # eod counts differ between micro-batches
        sample[rng.choice(8, n, replace=False)] = eod
    runner, (model, reference), torch = _runner(per_token, eod)
    result = runner.train_step(data, 0, 1, 0.0)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    batch = torch.as_tensor(np.stack(data))
    losses = reference(tokens=batch[:, :-1], labels=batch[:, 1:])  # [4, 8]
    mask = (batch[:, :-1] != eod).float()
    if per_token:
        objective = (losses * mask).sum() / mask.sum()
    else:
        objective = sum((losses[i] * mask[i]).sum() / mask[i].sum() for i in range(4)) / 4
    objective.backward()
    for name, param in reference.named_parameters():
        assert torch.allclose(got[name], param.grad, rtol=1e-5, atol=1e-7), name
    want = float((losses.detach() * mask).sum() / mask.sum())
    assert result.loss == pytest.approx(want, rel=1e-6)
    plain, _, _ = _runner(per_token, None)
    assert plain.train_step(data, 0, 1, 0.0).loss == pytest.approx(float(losses.detach().mean()),
                                                                    rel=1e-6)
