"""fp16 loss scaling with Megatron-LM's semantics: the dynamic scale grows after a clean window,
backs off by half once the hysteresis is used up (and at once on every later overflow until it
grows again), never goes below --min-loss-scale; an overflowing step is skipped without an
update, counted and logged, does not advance the learning-rate schedule, and the scaler's state
resumes from checkpoints. fp16 runs on the CPU (torch's CPU kernels have every fp16 operator the
model needs)."""

import json

import pytest
import torch

from megatron_h2.checkpointing import load_checkpoint
from megatron_h2.config import RunConfig
from megatron_h2.errors import ConfigError
from megatron_h2.models.gpt import GPTModel, init_parameters
from megatron_h2.optimizer import ConstantGradScaler, DynamicGradScaler, build_grad_scaler
from megatron_h2.training.arguments import config_from_args
from megatron_h2.training.main import main
from tests.helpers.tiny_runs import flags, records


def _scales(scaler: DynamicGradScaler, overflows: str) -> list[float]:
    """The scale after each update; ``overflows``: 'x' overflow, '.' clean."""
    out = []
    for c in overflows:
        scaler.update(c == "x")
        out.append(scaler.scale)
    return out


def test_the_scale_grows_after_a_clean_window():
    scaler = DynamicGradScaler(2.0**10, 1.0, window=3, hysteresis=2)
    assert _scales(scaler, "......") == [2**10, 2**10, 2**11, 2**11, 2**11, 2**12]


def test_an_overflow_restarts_the_window():
    scaler = DynamicGradScaler(2.0**10, 1.0, window=3, hysteresis=2)
    assert _scales(scaler, "..x...") == [2**10] * 5 + [2**11]  # one overflow: within hysteresis


def test_overflows_back_off_after_the_hysteresis_and_then_at_once_until_growth():
    """Megatron's rule: the hysteresis count is restored only when the scale grows, so after
    the first back-off every further overflow halves the scale again (torch's GradScaler has no
    such memory)."""
    scaler = DynamicGradScaler(2.0**10, 1.0, window=2, hysteresis=2)
    assert _scales(scaler, "xx") == [2**10, 2**9]
    assert _scales(scaler, ".x") == [2**9, 2**8]  # no growth in between: backs off at once
    assert _scales(scaler, "..") == [2**8, 2**9]  # growth restores the hysteresis...
    assert _scales(scaler, "x") == [2**9]  # ...so one overflow is tolerated again
    assert _scales(scaler, "x") == [2**8]


def test_the_min_scale_is_respected():
    scaler = DynamicGradScaler(8.0, 2.0, window=1000, hysteresis=1)
    assert _scales(scaler, "xxxx") == [4.0, 2.0, 2.0, 2.0]


def test_a_constant_scale_never_changes():
    scaler = ConstantGradScaler(128.0)
    scaler.update(True)
    scaler.update(False)
    assert scaler.scale == 128.0 and scaler.inv_scale == 1 / 128


def test_scaler_state_round_trips_and_bad_state_is_one_line():
    scaler = DynamicGradScaler(2.0**16, 1.0, window=5, hysteresis=3)
    _scales(scaler, "..xx.")
    other = DynamicGradScaler(2.0**32, 1.0, window=5, hysteresis=3)
    other.load_state_dict(json.loads(json.dumps(scaler.state_dict())))
    assert other.state_dict() == scaler.state_dict() == {
        "scale": 2.0**16, "growth_tracker": 1, "hysteresis_tracker": 1}
    with pytest.raises(ConfigError, match="--no-load-optim"):
        other.load_state_dict({"scale": "x"})


@pytest.mark.parametrize("flags_, distributed, kind", [
    (["--fp16"], False, DynamicGradScaler),
    (["--fp16", "--loss-scale", "1024"], False, ConstantGradScaler),
    (["--bf16", "--loss-scale", "1024"], False, ConstantGradScaler),
    (["--loss-scale", "1024"], True, ConstantGradScaler),  # fp32 with the distributed optimizer
    (["--loss-scale", "1024"], False, None),  # Megatron's fp32 optimizer ignores it
    (["--bf16"], False, None),
    ([], True, None),
])
def test_the_scaler_is_the_one_megatron_builds(flags_, distributed, kind):
    scaler = build_grad_scaler(config_from_args(flags_)[0].training, distributed)
    assert (scaler is None) if kind is None else isinstance(scaler, kind)
    if isinstance(scaler, DynamicGradScaler):  # Megatron's defaults and fixed factors
        assert (scaler.scale, scaler.min_scale, scaler.window, scaler.hysteresis) == (
            2.0**32, 1.0, 1000, 2)
        assert (scaler.growth, scaler.backoff) == (2.0, 0.5)


def test_fp16_with_the_default_scale_skips_overflowing_steps_without_an_update(corpus, tmp_path,
                                                                                capsys):
    """From Megatron's initial scale 2^32 the scaled fp16 gradients overflow: every step is
    skipped, counted and logged, the scale backs off after the hysteresis (2), the learning
    rate schedule stays put, the weights stay the (fp16-rounded) initial ones and the
    checkpoint carries the scaler's state."""
    ckpt = tmp_path / "ckpt"
    assert main(flags(corpus, tmp_path, "--fp16", "--train-iters", "4", "--log-interval", "1",
                      "--eval-iters", "0", "--save", str(ckpt))) == 0
    out = capsys.readouterr().out
    assert "loss scaling: dynamic from 4.29497e+09" in out
    assert "iteration 1: fp16 gradient overflow at loss scale 4.29497e+09; step skipped" in out
    assert "loss scale: 536870912.0 | number of skipped iterations:   4 |" in out
    assert records(tmp_path, "loss_scale") == {1: 2.0**32, 2: 2.0**31, 3: 2.0**30, 4: 2.0**29}
    assert records(tmp_path, "skipped_iterations") == {1: 1, 2: 2, 3: 3, 4: 4}
    assert len(set(records(tmp_path, "lr").values())) == 1  # the schedule did not advance
    assert records(tmp_path, "consumed_samples")[4] == 32  # the batches were consumed
    saved = load_checkpoint(ckpt)
    assert saved.optimizer == {}  # no update ever ran: Adam has no state
    assert saved.metadata["grad_scaler"] == {"scale": 2.0**29, "growth_tracker": 0,
                                             "hysteresis_tracker": -2}
    cfg = RunConfig.from_dict(saved.metadata["config"])
    model = GPTModel(cfg.model)
    init_parameters(model, cfg.model, cfg.training.seed)
    names = {**{n: n for n, _ in model.named_parameters()}, **model.checkpoint_names}
    for name, param in model.named_parameters():
        assert torch.equal(saved.model[names[name]], param.detach().half().float()), name


def test_fp16_resumes_with_its_loss_scale(corpus, tmp_path):
    """A scale that grows and backs off during the run: 12 iterations straight equal 6, then 6
    more resumed from the checkpoint (losses and scales)."""
    scaling = ["--fp16", "--initial-loss-scale", "32768", "--loss-scale-window", "2",
               "--hysteresis", "1", "--log-interval", "1", "--eval-iters", "0",
               "--train-iters", "12"]
    straight, resumed = tmp_path / "a", tmp_path / "b"
    assert main(flags(corpus, straight, *scaling)) == 0
    ckpt = str(resumed / "ckpt")
    assert main(flags(corpus, resumed, *scaling, "--save", ckpt, "--exit-interval", "6")) == 0
    assert main(flags(corpus, resumed, *scaling, "--save", ckpt, "--load", ckpt)) == 0
    scales = records(straight, "loss_scale")
    assert len(set(scales.values())) > 2  # the scale really moved
    assert records(resumed, "loss_scale") == scales
    assert records(resumed) == records(straight)
