"""The loss as Megatron normalises it: --eod-mask-loss and --calculate-per-token-loss against a
reference gradient, in one training step."""

import pytest

from megatron_h2.config import TrainingConfig


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
