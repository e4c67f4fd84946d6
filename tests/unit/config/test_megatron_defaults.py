"""Megatron-LM's defaults, flag by flag: a command line with only the required flags means what
it means to Megatron.

The table holds Megatron-LM's values as its newest training/arguments.py (and the configs it
generates flags from: TransformerConfig, the optimizer, scheduler and training configs) sets
them. Deliberate deviation: Megatron pads the vocabulary to a multiple of
--make-vocab-size-divisible-by x TP; megatron_h2 does not fold in TP, so every layout (also a
heterogeneous one with a TP per stage) builds the same model and checkpoints move between them.
"""

from __future__ import annotations

import pytest

from megatron_h2.config import DataConfig, ModelConfig, pad_vocab_size
from megatron_h2.training.arguments import config_from_args

REQUIRED = ("--num-layers 2 --hidden-size 96 --num-attention-heads 6 --seq-length 32 "
            "--micro-batch-size 1 --train-iters 1 --lr 1e-4 --data-path x "
            "--tokenizer-type NullTokenizer --vocab-size 1000").split()

MEGATRON = {  # (config section, field): Megatron's default for the flag
    ("model", "hidden_dropout"): 0.1,  # --hidden-dropout (TransformerConfig)
    ("model", "attention_dropout"): 0.1,  # --attention-dropout (TransformerConfig)
    ("model", "init_method_std"): 0.02,  # --init-method-std (TransformerConfig)
    ("model", "normalization"): "LayerNorm",  # --normalization (TransformerConfig)
    ("model", "norm_epsilon"): 1e-5,  # --norm-epsilon (TransformerConfig.layernorm_epsilon)
    ("model", "apply_layernorm_1p"): False,  # --apply-layernorm-1p
    ("model", "add_bias_linear"): True,  # --disable-bias-linear not given
    ("model", "add_qkv_bias"): True,  # kept in sync with add_bias_linear by validate_args
    ("model", "swiglu"): False,  # --swiglu
    ("model", "squared_relu"): False,  # --squared-relu
    ("model", "bias_gelu_fusion"): True,  # --no-bias-gelu-fusion not given
    ("model", "group_query_attention"): False,  # --group-query-attention
    ("model", "untie_embeddings_and_output_weights"): False,  # tied embedding / output layer
    ("model", "position_embedding_type"): "learned_absolute",  # --position-embedding-type
    ("model", "rotary_base"): 10000,  # --rotary-base
    ("model", "rotary_percent"): 1.0,  # --rotary-percent
    ("model", "rotary_seq_len_interpolation_factor"): None,
    ("model", "use_rope_scaling"): False,  # --use-rope-scaling
    ("model", "rope_scaling_factor"): 8.0,  # --rope-scaling-factor
    ("optimizer", "optimizer"): "adam",  # --optimizer
    ("optimizer", "adam_beta1"): 0.9,  # --adam-beta1
    ("optimizer", "adam_beta2"): 0.999,  # --adam-beta2
    ("optimizer", "adam_eps"): 1e-8,  # --adam-eps
    ("optimizer", "weight_decay"): 0.01,  # --weight-decay
    ("optimizer", "clip_grad"): 1.0,  # --clip-grad
    ("optimizer", "min_lr"): 0.0,  # --min-lr
    ("optimizer", "lr_warmup_iters"): 0,  # --lr-warmup-iters
    ("optimizer", "lr_decay_style"): "linear",  # --lr-decay-style
    ("data", "make_vocab_size_divisible_by"): 128,  # --make-vocab-size-divisible-by
    ("training", "seed"): 1234,  # --seed
    ("training", "log_interval"): 100,  # --log-interval
    ("training", "eval_iters"): 100,  # --eval-iters
    ("training", "bf16"): False,  # --bf16
    ("training", "fp16"): False,  # --fp16
    ("training", "grad_reduce_in_bf16"): False,  # --grad-reduce-in-bf16
    ("training", "accumulate_allreduce_grads_in_fp32"): False,  # on by validate_args with --bf16
    ("training", "loss_scale"): None,  # --loss-scale: None = dynamic loss scaling
    ("training", "initial_loss_scale"): 2**32,  # --initial-loss-scale
    ("training", "min_loss_scale"): 1.0,  # --min-loss-scale
    ("training", "loss_scale_window"): 1000,  # --loss-scale-window
    ("training", "hysteresis"): 2,  # --hysteresis
    ("training", "check_for_nan_in_loss_and_grad"): True,  # off by validate_args for dynamic fp16
}


@pytest.fixture(scope="module")
def parsed():
    return config_from_args(REQUIRED)[0]


@pytest.mark.parametrize("section, name", list(MEGATRON), ids=lambda v: v)
def test_default_is_megatrons(parsed, section, name):
    assert getattr(getattr(parsed, section), name) == MEGATRON[section, name]


def test_size_rules_are_megatrons(parsed):
    """Megatron's validate_args / TransformerConfig rules for the sizes left unset."""
    m = parsed.model
    assert m.ffn_hidden_size == 4 * 96  # 4h without --swiglu
    assert m.kv_channels == 96 // 6  # hidden / heads
    assert m.num_query_groups == 6  # one per head without --group-query-attention
    assert m.max_position_embeddings == 32
    swiglu = config_from_args(REQUIRED + ["--swiglu"])[0].model
    assert swiglu.ffn_hidden_size == int((4 * 96 * 2 / 3) / 64) * 64 == 256
    gqa = config_from_args(REQUIRED + ["--group-query-attention"])[0].model
    assert gqa.num_query_groups == 1  # Megatron's --num-query-groups default
    given = config_from_args(REQUIRED + ["--num-query-groups", "3"])[0].model
    assert given.num_query_groups == 6  # ignored without --group-query-attention, as Megatron
    assert config_from_args(REQUIRED + ["--disable-bias-linear"])[0].model.add_qkv_bias is False
    assert parsed.model.activation == "gelu_tanh"  # Megatron's fused bias-GeLU is the tanh one
    assert parsed.training.global_batch_size is None  # micro-batch x DP, set from the layout


def test_vocab_padding_does_not_fold_in_tensor_parallelism():
    """Megatron: 50257 -> multiple of 128 x TP (50304 at TP 1, 50432 at TP 2, 51200 at TP 8);
    here 50304 under every layout."""
    megatron = {tp: pad_vocab_size(50257, 128 * tp) for tp in (1, 2, 8)}
    assert megatron == {1: 50304, 2: 50432, 8: 51200}
    assert DataConfig().padded_vocab_size(50257) == 50304  # the same for every TP degree
    assert pad_vocab_size(50257, 1) == 50257


def test_programmatic_defaults_equal_the_flags():
    """ModelConfig() is the flags' model: the dataclass defaults are the command line's."""
    m = ModelConfig(num_layers=2, hidden_size=96, num_attention_heads=6, seq_length=32)
    for (section, name), value in MEGATRON.items():
        if section == "model":
            assert getattr(m, name) == value, name


@pytest.mark.parametrize("flags, params, grads, accumulate, nan_check", [
    ([], "fp32", "fp32", False, True),
    (["--bf16"], "bf16", "fp32", True, True),  # bf16 accumulates and reduces in fp32
    (["--bf16", "--grad-reduce-in-bf16"], "bf16", "bf16", False, True),
    (["--bf16", "--accumulate-allreduce-grads-in-fp32"], "bf16", "fp32", True, True),
    (["--fp16"], "fp16", "fp16", False, False),  # dynamic scaling: the NaN check is off
    (["--fp16", "--loss-scale", "1024"], "fp16", "fp16", False, True),  # static: stays on
    (["--fp16", "--accumulate-allreduce-grads-in-fp32"], "fp16", "fp32", True, False),
])
def test_precision_rules_are_megatrons(flags, params, grads, accumulate, nan_check):
    """Megatron's validate_args: --bf16 turns on --accumulate-allreduce-grads-in-fp32 unless
    --grad-reduce-in-bf16; --fp16 keeps fp16 gradient buckets unless that flag is given, and
    dynamic loss scaling turns off --check-for-nan-in-loss-and-grad. The weights are in the
    dtype of --bf16 / --fp16 (Megatron's params_dtype)."""
    t = config_from_args(REQUIRED + flags)[0].training
    assert (t.precision.params, t.precision.grads) == (params, grads)
    assert t.accumulate_allreduce_grads_in_fp32 == accumulate
    assert t.check_for_nan_in_loss_and_grad == nan_check
