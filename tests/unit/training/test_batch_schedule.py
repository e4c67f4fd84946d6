"""Megatron's batch-size schedules: batch ramp-up (--rampup-batch-size) as Megatron's
calculator counts it and step schedules (--step-batch-size-schedule, thresholds in tokens), and
sample-based runs (--train-samples) that follow them. (Ramp-up under PP x DP against one
process: tests/e2e/test_batch_schedule.py.)"""

import pytest

from megatron_h2.config import TrainingConfig
from megatron_h2.errors import ConfigError
from megatron_h2.training.batch_schedule import BatchSchedule
from tests.helpers.tiny_runs import run


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
