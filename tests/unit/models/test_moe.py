"""Mixture-of-experts layers against hand-derived formulas: Megatron-Core's parameter names,
top-k routing (softmax before / after the top-k, sigmoid, scaling, expert bias, groups), the
block's output as a per-token sum over its experts, the aux / sequence-aux / z losses and the
gradient they add, token dropping, and the expert-bias update rule."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_h2.config import ModelConfig
from megatron_h2.models import GPTModel, init_parameters
from megatron_h2.models.gpt.moe_layer import MoELayer
from megatron_h2.models.gpt.router import (
    MoEState,
    drop_tokens,
    expert_capacity,
    topk_routing,
)
from megatron_h2.parallel import TPContext
from tests.helpers.tolerances import summation_atol

E, H = 4, 16


def moe_config(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=2, seq_length=8,
                vocab_size=32, num_experts=E, ffn_hidden_size=24, moe_router_topk=2,
                hidden_dropout=0.0, attention_dropout=0.0)
    return ModelConfig(**{**base, **kw})


def make_layer(config: ModelConfig, seed: int = 0) -> MoELayer:
    from megatron_h2.devices.kernels import Kernels

    layer = MoELayer(config, Kernels(), TPContext.single(), 0, MoEState())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def test_parameter_names_are_megatron_cores_local_spec():
    cfg = moe_config(num_layers=3, moe_layer_freq=[0, 1, 1], swiglu=True,
                     add_bias_linear=False, moe_shared_expert_intermediate_size=32,
                     moe_shared_expert_gate=True)
    names = {n for n, _ in GPTModel(cfg).named_parameters()}
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names  # dense layer
    for i in (1, 2):
        assert f"decoder.layers.{i}.mlp.router.weight" in names
        for e in range(E):
            assert f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight" in names
            assert f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight" in names
        assert f"decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight" in names
        assert f"decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight" in names
        assert f"decoder.layers.{i}.mlp.shared_experts.gate_weight" in names
        assert f"decoder.layers.{i}.mlp.linear_fc1.weight" not in names
    model = GPTModel(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    # a pipeline stage holding layers 1-2 names them alike (global layer index)
    stage = GPTModel(cfg, layer_range=(1, 3), pre_process=False)
    assert {n for n, _ in stage.named_parameters()} - {"output_layer.weight"} <= names


@pytest.mark.parametrize("freq,moe", [(1, [0, 1, 2, 3]), (2, [0, 2]), (3, [0, 3]),
                                      ("([0]*1+[1]*3)", [1, 2, 3]),
                                      ("([1]*1+[0]*1)*2", [0, 2])])
def test_moe_layer_freq(freq, moe):
    from megatron_h2.config import parse_moe_layer_freq

    cfg = moe_config(num_layers=4, moe_layer_freq=parse_moe_layer_freq(str(freq)))
    assert cfg.moe_layers == moe


def test_router_init_is_megatrons():
    cfg = moe_config(add_bias_linear=True)
    model = GPTModel(cfg)
    init_parameters(model, cfg, seed=3)
    router = model.decoder.layers["0"].mlp.router
    assert router.bias.abs().sum() > 0  # drawn like the weight, as Megatron's init_method
    assert abs(float(router.weight.detach().std()) - cfg.init_method_std) < 0.01


def _logits(tokens: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, E, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_softmax_routing(pre_softmax):
    logits = _logits()
    cfg = moe_config(moe_router_pre_softmax=pre_softmax, moe_router_topk_scaling_factor=2.5)
    probs, routing_map = topk_routing(logits, cfg)
    top = logits.topk(2, dim=1).indices
    for t in range(logits.shape[0]):
        assert set(torch.nonzero(routing_map[t]).flatten().tolist()) == set(top[t].tolist())
        if pre_softmax:
            want = torch.softmax(logits[t], -1)[top[t]]
        else:
            want = torch.softmax(logits[t, top[t]], -1)
        torch.testing.assert_close(probs[t, top[t]], 2.5 * want)
    assert (probs[~routing_map] == 0).all()


def test_sigmoid_routing_with_expert_bias():
    logits = _logits()
    cfg = moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])  # expert 3 always chosen, its score unbiased
    probs, routing_map = topk_routing(logits, cfg, bias)
    assert routing_map[:, 3].all()
    scores = torch.sigmoid(logits)
    for t in range(logits.shape[0]):
        chosen = torch.nonzero(routing_map[t]).flatten()
        want = scores[t, chosen] / scores[t, chosen].sum()
        torch.testing.assert_close(probs[t, chosen], want)


def test_group_limited_routing():
    cfg = moe_config(num_experts=8, moe_router_topk=2, moe_router_num_groups=4,
                     moe_router_group_topk=1, moe_router_pre_softmax=True)
    logits = torch.full((1, 8), -5.0)
    logits[0, 0] = 3.0  # group 0 has the single best expert ...
    logits[0, 6], logits[0, 7] = 2.5, 2.5  # ... group 3 the best pair (sum of top-2 per group)
    _, routing_map = topk_routing(logits, cfg)
    assert torch.nonzero(routing_map[0]).flatten().tolist() == [6, 7]


def naive_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Per token: sum over its routed experts of prob x expert(token), plus shared experts."""
    b, s, h = x.shape
    tokens = x.transpose(0, 1).reshape(-1, h)
    logits = layer.router.gating(tokens)
    probs, routing_map = topk_routing(logits, layer.config)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for e in torch.nonzero(routing_map[t]).flatten().tolist():
            out[t] += probs[t, e] * layer.experts.local_experts[str(e)](tokens[t:t + 1])[0]
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(tokens)
    return out.view(s, b, h).transpose(0, 1)


@pytest.mark.parametrize("kw", [dict(), dict(swiglu=True, add_bias_linear=False),
                                dict(moe_shared_expert_intermediate_size=20, moe_router_topk=3,
                                     moe_ffn_hidden_size=12, moe_shared_expert_gate=True)])
def test_moe_block_is_the_sum_over_routed_experts(kw):
    layer = make_layer(moe_config(**kw))
    layer.eval()
    x = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = layer(x), naive_moe(layer, x)
    torch.testing.assert_close(got, want, atol=summation_atol(got, 8), rtol=0)


def aux_loss_by_hand(logits: torch.Tensor, k: int, coeff: float) -> torch.Tensor:
    scores = torch.softmax(logits, -1)
    t = logits.shape[0]
    routed = torch.zeros_like(scores).scatter(1, scores.topk(k, dim=1).indices, 1)
    f = routed.sum(0) / (t * k)  # fraction of the routed slots per expert
    p = scores.sum(0) / t  # mean probability per expert
    return coeff * E * (f * p).sum()


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss", "z"])
def test_losses_and_their_gradient(kind):
    coeff, scale = 0.1, 0.25
    kw = ({"moe_z_loss_coeff": coeff, "moe_router_load_balancing_type": "none"} if kind == "z"
          else {"moe_aux_loss_coeff": coeff, "moe_router_load_balancing_type": kind})
    layer = make_layer(moe_config(**kw))
    layer.router.state.loss_scale = scale
    b, s = 3, 4
    x = torch.randn(b, s, H, generator=torch.Generator().manual_seed(4))
    layer(x).sum().backward()
    got = layer.router.weight.grad.clone()
    recorded = layer.router.state.take_losses()

    layer.zero_grad()
    tokens = x.transpose(0, 1).reshape(-1, H)
    logits = layer.router.gating(tokens)
    if kind == "aux_loss":
        loss = aux_loss_by_hand(logits, 2, coeff)
    elif kind == "seq_aux_loss":  # per sequence, averaged over the batch
        per_seq = logits.view(s, b, E).transpose(0, 1)
        loss = sum(aux_loss_by_hand(per_seq[i], 2, coeff) for i in range(b)) / b
    else:
        loss = coeff * torch.logsumexp(logits, -1).square().mean()
    (naive_moe(layer, x).sum() + scale * loss).backward()
    torch.testing.assert_close(got, layer.router.weight.grad, atol=1e-5, rtol=1e-5)
    name = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
            "z": "z_loss"}[kind]
    assert recorded[name][0] == pytest.approx(float(loss.detach()) / coeff, rel=1e-5)


def test_no_losses_in_eval():
    layer = make_layer(moe_config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.1))
    layer.eval()
    layer(torch.randn(2, 3, H))
    assert layer.router.state.take_losses() == {}


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_token_dropping(policy):
    cfg = moe_config(moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy)
    logits = _logits(tokens=16)
    probs, routing_map = topk_routing(logits, cfg)
    capacity = expert_capacity(16, cfg)
    assert capacity == math.ceil(16 * 2 / E * 0.5) == 4
    kept_probs, kept = drop_tokens(probs, routing_map, cfg)
    for e in range(E):
        rows = torch.nonzero(routing_map[:, e]).flatten()
        if policy == "probs":
            want = set(rows[probs[rows, e].argsort(descending=True)[:capacity]].tolist())
        else:
            want = set(rows[:capacity].tolist())  # the first tokens in [s, b] order
        assert set(torch.nonzero(kept[:, e]).flatten().tolist()) == want
    assert (kept_probs[~kept] == 0).all() and (kept_probs[kept] == probs[kept]).all()


def test_pad_to_capacity_gives_each_expert_its_capacity():
    cfg = moe_config(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True)
    probs, routing_map = topk_routing(_logits(tokens=16), cfg)
    _, kept = drop_tokens(probs, routing_map, cfg)
    assert kept.sum(0).tolist() == [4] * E


def test_expert_bias_update_rule():
    cfg = moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_bias_update_rate=0.01)
    layer = make_layer(cfg)
    layer.train()
    x = torch.randn(2, 6, H)
    layer(x).sum().backward()
    counts = layer.router.local_tokens_per_expert.clone()
    assert counts.sum() == 2 * 6 * 2
    layer.router.update_expert_bias(torch.tensor([10.0, 2.0, 6.0, 6.0]))
    torch.testing.assert_close(layer.router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    assert layer.router.local_tokens_per_expert.sum() == 0
    assert "decoder.layers.0.mlp.router.expert_bias" in GPTModel(cfg).state_dict()


@pytest.mark.parametrize("kw,message", [
    (dict(moe_router_topk=5), "--moe-router-topk 5 must be between 1 and --num-experts 4"),
    (dict(moe_layer_freq=[1, 0, 1]), "--moe-layer-freq lists 3 layers but --num-layers is 2"),
    (dict(moe_expert_capacity_factor=0.0), "--moe-expert-capacity-factor 0"),
    (dict(moe_router_topk=1), "--moe-router-pre-softmax"),
    (dict(moe_router_enable_expert_bias=True), "--moe-router-score-function sigmoid"),
    (dict(moe_router_group_topk=2), "--moe-router-num-groups"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "must divide --num-experts 4"),
    (dict(moe_pad_expert_input_to_capacity=True), "needs --moe-expert-capacity-factor"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "sinkhorn is not implemented"),
    (dict(num_experts=None, moe_ffn_hidden_size=8), "needs --num-experts"),
])
def test_bad_moe_config_is_one_line(kw, message):
    from megatron_h2.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) \
            as exc:
        moe_config(**kw)
    assert "\n" not in str(exc.value)


def test_negative_capacity_factor_means_none_as_megatron():
    assert moe_config(moe_expert_capacity_factor=-1.0).moe_expert_capacity_factor is None
