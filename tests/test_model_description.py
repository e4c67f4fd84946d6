"""One model description: what the planner plans for is what the runtime builds."""

from __future__ import annotations

import pytest
import torch

from megatron_h2.config import ModelConfig, state_bytes_per_param
from megatron_h2.models.gpt import GPTModel
from megatron_h2.optimizer import build_data_parallel_optimizer
from megatron_h2.parallel import get_tp_shard
from megatron_h2.planner.model import model_from_dict
from megatron_h2.training.arguments import config_from_args

SHAPES = [  # layers, hidden, ffn, heads, groups, seq, tokenizer vocab
    (2, 64, 176, 4, 2, 32, 1000),
    (3, 128, 352, 8, 8, 64, 4096),
    (1, 96, 256, 6, 3, 16, 257),
    (4, 256, 704, 8, 4, 128, 50257),
]


def _runtime_config(shape) -> ModelConfig:
    """The model pretrain_gpt.py builds for these flags (as training/main.py pads the vocab)."""
    layers, hidden, ffn, heads, groups, seq, vocab = shape
    cfg, _ = config_from_args(["--num-layers", str(layers), "--hidden-size", str(hidden),
                               "--ffn-hidden-size", str(ffn), "--num-attention-heads", str(heads),
                               "--num-query-groups", str(groups), "--seq-length", str(seq)])
    cfg.model.vocab_size = cfg.data.padded_vocab_size(vocab)
    return cfg.model


def _planner_model(shape) -> ModelConfig:
    layers, hidden, ffn, heads, groups, seq, vocab = shape
    return model_from_dict({"num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn,
                            "num_attention_heads": heads, "num_query_groups": groups,
                            "seq_length": seq, "vocab_size": vocab})


def _per_rank(params, tp: int) -> float:
    """Elements one of ``tp`` ranks holds, from the runtime's own sharding metadata."""
    return sum(p.numel() / tp if get_tp_shard(p) is not None else p.numel() for p in params)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[1]}-v{s[6]}")
def test_planner_counts_what_the_runtime_builds(shape):
    planner, runtime = _planner_model(shape), _runtime_config(shape)
    assert planner.vocab_size == runtime.vocab_size  # one padding rule
    model = GPTModel(runtime)
    assert planner.num_parameters() == sum(p.numel() for p in model.parameters())
    layer = list(model.decoder.layers["0"].parameters())
    head = [*model.output_layer.parameters(), *model.decoder.final_layernorm.parameters()]
    for tp in (1, 2, 4, 8):
        if runtime.num_query_groups % tp or runtime.ffn_hidden_size % tp:
            continue
        assert planner.layer_params_per_chip(tp) == _per_rank(layer, tp)
        assert planner.embedding_params_per_chip(tp) == _per_rank(
            model.embedding.parameters(), tp)
        assert planner.head_params_per_chip(tp) == _per_rank(head, tp)


def test_flops_follow_the_same_counts():
    model = _planner_model(SHAPES[1])
    tokens = 10
    matmul = 2 * tokens * model.layer_matrix_params
    assert model.layer_forward_flops(tokens, causal=False) == matmul \
        + tokens * 4 * model.seq_length * model.hidden_size
    assert model.layer_forward_flops(tokens) == matmul \
        + tokens * 2 * model.seq_length * model.hidden_size
    assert model.flops_per_token() == 3 * (model.num_layers * model.layer_forward_flops(1, False)
                                           + model.head_forward_flops(1))


def _state_bytes(model: torch.nn.Module, optimizer) -> int:
    """Bytes of every distinct tensor storage holding weights, gradients or optimizer state."""
    tensors = list(model.parameters())
    tensors += [bucket.buffer for bucket in optimizer.grad_buckets.buckets]
    inner = optimizer.optimizer
    for group in inner.param_groups:
        tensors += group["params"]
    for state in inner.state.values():
        tensors += [v for k, v in state.items() if k != "step"]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "zero1"])
def test_state_bytes_per_param_match_the_runtime_optimizer(distributed):
    cfg = _runtime_config(SHAPES[1])
    model = GPTModel(cfg)
    optimizer = build_data_parallel_optimizer(model, config_from_args([])[0].optimizer, None,
                                              use_distributed_optimizer=distributed)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    model(tokens=tokens, labels=tokens).mean().backward()
    optimizer.grad_buckets.finish_sync()
    optimizer.step()  # Adam's moments exist from the first step on
    per_param = _state_bytes(model, optimizer) / cfg.num_parameters()
    assert per_param == pytest.approx(state_bytes_per_param(False, 1, distributed), rel=1e-3)
