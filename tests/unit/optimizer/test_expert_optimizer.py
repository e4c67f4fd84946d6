"""The optimizer of a stage with expert parallelism, in one process: the routed experts'
parameters form a second optimizer (over the expert-DP group under EP), and the pair steps,
clips, reports and restores exactly as one optimizer over every parameter."""

from __future__ import annotations

import pytest
import torch

from megatron_h2.config import OptimizerConfig
from megatron_h2.models import GPTModel, init_parameters
from megatron_h2.optimizer.expert_optimizer import (
    ExpertSplitOptimizer,
    build_stage_optimizer,
    is_expert_param,
)
from tests.unit.models.test_moe import moe_config


def trained(split: bool, sharded: bool, steps: int = 3):
    config = moe_config()
    model = GPTModel(config)
    init_parameters(model, config, seed=3)
    # the same (single) rank in both groups, but listed apart: a split optimizer in one process
    edp_ranks = [1] if split else [0]
    opt = build_stage_optimizer(model, OptimizerConfig(lr=1e-2, weight_decay=0.1), None, [0],
                                None, edp_ranks, use_distributed_optimizer=sharded,
                                overlap=False)
    train_steps(model, opt, config, steps)
    return model, opt


def train_steps(model, opt, config, steps: int, seed: int = 0) -> None:
    """``steps`` steps of random tokens (seeded), clipped, at a fixed learning rate."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=gen)
        opt.zero_grad()
        model(tokens, labels=torch.roll(tokens, -1, 1)).mean().backward()
        opt.grad_buckets.finish_sync()
        opt.clip_(0.5)
        opt.set_lr(1e-2)
        opt.step()


@pytest.mark.parametrize("sharded", [False, True])
def test_split_optimizer_equals_one_optimizer(sharded):
    one_model, one = trained(False, sharded)
    split_model, split = trained(True, sharded)
    assert isinstance(split, ExpertSplitOptimizer) and not isinstance(one, ExpertSplitOptimizer)
    experts = [n for n, p in split_model.named_parameters() if is_expert_param(p)]
    assert experts and all(".mlp.experts.local_experts." in n for n in experts)
    assert_same_training(one_model, one, split_model, split)
    names_one = {p: n for n, p in one_model.named_parameters()}
    names_split = {p: n for n, p in split_model.named_parameters()}
    state_split = split.named_state(names_split)
    grads = {names_split[p]: g for p, g in split.owned_grads()}
    assert set(grads) == {names_one[p] for p, _ in one.owned_grads()}
    split.load_named_state(names_split, state_split)  # each part takes its own
    split.load_main_weights(split.main_weights())


def assert_same_training(model_a, opt_a, model_b, opt_b) -> None:
    """Bit for bit the same parameters (names, order, values) and optimizer state by name."""
    assert list(model_a.state_dict()) == list(model_b.state_dict())
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name
    names_a = {p: n for n, p in model_a.named_parameters()}
    names_b = {p: n for n, p in model_b.named_parameters()}
    state_a, state_b = opt_a.named_state(names_a), opt_b.named_state(names_b)
    assert sorted(state_a) == sorted(state_b)
    for key, value in state_a.items():
        assert value.shape == state_b[key].shape and torch.equal(value, state_b[key]), key
