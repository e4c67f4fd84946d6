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
    assert (m.normalization, m.activation, m.position_embedding_type) == ("RMSNorm", "swiglu",
                                                                         "rope")
    assert not m.add_bias_linear and not m.add_qkv_bias and not m.tied_embeddings
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


def test_data_source_and_tokenizer_defaults_as_megatron():
    cfg, launch = config_from_args(f"--data-path foo {REQUIRED}".split())
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer"  # pretrain_gpt.py's default
    assert cfg.data.effective_split() == "969, 30, 1" and launch.demo_flags == ()
    mock, launch = config_from_args(f"--mock-data --split 99,1,0 {REQUIRED}".split())
    assert mock.data.effective_split() == "1,1,1" and launch.demo_flags == ()
    cfg, _ = config_from_args(f"--train-data-path 2 a 1 b --valid-data-path c {REQUIRED}".split())
    assert cfg.data.per_split_paths and cfg.data.train_data_path == ["2", "a", "1", "b"]
    cfg, _ = config_from_args([*REQUIRED.split(), "--data-path", "x", "--split", "'99,1,0'",
                               "--no-mmap-bin-files"])
    assert not cfg.data.mmap_bin_files and cfg.data.split == "'99,1,0'"


@pytest.mark.parametrize("flags, fragment", [
    ("--hidden-size 100 --num-attention-heads 8", "not divisible by --num-attention-heads"),
    ("--num-attention-heads 8 --group-query-attention --num-query-groups 3",
     "does not divide --num-attention-heads"),
    ("--swiglu --squared-relu", "--swiglu and --squared-relu"),
    ("--position-embedding-type rope --rotary-percent 0.3", "even number of rotated dim"),
    ("--rotary-percent 1.5", "--rotary-percent must be in (0, 1]"),
    ("--normalization LayerNorm1p", "invalid choice: 'LayerNorm1p'"),
    ("--global-batch-size 10 --micro-batch-size 4", "not divisible by --micro-batch-size"),
    ("--seq-length 512 --max-position-embeddings 256", "exceeds --max-position-embeddings"),
    ("--micro-batch-size 0", "--micro-batch-size must be a positive"),
    ("--lr 1e-4 --min-lr 1e-3", "--min-lr"),
    ("--fp16 --bf16", "--bf16 and --fp16 exclude each other"),
    ("--grad-reduce-in-bf16", "--grad-reduce-in-bf16 needs --bf16"),
    ("--bf16 --grad-reduce-in-bf16 --accumulate-allreduce-grads-in-fp32", "exclude each other"),
    ("--fp16 --loss-scale 0", "--loss-scale must be positive"),
    ("--fp16 --initial-loss-scale 8 --min-loss-scale 16", "--min-loss-scale 16 exceeds"),
    ("--fp16 --loss-scale-window 2.5", "--loss-scale-window must be a whole number"),
    ("--fp16 --hysteresis 0", "--hysteresis must be >= 1"),
    ("--train-iters 10 --lr-warmup-iters 20", "--lr-warmup-iters 20 must be shorter"),
    ("--train-iters 10 --train-samples 100", "either --train-iters or --train-samples"),
    ("--train-iters 10 --lr-decay-samples 5", "--lr-decay-samples needs sample-based"),
    ("--train-samples 100 --lr-warmup-iters 5", "--lr-warmup-iters needs iteration-based"),
    ("--train-samples 100 --lr-warmup-samples 100", "--lr-warmup-samples 100 must be shorter"),
    ("--train-iters 10 --rampup-batch-size 4 4 100", "needs sample-based training"),
    ("--train-samples 99 --rampup-batch-size 4 4", "expected 3 arguments"),
    ("--lr-warmup-fraction 0.1 --lr-warmup-iters 2", "either --lr-warmup-fraction or --lr-warm"),
    ("--lr-warmup-fraction 1.5", "must be in [0, 1)"),
    ("--lr 1e-3 --lr-warmup-init 1e-2", "--lr-warmup-init 0.01 must be between"),
    ("--decoupled-min-lr 1e-5", "--decoupled-min-lr needs --decoupled-lr"),
    ("--decoupled-lr 1e-5 --min-lr 1e-4 --lr 1e-3", "must be between 0 and --decoupled-lr"),
    ("--start-weight-decay 0.1", "need --weight-decay-incr-style linear or cosine"),
    ("--weight-decay-incr-style linear --start-weight-decay 0.1", "needs both"),
    ("--weight-decay-incr-style cosine --start-weight-decay 0.2 --end-weight-decay 0.1",
     "weight decay must increase"),
    ("--override-opt_param-scheduler --use-checkpoint-opt-param-scheduler", "exclude each other"),
    ("--step-batch-size-schedule 8:16", "must start at threshold 0"),
    ("--step-batch-size-schedule 0:16,x:32", "entry 'x:32' is not THRESHOLD:BATCH"),
    ("--step-batch-size-schedule 0:16 --global-batch-size 32", "differs from the last batch"),
    ("--step-batch-size-schedule 0:16 --rampup-batch-size 4 4 10", "not both"),
    ("--exit-duration-in-mins 0", "--exit-duration-in-mins must be a positive"),
    ("--data-path foo --tokenizer-type NullTokenizer", "--num-layers is required"),
    ("--mock-data --tokenizer-type NullTokenizer", "--num-layers is required"),
    ("--data-path foo " + REQUIRED.replace("--train-iters 1 ", ""),
     "--train-iters (or --train-samples) is required"),
    ("--data-path foo --mock-data " + REQUIRED, "give one data source, not --data-path and "
                                                "--mock-data"),
    ("--train-data-path a --split 9,1,0 " + REQUIRED, "drop --split"),
    ("--valid-data-path a " + REQUIRED, "need --train-data-path"),
    ("--tokenizer-type BertWordPieceCase", "invalid choice: 'BertWordPieceCase'"),
    ("--tiktoken-pattern v3", "invalid choice: 'v3'"),
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
