"""One model description: what the planner plans for is what the runtime builds, for every
architecture the flags describe (GPT and LLaMA styles, biases, norms, positions, tied head)."""

from __future__ import annotations

import pytest
import torch

from megatron_h2.config import ModelConfig, state_bytes_per_param
from megatron_h2.models.gpt import GPTModel
from megatron_h2.optimizer import build_data_parallel_optimizer
from megatron_h2.parallel import get_tp_shard
from megatron_h2.planner.model_input import model_from_dict
from megatron_h2.training.arguments import config_from_args

SHAPES = [  # layers, hidden, ffn, heads, seq, tokenizer vocab
    (2, 64, 176, 4, 32, 1000),
    (3, 128, None, 8, 64, 4096),
    (1, 96, 256, 6, 16, 257),
    (4, 256, 704, 8, 128, 50257),
]
LLAMA = {"swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
         "disable_bias_linear": True, "untie_embeddings_and_output_weights": True}
VARIANTS = {  # architecture keys of a model file = pretrain_gpt.py flags
    "gpt": {},
    "llama_gqa": {**LLAMA, "group_query_attention": True, "num_query_groups": 2},
    "qkv_bias_relu2_1p_kv24_nopos": {
        "disable_bias_linear": True, "add_qkv_bias": True, "squared_relu": True,
        "apply_layernorm_1p": True, "kv_channels": 24, "position_embedding_type": "none"},
    "rope_partial_tied_swiglu": {
        "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
        "rotary_percent": 0.5, "group_query_attention": True, "num_query_groups": 1},
    "untied_gelu_longer_table": {"untie_embeddings_and_output_weights": True,
                                 "no_bias_gelu_fusion": True, "max_position_embeddings": 200},
}


def _argv(keys: dict) -> list[str]:
    argv = []
    for key, value in keys.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def _shape_keys(shape) -> dict:
    layers, hidden, ffn, heads, seq, vocab = shape
    keys = {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "seq_length": seq}
    if ffn is not None:
        keys["ffn_hidden_size"] = ffn
    return keys


def _runtime_config(shape, variant: dict) -> ModelConfig:
    """The model pretrain_gpt.py builds for these flags (as training/main.py pads the vocab)."""
    run = ["--data-path", "x", "--tokenizer-type", "NullTokenizer", "--micro-batch-size", "1",
           "--train-iters", "1", "--lr", "1e-4"]  # a real run, not the embedded demo
    cfg, _ = config_from_args(run + _argv({**_shape_keys(shape), **variant}))
    cfg.model.vocab_size = cfg.data.padded_vocab_size(shape[-1])
    return cfg.model


def _planner_model(shape, variant: dict) -> ModelConfig:
    return model_from_dict({**_shape_keys(shape), "vocab_size": shape[-1], **variant})


def _per_rank(params, tp: int) -> float:
    """Elements one of ``tp`` ranks holds, from the runtime's own sharding metadata."""
    return sum(p.numel() / tp if get_tp_shard(p) is not None else p.numel() for p in params)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[1]}-v{s[5]}")
def test_planner_counts_what_the_runtime_builds(shape, variant):
    planner, runtime = _planner_model(shape, VARIANTS[variant]), \
        _runtime_config(shape, VARIANTS[variant])
    assert planner == runtime  # one description, whether from a model file or from flags
    model = GPTModel(runtime)
    assert planner.num_parameters() == sum(p.numel() for p in model.parameters())
    layer = list(model.decoder.layers["0"].parameters())
    # a pipeline's first and last stage: embeddings, and final norm + output layer (a tied
    # output layer holds its own copy of the word embedding there)
    first = GPTModel(runtime, layer_range=(0, 0), post_process=False)
    last = GPTModel(runtime, layer_range=(0, 0), pre_process=False)
    assert runtime.tied_embeddings == ("output_layer.weight" in last.checkpoint_names)
    for tp in (1, 2, 4, 8):
        if runtime.num_query_groups % tp or runtime.ffn_hidden_size % tp:
            continue
        assert planner.layer_params_per_chip(tp) == _per_rank(layer, tp)
        assert planner.embedding_params_per_chip(tp) == _per_rank(first.parameters(), tp)
        assert planner.head_params_per_chip(tp) == _per_rank(last.parameters(), tp)


def gpt3_parameters(layers: int, hidden: int, padded_vocab: int, positions: int) -> int:
    """Megatron's GPT (no architecture flags), counted by hand: per layer two LayerNorms
    (scale + bias), QKV h x 3h + 3h, projection h x h + h, MLP h x 4h + 4h and 4h x h + h;
    word embedding V x h, learned position table P x h, final LayerNorm; the output layer is the
    word embedding (tied)."""
    per_layer = 2 * 2 * hidden + (3 * hidden * hidden + 3 * hidden) \
        + (hidden * hidden + hidden) + (4 * hidden * hidden + 4 * hidden) \
        + (4 * hidden * hidden + hidden)
    return layers * per_layer + padded_vocab * hidden + positions * hidden + 2 * hidden


@pytest.mark.parametrize("layers, hidden, heads, seq, vocab", [
    (4, 64, 4, 32, 256),  # the shape of the end-to-end GPT-3 runs (NullTokenizer 256 + eod)
    (12, 768, 12, 1024, 50257),  # GPT-2 small's shape with Megatron's GPT-2 tokenizer
])
def test_gpt3_command_line_builds_megatrons_parameter_count(layers, hidden, heads, seq, vocab):
    cfg, _ = config_from_args(
        f"--num-layers {layers} --hidden-size {hidden} --num-attention-heads {heads} "
        f"--seq-length {seq} --max-position-embeddings {seq} --micro-batch-size 1 "
        f"--train-iters 1 --lr 1e-4 --data-path x --tokenizer-type NullTokenizer "
        f"--vocab-size {vocab}".split())
    cfg.model.vocab_size = padded = cfg.data.padded_vocab_size(vocab)
    assert padded % 128 == 0 and padded - 128 < vocab <= padded
    want = gpt3_parameters(layers, hidden, padded, seq)
    assert cfg.model.num_parameters() == want
    if hidden <= 64:  # build the small one
        assert sum(p.numel() for p in GPTModel(cfg.model).parameters()) == want


def test_flops_follow_the_same_counts():
    model = _planner_model(SHAPES[1], VARIANTS["llama_gqa"])
    tokens = 10
    matmul = 2 * tokens * model.layer_matrix_params
    assert model.layer_forward_flops(tokens, causal=False) == matmul \
        + tokens * 4 * model.seq_length * model.hidden_size
    assert model.layer_forward_flops(tokens) == matmul \
        + tokens * 2 * model.seq_length * model.hidden_size
    assert model.flops_per_token() == 3 * (model.num_layers * model.layer_forward_flops(1, False)
                                           + model.head_forward_flops(1))
    gelu, swiglu = (_planner_model(SHAPES[0], VARIANTS[v]) for v in ("gpt", "llama_gqa"))
    h, f = gelu.hidden_size, gelu.ffn_hidden_size
    assert swiglu.layer_matrix_params - gelu.layer_matrix_params == f * h \
        - 2 * h * (h - swiglu.kv_size)  # a third MLP matrix; fewer K/V columns


PRECISIONS = {  # flags -> the dtypes they select
    "fp32": [],
    "bf16": ["--bf16"],
    "bf16_reduce_in_bf16": ["--bf16", "--grad-reduce-in-bf16"],
    "fp16": ["--fp16"],
    "fp16_fp32_grads": ["--fp16", "--accumulate-allreduce-grads-in-fp32"],
}


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "zero1"])
def test_state_bytes_per_param_match_the_runtime_optimizer(distributed, precision):
    """The planner's bytes per parameter are what the runtime really allocates, in every
    precision, with either optimizer (measured after a step, when Adam's moments exist)."""
    from megatron_h2.devices.op_replay import DTYPES
    from megatron_h2.models.gpt import cast_parameters
    from megatron_h2.optimizer.main_params import allocated_state_bytes

    cfg = _runtime_config(SHAPES[1], VARIANTS["gpt"])
    run = config_from_args(PRECISIONS[precision])[0]
    dtypes = run.training.precision
    model = GPTModel(cfg)
    cast_parameters(model, DTYPES[dtypes.params])
    optimizer = build_data_parallel_optimizer(model, run.optimizer, None,
                                              use_distributed_optimizer=distributed,
                                              grad_dtype=DTYPES[dtypes.grads])
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    model(tokens=tokens, labels=tokens).mean().backward()
    optimizer.grad_buckets.finish_sync()
    optimizer.step()  # Adam's moments exist from the first step on
    per_param = allocated_state_bytes(model, optimizer) / cfg.num_parameters()
    assert per_param == pytest.approx(state_bytes_per_param(dtypes, 1, distributed), rel=1e-3)
    expected = {"fp32": (16, 20), "bf16": (18, 18), "bf16_reduce_in_bf16": (20, 20),
                "fp16": (20, 20), "fp16_fp32_grads": (18, 18)}[precision][distributed]
    assert state_bytes_per_param(dtypes, 1, distributed) == expected


def test_state_bytes_per_param_shard_over_data_parallelism():
    """ZeRO-1 divides the master shard, Adam's moments and any fp32 gradient copy by DP and adds
    the reduced gradient shard each rank receives; the replicated optimizer does not depend on
    DP. (Measured above at DP 1; the DP > 1 terms are the sizes of Bucket.shard_grad and of the
    shard views, whole buffers / DP.)"""
    from megatron_h2.config import MEGATRON_BF16, Precision

    assert state_bytes_per_param(MEGATRON_BF16, 8, False) == 18
    assert state_bytes_per_param(MEGATRON_BF16, 8, True) == pytest.approx(6 + 12 / 8 + 4 / 8)
    assert state_bytes_per_param(Precision(), 4, True) == pytest.approx(8 + 12 / 4 + 4 / 4)
    assert state_bytes_per_param(Precision("bf16", "bf16"), 2, True) == pytest.approx(
        2 + 2 + 2 / 2 + (4 + 4 + 8) / 2)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_weight_gradient_counts_follow_the_built_matrices(variant):
    """What a deferred weight gradient keeps (zero-bubble) is each matrix's input and output
    gradient, per TP rank: a column-parallel layer sees its whole input and a shard of its output,
    a row-parallel one the reverse."""
    from megatron_h2.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    runtime = _runtime_config(SHAPES[0], VARIANTS[variant])
    layer = GPTModel(runtime).decoder.layers["0"]
    kinds = ColumnParallelLinear | RowParallelLinear
    linears = [m for m in layer.modules() if isinstance(m, kinds)]
    assert len(linears) == 4  # QKV, projection, fc1, fc2
    tokens = 12
    flops = sum(2 * tokens * m.weight.numel() for m in linears)
    assert runtime.layer_weight_grad_flops(tokens) == flops
    for tp in (1, 2):
        widths = 0.0
        for m in linears:
            out_features, in_features = m.weight.shape
            column = isinstance(m, ColumnParallelLinear)
            widths += in_features + out_features / tp if column else in_features / tp + out_features
        assert runtime.layer_weight_grad_bytes(tokens, tp) == pytest.approx(2 * tokens * widths)
