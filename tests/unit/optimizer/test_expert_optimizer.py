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
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=gen)
        opt.zero_grad()
        model(tokens, labels=torch.roll(tokens, -1, 1)).mean().backward()
        opt.grad_buckets.finish_sync()
        opt.clip_(0.5)
        opt.set_lr(1e-2)
        opt.step()
    return model, opt


@pytest.mark.parametrize("sharded", [False, True])
def test_split_optimizer_equals_one_optimizer(sharded):
    one_model, one = trained(False, sharded)
    split_model, split = trained(True, sharded)
    assert isinstance(split, ExpertSplitOptimizer) and not isinstance(one, ExpertSplitOptimizer)
    experts = [n for n, p in split_model.named_parameters() if is_expert_param(p)]
    assert experts and all(".mlp.experts.local_experts." in n for n in experts)
    for (name, a), b in zip(one_model.named_parameters(), split_model.parameters()):
        assert torch.equal(a, b), name
    names_one = {p: n for n, p in one_model.named_parameters()}
    names_split = {p: n for n, p in split_model.named_parameters()}
    state_one, state_split = one.named_state(names_one), split.named_state(names_split)
    assert sorted(state_one) == sorted(state_split)
    assert all(torch.equal(state_one[k], state_split[k]) for k in state_one)
    grads = {names_split[p]: g for p, g in split.owned_grads()}
    assert set(grads) == {names_one[p] for p, _ in one.owned_grads()}
    split.load_named_state(names_split, state_split)  # each part takes its own
    split.load_main_weights(split.main_weights())
