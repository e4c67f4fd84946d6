"""The routed experts' parameters stepped over as flat tensors (one per run of them in a
gradient bucket) under the replicated optimizer: the same numbers bit for bit as one tensor
per expert, the same names, state dict and optimizer state by name, and a checkpoint's state
loads back into the runs."""

from __future__ import annotations

import pytest

from megatron_h2.config import OptimizerConfig
from megatron_h2.models import GPTModel, init_parameters
from megatron_h2.optimizer.expert_optimizer import build_stage_optimizer, is_expert_param
from tests.unit.models.test_moe import moe_config
from tests.unit.optimizer.test_expert_optimizer import assert_same_training, train_steps

CONFIG = OptimizerConfig(lr=1e-2, weight_decay=0.1)


def build(flat: bool, split: bool, bias: bool = False):
    """A MoE model (Mixtral-like without biases: a layer's expert weights lie side by side in
    the bucket; with biases, weights and biases alternate, no two alike) and its optimizer."""
    config = moe_config(add_bias_linear=bias)
    model = GPTModel(config)
    init_parameters(model, config, seed=3)
    # split: the experts' own optimizer (EP's expert-DP group, here the same single rank)
    opt = build_stage_optimizer(model, CONFIG, None, [0], None, [1] if split else [0],
                                overlap=False, flat_experts=flat)
    return model, opt


def train(model, opt, steps: int, seed: int = 0) -> None:
    train_steps(model, opt, model.config, steps, seed)


def runs_of(opt) -> list:
    return [run for part in getattr(opt, "parts", (opt,)) for run in part.runs]


@pytest.mark.parametrize("split", [False, True])
def test_flat_runs_step_bit_for_bit_as_one_tensor_per_expert(split):
    per_tensor = build(False, split)
    flat = build(True, split)
    runs = runs_of(flat[1])
    # one run per MoE layer among the dense parameters; all of them when apart
    assert len(runs) == (1 if split else 2) and not runs_of(per_tensor[1])
    flattened = [p for run in runs for p in run.params]
    assert all(is_expert_param(p) for p in flattened)
    assert len(flattened) == sum(is_expert_param(p) for p in flat[0].parameters())
    for run in runs:  # the weights are views of the flat tensor, the grads of the bucket
        for param, view in run.views(run.flat):
            assert param.data_ptr() == view.data_ptr()
    held = sum(len(g["params"]) for g in flat[1].param_groups)
    assert held == sum(len(g["params"]) for g in per_tensor[1].param_groups) \
        - len(flattened) + len(runs)
    for model, opt in (per_tensor, flat):
        train(model, opt, 3)
    assert_same_training(*per_tensor, *flat)


def test_with_biases_nothing_is_flattened_and_the_numbers_stay():
    """Expert weights (decayed) and biases (not) alternate in the bucket: no run forms."""
    per_tensor, flat = build(False, False, bias=True), build(True, False, bias=True)
    assert not runs_of(flat[1])
    for model, opt in (per_tensor, flat):
        train(model, opt, 2)
    assert_same_training(*per_tensor, *flat)


def test_named_state_loads_back_into_flat_runs():
    """The state of a per-tensor run loads into a flat one (and back): the next steps agree."""
    per_tensor, flat = build(False, False), build(True, False)
    train(*per_tensor, 2)
    names = {p: n for n, p in per_tensor[0].named_parameters()}
    state = per_tensor[1].named_state(names)
    flat[1].load_main_weights({q: p.detach().clone() for q, p in zip(
        flat[0].parameters(), per_tensor[0].parameters())})
    flat[1].load_named_state({p: n for n, p in flat[0].named_parameters()}, state)
    for model, opt in (per_tensor, flat):
        train(model, opt, 2, seed=1)
    assert_same_training(*per_tensor, *flat)
