"""AdamW parameter groups, the learning-rate schedule, and named optimizer state."""

import math

import pytest
import torch

from megatron_h2.config import ModelConfig, OptimizerConfig, RunConfig, TrainingConfig
from megatron_h2.errors import ConfigError
from megatron_h2.models.gpt import GPTModel, init_parameters
from megatron_h2.optimizer import (
    EMBEDDING_OR_OUTPUT,
    OptimizerParamScheduler,
    build_optimizer,
    load_named_optimizer_state,
    optimizer_state_to_named,
)


def _schedule(train_iters=None, train_samples=None, gbs=4, **opt):
    training = TrainingConfig(micro_batch_size=1, global_batch_size=gbs, train_iters=train_iters,
                              train_samples=train_samples)
    return OptimizerParamScheduler.from_config(OptimizerConfig(**opt), training)


def test_schedule_counts_samples_as_megatron():
    """Warm-up / decay lengths are samples (iterations x global batch); the rate for an
    iteration is the one for the samples consumed before it (Megatron's num_steps)."""
    cos = _schedule(110, lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_style="cosine")
    assert (cos.settings.lr_warmup_steps, cos.settings.lr_decay_steps) == (40, 440)
    assert cos.lr(0) == 0.0 and cos.lr(20) == pytest.approx(0.5) and cos.lr(40) == 1.0
    assert cos.lr(240) == pytest.approx(0.55) and cos.lr(440) == pytest.approx(0.1)
    assert cos.lr(10**6) == 0.1
    values = [cos.lr(s) for s in range(40, 445, 4)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    init = _schedule(110, lr=1.0, lr_warmup_iters=10, lr_warmup_init=0.2)
    assert init.lr(0) == 0.2 and init.lr(20) == pytest.approx(0.6)
    lin = _schedule(100, lr=1.0, lr_decay_style="linear")
    assert lin.lr(100) == pytest.approx(0.75)  # 25 of 100 iterations of 4 samples
    const = _schedule(9, lr=0.5, lr_warmup_iters=2, lr_decay_style="constant")
    assert const.lr(4) == pytest.approx(0.25) and const.lr(36) == 0.5
    frac = _schedule(100, lr=1.0, lr_warmup_fraction=0.1, lr_decay_iters=50)
    assert frac.settings.lr_warmup_steps == pytest.approx(20.0)  # 10% of 50 x 4 samples
    samples = _schedule(train_samples=1000, lr=1.0, min_lr=0.0, lr_warmup_samples=100,
                        lr_decay_samples=900)
    assert samples.lr(50) == pytest.approx(0.5) and samples.lr(500) == pytest.approx(0.5)
    assert samples.settings.wd_incr_steps == 1000
    isr = _schedule(100, lr=1.0, lr_warmup_iters=4, lr_decay_style="inverse-square-root")
    assert isr.lr(64) == pytest.approx(0.5)  # lr x sqrt(16 / 64)
    wsd = _schedule(100, lr=1.0, lr_decay_style="WSD", lr_wsd_decay_iters=10,
                    lr_wsd_decay_style="linear")
    assert wsd.lr(360) == 1.0 and wsd.lr(380) == pytest.approx(0.5)


def test_weight_decay_increment_styles():
    lin = _schedule(100, weight_decay_incr_style="linear", start_weight_decay=0.0,
                    end_weight_decay=0.1)
    assert lin.weight_decay(0) == 0.0 and lin.weight_decay(200) == pytest.approx(0.05)
    assert lin.weight_decay(401) == 0.1
    cos = _schedule(100, weight_decay_incr_style="cosine", start_weight_decay=0.0,
                    end_weight_decay=0.1)
    assert cos.weight_decay(100) == pytest.approx(0.05 * (1 - math.sqrt(0.5)))
    assert _schedule(100, weight_decay=0.3).weight_decay(123) == 0.3


def test_apply_sets_group_rates_and_decay():
    model = _model()
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, decoupled_lr=5.0, decoupled_min_lr=0.5,
                          weight_decay=0.2, lr_warmup_iters=2)
    opt = build_optimizer(model, cfg)
    names = {p: n for n, p in model.named_parameters()}
    special = [g for g in opt.param_groups if "max_lr" in g]
    assert sorted(names[p] for g in special for p in g["params"]) == sorted(EMBEDDING_OR_OUTPUT)
    training = TrainingConfig(micro_batch_size=1, global_batch_size=1, train_iters=10)
    sched = OptimizerParamScheduler.from_config(cfg, training)
    sched.step(2)  # end of the warm-up
    assert sched.apply(opt) == 1.0
    rates = {(g["max_lr"] if "max_lr" in g else None, g["wd_mult"]): (g["lr"], g["weight_decay"])
             for g in opt.param_groups}
    assert rates == {(None, 1.0): (1.0, 0.2), (None, 0.0): (1.0, 0.0), (5.0, 1.0): (5.0, 0.2)}
    sched.step(100)
    sched.apply(opt)
    assert sorted(g["lr"] for g in opt.param_groups) == [0.1, 0.1, 0.5]


def test_bad_schedule():
    with pytest.raises(ConfigError, match="--lr-warmup-iters 50 must be shorter"):
        RunConfig(optimizer=OptimizerConfig(lr_warmup_iters=50),
                  training=TrainingConfig(train_iters=20))
    with pytest.raises(ConfigError, match="--lr-decay-style"):
        OptimizerConfig(lr_decay_style="step")
    with pytest.raises(ConfigError, match="needs --lr-wsd-decay-iters"):
        _schedule(10, lr_decay_style="WSD")


def test_resuming_with_another_schedule_names_both_values():
    saved = _schedule(100, lr=1.0, lr_warmup_iters=10)
    saved.step(123)
    state = saved.state_dict()
    assert state["num_steps"] == 123 and state["lr_decay_steps"] == 400
    other = _schedule(100, lr=2.0, lr_warmup_iters=10)
    with pytest.raises(ConfigError) as err:
        other.load_state_dict(state)
    assert "max_lr 1.0 but this run has 2.0 (--lr)" in str(err.value)
    assert "--override-opt_param-scheduler" in str(err.value) and "\n" not in str(err.value)
    other.load_state_dict(state, override=True)
    assert other.settings.max_lr == 2.0 and other.num_steps == 123
    kept = _schedule(100, lr=2.0, lr_warmup_iters=10)
    kept.load_state_dict(state, use_checkpoint=True)
    assert kept.settings.max_lr == 1.0 and kept.lr(40) == 1.0


def _model():
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8,
                      vocab_size=64, ffn_hidden_size=64, untie_embeddings_and_output_weights=True)
    model = GPTModel(cfg)
    init_parameters(model, cfg, 0)
    return model


def test_norms_and_biases_get_no_weight_decay_and_state_round_trips():
    model = _model()  # Megatron's GPT: LayerNorms and linear layers with biases
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    # per layer two LayerNorms (scale, bias) and four linear biases; the final LayerNorm
    assert all(p.ndim == 1 for p in no_decay["params"]) and len(no_decay["params"]) == 8 + 2
    assert any(p is model.embedding.position_embeddings.weight for p in decay["params"])
    tokens = torch.randint(0, 64, (2, 9))
    model(tokens=tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    opt.step()
    names = {p: n for n, p in model.named_parameters()}
    named = optimizer_state_to_named(opt, names)
    assert "decoder.layers.0.mlp.linear_fc1.weight.exp_avg_sq" in named
    fresh = build_optimizer(model, OptimizerConfig(weight_decay=0.1))
    load_named_optimizer_state(fresh, names, named)
    assert optimizer_state_to_named(fresh, names).keys() == named.keys()
    for key, value in optimizer_state_to_named(fresh, names).items():
        assert torch.equal(value, named[key])
    del named["embedding.word_embeddings.weight.exp_avg"]
    with pytest.raises(ConfigError, match="lacks embedding.word_embeddings.weight.exp_avg"):
        load_named_optimizer_state(build_optimizer(model, OptimizerConfig()), names, named)


def test_distributed_optimizer_groups_decoupled_pieces():
    from megatron_h2.optimizer import build_data_parallel_optimizer

    model = _model()
    cfg = OptimizerConfig(lr=1.0, decoupled_lr=5.0, weight_decay=0.1)
    opt = build_data_parallel_optimizer(model, cfg, None, use_distributed_optimizer=True)
    names = {p: n for n, p in model.named_parameters()}
    piece_of = {id(piece.master): names[piece.param] for piece in opt.pieces}
    special = [piece_of[id(t)] for g in opt.param_groups if "max_lr" in g for t in g["params"]]
    assert sorted(special) == sorted(EMBEDDING_OR_OUTPUT)
    training = TrainingConfig(micro_batch_size=1, global_batch_size=1, train_iters=10)
    OptimizerParamScheduler.from_config(cfg, training).apply(opt)
    assert {g["lr"] for g in opt.param_groups if "max_lr" in g} == {5.0}
    assert {g["lr"] for g in opt.param_groups if "max_lr" not in g} == {1.0}
