"""AdamW parameter groups, the learning-rate schedule, and named optimizer state."""

import math

import pytest
import torch

from megatron_h2.config import ModelConfig, OptimizerConfig
from megatron_h2.errors import ConfigError
from megatron_h2.models.gpt import GPTModel, init_parameters
from megatron_h2.optimizer import (
    LRSchedule,
    build_optimizer,
    load_named_optimizer_state,
    optimizer_state_to_named,
)


def test_warmup_then_cosine_and_linear_decay():
    cos = LRSchedule(OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=10), train_iters=110)
    assert cos.lr_at(1) == pytest.approx(0.1) and cos.lr_at(10) == pytest.approx(1.0)
    assert cos.lr_at(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert cos.lr_at(110) == pytest.approx(0.1) and cos.lr_at(500) == pytest.approx(0.1)
    lin = LRSchedule(OptimizerConfig(lr=1.0, min_lr=0.0, lr_warmup_iters=0,
                                     lr_decay_style="linear"), train_iters=100)
    assert lin.lr_at(25) == pytest.approx(0.75)
    const = LRSchedule(OptimizerConfig(lr=0.5, lr_warmup_iters=2, lr_decay_style="constant"), 9)
    assert const.lr_at(1) == pytest.approx(0.25) and const.lr_at(9) == 0.5
    values = [cos.lr_at(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert not math.isnan(cos.lr_at(0))


def test_bad_schedule():
    with pytest.raises(ConfigError, match="--lr-warmup-iters 50 exceeds"):
        LRSchedule(OptimizerConfig(lr_warmup_iters=50), train_iters=20)
    with pytest.raises(ConfigError, match="--lr-decay-style"):
        OptimizerConfig(lr_decay_style="step")


def _model():
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8,
                      vocab_size=64, ffn_hidden_size=64)
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
