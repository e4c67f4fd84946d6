"""Flags map onto validated configs; each bad value is one clear ConfigError."""

import pytest

from megatron_h2.config import DataConfig, RunConfig
from megatron_h2.errors import ConfigError
from megatron_h2.training.arguments import config_from_args


def test_megatron_llama_flags_map_onto_configs():
    cfg, launch = config_from_args(
        "--num-layers 6 --hidden-size 128 --ffn-hidden-size 344 --num-attention-heads 8 "
        "--group-query-attention --num-query-groups 2 --seq-length 64 "
        "--max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 8 "
        "--train-iters 30 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 5 --lr-decay-style linear "
        "--weight-decay 0.05 --clip-grad 0.5 --seed 7 --bf16 --swiglu --normalization RMSNorm "
        "--position-embedding-type rope --disable-bias-linear "
        "--untie-embeddings-and-output-weights --recompute-activations --ckpt-step 10 "
        "--data-path 0.3 a 0.7 b --tokenizer-type NullTokenizer --vocab-size 500".split())
    m, t, o = cfg.model, cfg.training, cfg.optimizer
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_query_groups) == (6, 128, 344, 2)
    assert (m.seq_length, m.max_position_embeddings, m.recompute) == (64, 128, "selective")
    assert m.vocab_size == 0  # --vocab-size is the tokenizer's, padded later
    assert (t.micro_batch_size, t.global_batch_size, t.num_micro_batches) == (2, 8, 4)
    assert t.bf16 and t.seed == 7 and t.train_iters == 30
    assert (o.lr, o.min_lr, o.lr_decay_style, o.clip_grad) == (3e-4, 3e-5, "linear", 0.5)
    assert cfg.data.data_path == ["0.3", "a", "0.7", "b"] and cfg.data.vocab_size == 500
    assert launch.ckpt_step == 10


def test_defaults_are_valid_and_round_trip():
    cfg, _ = config_from_args([])
    assert cfg.model.num_query_groups == cfg.model.num_attention_heads
    assert cfg.optimizer.min_lr == pytest.approx(cfg.optimizer.lr / 10)
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


REQUIRED = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 1 --train-iters 1 --lr 1e-3")


@pytest.mark.parametrize("flags, fragment", [
    ("--hidden-size 100 --num-attention-heads 8", "not divisible by --num-attention-heads"),
    ("--num-attention-heads 8 --num-query-groups 3", "does not divide --num-attention-heads"),
    ("--global-batch-size 10 --micro-batch-size 4", "not divisible by --micro-batch-size"),
    ("--seq-length 512 --max-position-embeddings 256", "exceeds --max-position-embeddings"),
    ("--micro-batch-size 0", "--micro-batch-size must be a positive"),
    ("--lr 1e-4 --min-lr 1e-3", "--min-lr"),
    ("--fp16", "use --bf16"),
    ("--train-iters 10 --lr-warmup-iters 20", "--lr-warmup-iters 20 exceeds"),
    ("--data-path foo " + REQUIRED, "needs --tokenizer-type"),
    ("--data-path foo --tokenizer-type NullTokenizer", "--num-layers is required"),
])
def test_bad_flags_raise_one_line(flags, fragment):
    with pytest.raises(ConfigError) as err:
        config_from_args(flags.split())
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_vocab_padding():
    data = DataConfig()
    assert data.padded_vocab_size(4000) == 4096
    assert data.padded_vocab_size(4096) == 4096
    assert DataConfig(make_vocab_size_divisible_by=256).padded_vocab_size(4097) == 4352
