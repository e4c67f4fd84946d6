"""Megatron's logging flags without their sink are said to have no effect, and
--wandb-project without the wandb package is one line. (What the flags put into the log line,
the JSON lines, TensorBoard, Weights & Biases and a --profile trace:
tests/e2e/test_logging_flags.py.)"""

import sys

from megatron_h2.training.arguments import config_from_args, describe_no_effect
from megatron_h2.training.main import main


def test_flags_without_their_sink_have_no_effect_and_wandb_needs_its_package(monkeypatch,
                                                                              capsys):
    _, launch = config_from_args(["--log-timers-to-tensorboard", "--wandb-exp-name", "x",
                                  "--profile-step-start", "3"])
    line = describe_no_effect(launch)
    assert "--log-timers-to-tensorboard (needs --tensorboard-dir)" in line
    assert "--wandb-exp-name (needs --wandb-project)" in line
    assert "--profile-step-start (needs --profile)" in line
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    assert main(["--wandb-project", "p", "--mock-data", "--num-layers", "1", "--hidden-size",
                 "8", "--num-attention-heads", "1", "--seq-length", "8", "--micro-batch-size",
                 "1", "--lr", "1e-3", "--train-iters", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --wandb-project needs the wandb package")
    assert "pip install wandb" in err[0]
