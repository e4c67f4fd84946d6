"""The architecture the flags select, piece by piece: norms, activations, positions, head size,
and the embedding tied to the output layer, also across pipeline stages.

(The whole GPT is checked against transformers' GPT2LMHeadModel in
test_convert_architectures.py, the LLaMA against LlamaForCausalLM in test_convert_checkpoint.py.)
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_h2.config import ModelConfig
from megatron_h2.devices.kernels import Kernels
from megatron_h2.models.gpt import GPTModel, init_parameters
from megatron_h2.models.gpt.layers import MLP, Norm, RotaryEmbedding
from megatron_h2.parallel import TPContext


def gpt(**kw) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16,
                vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)
    return ModelConfig(**{**base, **kw})


def build(cfg: ModelConfig, seed: int = 3, **kw) -> GPTModel:
    model = GPTModel(cfg, **kw)
    init_parameters(model, cfg, seed)
    return model


TOKENS = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))


def test_tied_output_layer_multiplies_by_the_word_embedding():
    model = build(gpt())
    assert model.output_layer.weight is None and "output_layer.weight" not in dict(
        model.named_parameters())
    hidden = model.decoder(model.embedding(TOKENS[:, :-1]))
    logits = model(tokens=TOKENS[:, :-1])
    torch.testing.assert_close(logits, hidden @ model.embedding.word_embeddings.weight.T)


def test_tied_embedding_across_two_stages_equals_one_model():
    """The last stage's copy starts equal to the embedding, and the two copies' gradients sum
    to the one model's (what the training step exchanges between the stages)."""
    cfg = gpt()
    full = build(cfg)
    first = build(cfg, layer_range=(0, 2), post_process=False)
    last = build(cfg, layer_range=(2, 4), pre_process=False)
    assert last.checkpoint_names == {"output_layer.weight": "embedding.word_embeddings.weight"}
    embedding = first.embedding.word_embeddings.weight
    assert torch.equal(last.output_layer.weight, embedding)
    assert first.tied_embedding_weight() is embedding
    assert last.tied_embedding_weight() is last.output_layer.weight
    assert full.tied_embedding_weight() is None  # one stage: one tensor, nothing to exchange
    tokens, labels = TOKENS[:, :-1], TOKENS[:, 1:]
    full(tokens=tokens, labels=labels).mean().backward()
    loss = last(hidden_states=first(tokens=tokens), labels=labels)
    torch.testing.assert_close(loss, full(tokens=tokens, labels=labels))
    loss.mean().backward()
    assert not torch.allclose(embedding.grad, full.embedding.word_embeddings.weight.grad)
    torch.testing.assert_close(embedding.grad + last.output_layer.weight.grad,
                               full.embedding.word_embeddings.weight.grad)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_1p_stores_a_zero_centred_scale(normalization):
    plain = Norm(gpt(normalization=normalization), Kernels())
    centred = Norm(gpt(normalization=normalization, apply_layernorm_1p=True), Kernels())
    assert (plain.bias is None) == (normalization == "RMSNorm")
    assert torch.equal(centred.weight, torch.zeros(64))
    with torch.no_grad():
        plain.weight.copy_(torch.linspace(0.5, 1.5, 64))
        centred.weight.copy_(plain.weight - 1.0)
        if plain.bias is not None:
            plain.bias.fill_(0.3)
            centred.bias.fill_(0.3)
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(centred(x), plain(x))
    ref = F.layer_norm(x, (64,), plain.weight, plain.bias, 1e-5) if plain.bias is not None \
        else x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * plain.weight
    torch.testing.assert_close(plain(x), ref)


@pytest.mark.parametrize("flags, expected", [
    ({}, lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))),
    ({"bias_gelu_fusion": False}, lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))),
    ({"add_bias_linear": False}, lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))),
    ({"squared_relu": True}, lambda x: F.relu(x) ** 2),
    ({"swiglu": True}, lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]),
])
def test_mlp_activation_follows_the_flags(flags, expected):
    cfg = gpt(**flags)
    mlp = MLP(cfg, Kernels(), TPContext.single())
    width = 2 * cfg.ffn_hidden_size if cfg.swiglu else cfg.ffn_hidden_size
    assert mlp.linear_fc1.out_features == width
    assert cfg.ffn_hidden_size == (int(4 * 64 * 2 / 3 / 64) * 64 if cfg.swiglu else 4 * 64)
    assert (mlp.linear_fc1.bias is not None) == cfg.add_bias_linear
    x = torch.randn(3, width) * 3
    torch.testing.assert_close(mlp.activation(x), expected(x), atol=1e-6, rtol=1e-5)


def test_partial_rotary_rotates_only_the_first_dimensions():
    cfg = gpt(position_embedding_type="rope", rotary_percent=0.5)
    rope = RotaryEmbedding(cfg)
    x = torch.randn(1, 2, 16, cfg.kv_channels)
    out = rope(x)
    assert rope.rotary_dim == 8 and torch.equal(out[..., 8:], x[..., 8:])
    assert not torch.allclose(out[..., :8], x[..., :8])
    full = RotaryEmbedding(gpt(position_embedding_type="rope", kv_channels=8))
    torch.testing.assert_close(out[..., :8], full(x[..., :8]))


def test_rotary_interpolation_divides_the_positions():
    scaled = RotaryEmbedding(gpt(position_embedding_type="rope",
                                 rotary_seq_len_interpolation_factor=4, seq_length=64))
    plain = RotaryEmbedding(gpt(position_embedding_type="rope", seq_length=64))
    torch.testing.assert_close(scaled.cos[8], plain.cos[2])  # position 8 / 4 = position 2


@pytest.mark.parametrize("kind", ["learned_absolute", "rope", "none"])
def test_position_information_follows_the_flag(kind):
    """Swapping two earlier tokens changes the last token's output of one layer, except with no
    positions at all (its causal attention then sees the earlier tokens as a set)."""
    model = build(gpt(position_embedding_type=kind, num_layers=1))
    assert (model.embedding.position_embeddings is not None) == (kind == "learned_absolute")
    tokens = TOKENS[:1, :8]
    swapped = tokens[:, [1, 0, *range(2, 8)]]
    a, b = model(tokens=tokens)[0, -1], model(tokens=swapped)[0, -1]
    assert torch.allclose(a, b, atol=1e-5) == (kind == "none")


def test_kv_channels_are_decoupled_from_the_hidden_size():
    cfg = gpt(kv_channels=24, group_query_attention=True, num_query_groups=2)
    model = build(cfg)
    attn = model.decoder.layers["0"].self_attention
    assert attn.linear_qkv.out_features == (4 + 2 * 2) * 24
    assert attn.linear_proj.in_features == 4 * 24
    assert model(tokens=TOKENS[:, :-1], labels=TOKENS[:, 1:]).shape == (2, 16)
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())


def test_init_follows_megatron():
    """Biases zero, norm scales one, matrices N(0, std), output projections N(0, std /
    sqrt(2 L)), embeddings N(0, std)."""
    cfg = gpt(num_layers=8, hidden_size=256, num_attention_heads=8, init_method_std=0.01,
              vocab_size=1024, seq_length=256)
    params = dict(build(cfg).named_parameters())
    assert torch.equal(params["decoder.layers.0.mlp.linear_fc1.bias"], torch.zeros(1024))
    assert torch.equal(params["decoder.layers.0.input_layernorm.weight"], torch.ones(256))
    for name, std in (("decoder.layers.0.mlp.linear_fc1.weight", 0.01),
                      ("decoder.layers.3.self_attention.linear_proj.weight", 0.01 / 4),
                      ("decoder.layers.5.mlp.linear_fc2.weight", 0.01 / 4),
                      ("embedding.word_embeddings.weight", 0.01),
                      ("embedding.position_embeddings.weight", 0.01)):
        assert params[name].std().item() == pytest.approx(std, rel=0.05), name
