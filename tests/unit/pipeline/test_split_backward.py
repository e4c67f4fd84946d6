"""Zero-bubble's backward split: B computes the input gradient only, W the weight gradients
later; together they do one backward's work and give the same gradients."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_h2.config import ModelConfig
from megatron_h2.models.gpt import GPTModel, init_parameters
from megatron_h2.pipeline.split_backward import backward_input, backward_weight


def chunk_model(recompute: str = "none", post: bool = True) -> GPTModel:
    cfg = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=64, seq_length=16, vocab_size=128, recompute=recompute,
                      hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, chunks=[(0, 1), (1, 3)], pre_process=True, post_process=post)
    init_parameters(model, cfg, seed=5)
    return model


def run(model: GPTModel, x: torch.Tensor, labels: torch.Tensor, chunk: int = 1) -> torch.Tensor:
    out = model(hidden_states=x, labels=labels, chunk=chunk)
    return out.sum() if out.dim() == 2 else out


def grads(model: GPTModel) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recompute, post", [("none", True), ("selective", True),
                                             ("none", False)])
def test_split_gives_the_same_gradients_and_defers_the_weight_work(recompute, post):
    torch.manual_seed(0)
    model = chunk_model(recompute, post)
    params = model.chunk_parameters(1)
    xs = [torch.randn(2, 16, 32) for _ in range(2)]
    labels = [torch.randint(0, 128, (2, 16)) for _ in range(2)]
    out_grad = None if post else torch.randn(2, 16, 32)

    # reference: two whole backwards, gradients accumulated
    ref_in, flops_full = [], 0
    for x, y in zip(xs, labels):
        x = x.clone().requires_grad_()
        out = run(model, x, y)
        with FlopCounterMode(display=False) as counter:
            torch.autograd.backward(out, out_grad)
        flops_full += counter.get_total_flops()
        ref_in.append(x.grad)
    reference = grads(model)
    model.zero_grad(set_to_none=True)

    fired: list[str] = []
    name_of = {p: n for n, p in model.named_parameters()}
    hooks = [p.register_post_accumulate_grad_hook(lambda p: fired.append(name_of[p]))
             for p in params]
    pending, flops_b, flops_w = [], 0, 0
    for x, y, want in zip(xs, labels, ref_in):
        x = x.clone().requires_grad_()
        out = run(model, x, y)
        with FlopCounterMode(display=False) as counter:
            grad_in, weights = backward_input(out, out_grad, x, params)
        flops_b += counter.get_total_flops()
        assert torch.equal(grad_in, want)
        pending.append(weights)
    assert all(p.grad is None for p in params) and not fired  # nothing reached the weights yet
    for weights in pending:
        with FlopCounterMode(display=False) as counter:
            backward_weight(weights)
        flops_w += counter.get_total_flops()
    for h in hooks:
        h.remove()
    got = grads(model)
    assert sorted(got) == sorted(reference)
    for name, g in reference.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=1e-6, msg=name)
    assert sorted(fired) == sorted([name_of[p] for p in params] * 2)  # hooks fire in W
    # B + W is one backward's work, each a real share of it
    assert flops_b + flops_w == flops_full
    assert 0.3 * flops_full < flops_b < 0.7 * flops_full


def test_without_an_input_gradient_the_whole_backward_is_deferred():
    """The first virtual stage (token ids in): B does nothing, W the whole backward."""
    model = chunk_model()
    tokens, labels = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
    model(tokens=tokens, chunk=0).sum().backward()
    reference = grads(model)
    model.zero_grad(set_to_none=True)
    out = model(tokens=tokens, chunk=0)
    grad_in, weights = backward_input(out.sum(), None, None, model.chunk_parameters(0))
    assert grad_in is None and all(p.grad is None for p in model.parameters())
    backward_weight(weights)
    for name, g in grads(model).items():
        assert torch.equal(g, reference[name]), name
    assert set(grads(model)) == set(reference)
    del labels


def test_unsplit_backward_for_full_recompute():
    model = chunk_model("full")
    x = torch.randn(2, 16, 32, requires_grad=True)
    y = torch.randint(0, 128, (2, 16))
    run(model, x, y).backward()
    reference, ref_in = grads(model), x.grad.clone()
    model.zero_grad(set_to_none=True)
    x.grad = None
    grad_in, weights = backward_input(run(model, x, y), None, x, model.chunk_parameters(1),
                                      split=False)
    assert grad_in is None  # deferred whole
    backward_weight(weights)
    assert torch.equal(x.grad, ref_in)
    for name, g in grads(model).items():
        assert torch.equal(g, reference[name]), name
