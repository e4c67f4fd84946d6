"""The LLaMA-style model: layout, split independence, attention, recompute, precision."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.tiny_models import build, tiny


def test_parameter_names_are_global_and_split_independent():
    cfg = tiny()
    full = build(cfg)
    stage0 = build(cfg, layer_range=(0, 3), post_process=False)
    stage1 = build(cfg, layer_range=(3, 4), pre_process=False)
    names1 = [n for n, _ in stage1.named_parameters()]
    assert names1[0] == "decoder.layers.3.input_layernorm.weight"
    assert "embedding.word_embeddings.weight" not in names1
    assert "output_layer.weight" in names1
    full_state = dict(full.named_parameters())
    for stage in (stage0, stage1):
        for name, p in stage.named_parameters():
            assert torch.equal(p, full_state[name]), name
    assert set(dict(stage0.named_parameters())) | set(names1) == set(full_state)


def test_stages_compose_to_the_full_model():
    cfg = tiny()
    full, s0, s1 = (build(cfg), build(cfg, layer_range=(0, 2), post_process=False),
                    build(cfg, layer_range=(2, 4), pre_process=False))
    tokens = torch.randint(0, 128, (2, 16))
    hidden = s0(tokens=tokens)
    assert hidden.shape == (2, 16, 64)
    torch.testing.assert_close(s1(hidden_states=hidden), full(tokens=tokens))


def test_attention_is_causal():
    model = build(tiny())
    tokens = torch.randint(0, 128, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 128
    a, b = model(tokens=tokens), model(tokens=changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def naive_layer_attention(layer, x, cfg):
    """Reference GQA attention written out head by head from the fused weights."""
    nh, ng, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    w = layer.self_attention.linear_qkv.weight.view(ng, (nh // ng + 2) * d, -1)
    h = layer.input_layernorm(x)[0]  # [s, h]
    s = h.shape[0]
    pos = torch.arange(s, dtype=torch.float32)
    inv = 1.0 / (cfg.rotary_base ** (torch.arange(0, d, 2).float() / d))
    ang = torch.outer(pos, inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(t):
        t1, t2 = t[..., : d // 2], t[..., d // 2:]
        return t * cos + torch.cat([-t2, t1], -1) * sin

    outs = []
    for head in range(nh):
        g, j = divmod(head, nh // ng)
        q = rope(h @ w[g, j * d:(j + 1) * d].T)
        k = rope(h @ w[g, (nh // ng) * d:(nh // ng + 1) * d].T)
        v = h @ w[g, (nh // ng + 1) * d:].T
        scores = (q @ k.T) / math.sqrt(d)
        scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), -1e9)
        outs.append(F.softmax(scores, -1) @ v)
    return torch.cat(outs, -1) @ layer.self_attention.linear_proj.weight.T


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_grouped_query_attention_matches_reference(groups):
    cfg = tiny(num_query_groups=groups)
    layer = build(cfg).decoder.layers["0"]
    x = torch.randn(1, 16, 64)
    got = layer.self_attention(layer.input_layernorm(x))[0]
    torch.testing.assert_close(got, naive_layer_attention(layer, x, cfg), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_identical_gradients(mode):
    tokens = torch.randint(0, 128, (2, 17))
    grads = {}
    for m in ("none", mode):
        model = build(tiny(recompute=m))
        model(tokens=tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        grads[m] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads[mode][name], g, rtol=0, atol=0)


def test_loss_is_per_token_cross_entropy_and_bf16_is_close():
    model = build(tiny())
    tokens = torch.randint(0, 128, (2, 17))
    loss = model(tokens=tokens[:, :-1], labels=tokens[:, 1:])
    logits = model(tokens=tokens[:, :-1])
    ref = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    torch.testing.assert_close(loss.flatten(), ref)
    assert abs(loss.mean().item() - math.log(128)) < 0.5  # near-uniform at init
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_bf16 = model(tokens=tokens[:, :-1], labels=tokens[:, 1:])
    assert loss_bf16.dtype == torch.float32
    assert abs(loss_bf16.mean().item() - loss.mean().item()) < 2e-2


def test_parameter_count_and_flops():
    cfg = tiny()
    model = build(cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    # 6 x params (matmul weights, embedding lookup excluded) plus attention, per token
    matmul_params = cfg.num_parameters() - cfg.vocab_size * cfg.hidden_size \
        - (2 * cfg.num_layers + 1) * cfg.hidden_size
    attn = 3 * 2 * cfg.num_layers * 2 * cfg.seq_length * cfg.hidden_size
    assert cfg.flops_per_token() == 6 * matmul_params + attn
