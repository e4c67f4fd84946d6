"""The command line generated from the typed configs: no abbreviations, one-line errors with the
closest flag, compatibility flags reported, every default in --help."""

import pytest

from megatron_h2.config import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    TrainingConfig,
    cli_fields,
    flag_name,
)
from megatron_h2.errors import ConfigError
from megatron_h2.training.arguments import (
    build_parser,
    config_from_args,
    describe_demo,
    describe_no_effect,
)

DATA = ["--data-path", "corpus", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]
REQUIRED = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"]


@pytest.mark.parametrize("argv, expected", [
    (["--num-layer", "4"], "unknown flag --num-layer; did you mean --num-layers?"),
    (["--ddp-bucket-size-mb", "40"], "unknown flag --ddp-bucket-size-mb; did you mean "
                                     "--ddp-bucket-size?"),
    (["--totally-unknown"], "unknown flag --totally-unknown; see pretrain_gpt.py --help"),
    (["--num-layers", "x"], "argument --num-layers: expected int, got 'x'"),
    (["--lr-decay-style", "cosin"], "invalid choice: 'cosin'"),
    (["--moe-use-upcycling"], "--moe-use-upcycling is not supported: this "
                              "mixture-of-experts option is not implemented"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk 5 must be between 1 "
                                                       "and --num-experts 4"),
    (["--expert-model-parallel-size", "0"], "--expert-model-parallel-size must be a positive "
                                            "number, got 0"),
    (["--num-experts", "4", "--moe-layer-freq", "[1]*"], "--moe-layer-freq takes an integer"),
])
def test_bad_flags_are_one_line(argv, expected):
    with pytest.raises(ConfigError) as err:
        config_from_args(argv)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_prefixes_are_not_accepted():
    with pytest.raises(ConfigError, match="unknown flag --hidden"):
        config_from_args(["--hidden", "64"])


def test_required_flags_only_outside_the_demo():
    with pytest.raises(ConfigError, match="--lr is required with --data-path"):
        config_from_args(DATA + [f for f in REQUIRED if f not in ("--lr", "1e-3")])
    cfg, launch = config_from_args(DATA + REQUIRED)
    assert cfg.model.hidden_dropout == 0.1 and launch.demo_flags == ()  # Megatron's default
    demo, launch = config_from_args([])
    assert demo.model.hidden_dropout == 0.0
    assert "--num-layers 4" in launch.demo_flags and "--hidden-dropout 0.0" in launch.demo_flags


def test_compatibility_flags_are_reported_once():
    _, launch = config_from_args(["--use-mcore-models", "--distributed-backend", "nccl",
                                  "--attention-softmax-in-fp32", "--swiglu"])
    line = describe_no_effect(launch)
    assert line.startswith("accepted, no effect: ") and line.count("--") == 3
    assert "--distributed-backend (" in line and "--swiglu" not in line  # --swiglu is real


@pytest.mark.parametrize("argv, inert", [
    (["--num-query-groups", "2"], "--num-query-groups"),  # Megatron: MHA without the GQA flag
    (["--position-embedding-type", "learned_absolute", "--rotary-base", "500000"],
     "--rotary-base"),
    (["--rope-scaling-factor", "32"], "--rope-scaling-factor"),
    (["--swiglu", "--no-bias-gelu-fusion"], "--no-bias-gelu-fusion"),
])
def test_flags_made_ineffective_by_others_are_reported(argv, inert):
    cfg, launch = config_from_args(DATA + REQUIRED + argv)
    assert describe_no_effect(launch).startswith(f"accepted, no effect: {inert} (")
    assert cfg.model.num_query_groups == cfg.model.num_attention_heads
    active, launch = config_from_args(DATA + REQUIRED + ["--group-query-attention",
                                                         "--num-query-groups", "2"])
    assert active.model.num_query_groups == 2 and describe_no_effect(launch) is None


def test_demo_says_it_trains_a_llama_style_model():
    demo, launch = config_from_args([])
    assert describe_demo(launch, demo.model).startswith(
        "embedded demo (no --data-path), a LLaMA-style model: ")
    assert "--swiglu" in launch.demo_flags and "--disable-bias-linear" in launch.demo_flags
    assert (demo.model.normalization, demo.model.activation) == ("RMSNorm", "swiglu")
    gpt, launch = config_from_args(["--normalization", "LayerNorm"])
    assert "the model of the flags" in describe_demo(launch, gpt.model)
    assert describe_demo(config_from_args(DATA + REQUIRED)[1], gpt.model) is None


def test_help_shows_every_flag_with_its_default():
    text = build_parser().format_help()
    for cls in (ModelConfig, DataConfig, OptimizerConfig, TrainingConfig):
        for f in cli_fields(cls):
            assert flag_name(f) in text
    assert "(default: 0.999)" in text and "(required)" in text


def test_global_batch_defaults_to_one_micro_batch_per_replica():
    cfg, _ = config_from_args(DATA + REQUIRED)
    assert cfg.training.global_batch_size is None  # set from the layout: micro-batch x DP
