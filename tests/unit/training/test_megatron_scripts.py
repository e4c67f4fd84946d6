"""Megatron-LM's own command lines, unchanged but shrunk in sizes (layers, hidden, heads,
sequence, batch, iterations), with local data and tokenizer files: every flag of each parses and
builds the model Megatron builds. The command lines are those of Megatron-LM's
examples/gpt3/train_gpt3_175b_distributed.sh, examples/llama/train_llama3_8b_h100_fp8.sh, the
older examples/pretrain_gpt_distributed_with_mp.sh, examples/mixtral/
train_mixtral_8x7b_distributed.sh and two GPT functional-test configs
(tests/functional_tests/test_cases/gpt/...). (Each trains 3 iterations under torchrun:
tests/e2e/test_megatron_scripts.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_h2.training.arguments import config_from_args

DATA = "@DATA@"  # placeholders filled per test: the preprocessed corpus and its tokenizer
VOCAB, MERGES, RUN = "@VOCAB@", "@MERGES@", "@RUN@"

GPT3_175B = [  # examples/gpt3/train_gpt3_175b_distributed.sh
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--attention-backend", "auto",
    "--micro-batch-size", "1", "--global-batch-size", "8",
    "--step-batch-size-schedule", "0:4 0.5K:8",
    "--train-iters", "3", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
    "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
    "--lr-decay-iters", "430000",
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--data-path", DATA, "--vocab-file", VOCAB, "--merge-file", MERGES, "--split", "949,50,1",
    "--log-interval", "1", "--save-interval", "3", "--eval-interval", "3",
    "--save", f"{RUN}/ckpt", "--load", f"{RUN}/ckpt", "--eval-iters", "1",
    "--tensorboard-dir", f"{RUN}/tb",
]

LLAMA3_8B = [  # examples/llama/train_llama3_8b_h100_fp8.sh, mock-data variant, FP8 flags dropped
    "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "224",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--kv-channels", "16", "--seq-length", "64", "--max-position-embeddings", "64",
    "--position-embedding-type", "rope", "--rotary-base", "1000000", "--rotary-percent", "1.0",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu",
    "--normalization", "RMSNorm", "--init-method-std", "0.0134", "--attention-backend", "fused",
    "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "24",
    "--lr-decay-samples", "20", "--lr-warmup-samples", "8", "--lr", "0.00015",
    "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
    "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
    "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
    "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
    "--data-cache-path", f"{RUN}/cache", "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
    "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
    "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "3", "--save-interval", "3",
    "--log-throughput", "--profile", "--profile-step-start", "1", "--profile-step-end", "2",
    "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60",
    "--save", f"{RUN}/ckpt", "--load", f"{RUN}/ckpt", "--tensorboard-dir", f"{RUN}/tb",
]

GPT_WITH_MP = [  # examples/pretrain_gpt_distributed_with_mp.sh (Megatron-LM before 2024-10)
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--sequence-parallel", "--num-layers", "4", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "0.00015",
    "--train-iters", "3", "--lr-decay-iters", "320000", "--lr-decay-style", "cosine",
    "--min-lr", "1.0e-5", "--weight-decay", "1e-2", "--lr-warmup-fraction", ".01",
    "--clip-grad", "1.0", "--fp16",
    "--data-path", DATA, "--vocab-file", VOCAB, "--merge-file", MERGES, "--split", "949,50,1",
    "--log-interval", "1", "--save-interval", "3", "--eval-interval", "3", "--eval-iters", "1",
    "--distributed-backend", "nccl", "--save", f"{RUN}/ckpt", "--load", f"{RUN}/ckpt",
]

_FUNCTIONAL_COMMON = [  # shared by the GPT functional tests, sizes shrunk
    "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
    "--log-params-norm", "--log-num-zeros-in-grad", "--log-validation-ppl-to-tensorboard",
    "--log-timers-to-tensorboard", "--tensorboard-dir", f"{RUN}/tb", "--micro-batch-size", "1",
    "--global-batch-size", "8", "--seq-length", "64", "--max-position-embeddings", "64",
    "--train-iters", "3", "--timing-log-level", "0", "--lr-decay-iters", "320000",
    "--save", f"{RUN}/ckpt", "--load", f"{RUN}/ckpt", "--data-path", DATA,
    "--vocab-file", VOCAB, "--merge-file", MERGES, "--split", "949,50,1",
    "--distributed-backend", "nccl", "--lr", "0.00015", "--lr-decay-style", "cosine",
    "--min-lr", "1.0e-5", "--weight-decay", "1e-2", "--clip-grad", "1.0",
    "--lr-warmup-fraction", ".01", "--log-interval", "1", "--save-interval", "10000",
    "--eval-interval", "3", "--eval-iters", "1",
]

# tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp1_pp4_vp1_uneven_pipeline
FUNCTIONAL_UNEVEN = [
    *_FUNCTIONAL_COMMON, "--tensor-model-parallel-size", "1",
    "--pipeline-model-parallel-size", "4", "--untie-embeddings-and-output-weights",
    "--deterministic-mode", "--no-gradient-accumulation-fusion", "--attention-softmax-in-fp32",
    "--use-mcore-models", "--ckpt-format", "torch_dist", "--dist-ckpt-strictness", "log_all",
    "--data-cache-path", f"{RUN}/cache", "--bf16", "--decoder-first-pipeline-num-layers", "2",
    "--decoder-last-pipeline-num-layers", "2", "--attention-backend", "unfused",
    "--log-memory-to-tensorboard", "--async-save", "--use-persistent-ckpt-worker",
]

# tests/functional_tests/test_cases/gpt/
#   gpt3_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce_param_gather
FUNCTIONAL_VP_OVERLAP = [
    *_FUNCTIONAL_COMMON, "--tensor-model-parallel-size", "1",
    "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--check-weight-hash-across-dp-replicas-interval", "10", "--disable-gloo-process-groups",
    "--ckpt-fully-parallel-load", "--deterministic-mode", "--no-gradient-accumulation-fusion",
    "--attention-softmax-in-fp32", "--use-mcore-models", "--ckpt-format", "torch_dist",
    "--dist-ckpt-optim-fully-reshardable", "--dist-ckpt-strictness", "log_all",
    "--data-cache-path", f"{RUN}/cache", "--bf16", "--attention-backend", "unfused",
    "--log-memory-to-tensorboard", "--async-save", "--use-persistent-ckpt-worker",
]

MIXTRAL_8X7B = [  # examples/mixtral/train_mixtral_8x7b_distributed.sh (local GPT-2 tokenizer
    # files instead of the Llama 2 one; 4 experts instead of 8, expert parallelism 2 instead of
    # 8: on 8 processes PP 4 leaves DP 2, whose two ranks per stage form the EP group)
    "--use-mcore-models", "--disable-bias-linear", "--seq-length", "64",
    "--max-position-embeddings", "128", "--num-layers", "4", "--hidden-size", "64",
    "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--init-method-std", "0.01",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--swiglu", "--untie-embeddings-and-output-weights",
    "--group-query-attention", "--num-query-groups", "2", "--no-masked-softmax-fusion",
    "--no-position-embedding", "--rotary-base", "1000000",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type",
    "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm",
    "--moe-token-dispatcher-type", "alltoall", "--overlap-param-gather", "--overlap-grad-reduce",
    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB, "--merge-file", MERGES,
    "--data-path", DATA, "--split", "90,8,2",  # 99990,8,2 leaves 400 documents no valid ones
    "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "1e-4", "--train-iters", "3",
    "--lr-decay-iters", "3", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5",
    "--weight-decay", "0.1", "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--bf16",
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
    "--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--sequence-parallel",
    "--log-interval", "1", "--save-interval", "3", "--eval-interval", "3", "--eval-iters", "1",
    "--save", f"{RUN}/ckpt", "--load", f"{RUN}/ckpt", "--tensorboard-dir", f"{RUN}/tb",
    "--no-load-optim", "--no-load-rng",
]

SCRIPTS = {  # name: (processes, flags)
    "mixtral_8x7b": (8, MIXTRAL_8X7B),
    "gpt3_175b": (4, GPT3_175B),
    "llama3_8b": (2, LLAMA3_8B),
    "gpt_distributed_with_mp": (4, GPT_WITH_MP),
    "functional_tp1_pp4_vp1_uneven_pipeline": (4, FUNCTIONAL_UNEVEN),
    "functional_tp1_pp4_vp1_overlap": (4, FUNCTIONAL_VP_OVERLAP),
}

EXPECTED_EP = {"mixtral_8x7b": 2}
"""Expert parallelism of the command lines that set it (the rest: 1)."""

# What each command line builds, as Megatron builds it from the same flags.
EXPECTED_MODEL = {
    "mixtral_8x7b": {"normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False,
                     "position_embedding_type": "rope", "rotary_base": 1000000.0,
                     "untie_embeddings_and_output_weights": True, "num_query_groups": 2,
                     "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 128,
                     "moe_aux_loss_coeff": 1e-2, "moe_layers": [0, 1, 2, 3]},
    "gpt3_175b": {"normalization": "LayerNorm", "swiglu": False, "add_bias_linear": True,
                  "position_embedding_type": "learned_absolute",
                  "untie_embeddings_and_output_weights": False, "init_method_std": 0.006},
    "llama3_8b": {"normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False,
                  "position_embedding_type": "rope", "rotary_base": 1000000.0,
                  "untie_embeddings_and_output_weights": True, "group_query_attention": True,
                  "num_query_groups": 2, "kv_channels": 16, "ffn_hidden_size": 224,
                  "hidden_dropout": 0.0},
    "gpt_distributed_with_mp": {"normalization": "LayerNorm", "swiglu": False,
                                "position_embedding_type": "learned_absolute",
                                "hidden_dropout": 0.1},  # Megatron's default dropout
    "functional_tp1_pp4_vp1_uneven_pipeline": {"untie_embeddings_and_output_weights": True},
    "functional_tp1_pp4_vp1_overlap": {"untie_embeddings_and_output_weights": False},
}


def _fill(flags: list[str], values: dict[str, str]) -> list[str]:
    out = []
    for flag in flags:
        for key, value in values.items():
            flag = flag.replace(key, value)
        out.append(flag)
    return out


def _parse(flags: list[str], tmp_path: Path):
    """The run config of a command line (the data files are opened only when training)."""
    values = {DATA: str(tmp_path / "corpus"), VOCAB: "vocab.json", MERGES: "merges.txt",
              RUN: str(tmp_path)}
    return config_from_args(_fill(flags, values))


def _check_model(name: str, cfg) -> None:
    processes, flags = SCRIPTS[name]
    assert cfg.model.num_layers == int(flags[flags.index("--num-layers") + 1])
    for field, value in EXPECTED_MODEL[name].items():
        assert getattr(cfg.model, field) == value, field
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    assert processes % (tp * pp) == 0
    ep = cfg.parallel.expert_model_parallel_size
    assert ep == EXPECTED_EP.get(name, 1) and (processes // pp) % ep == 0


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_command_line_parses(name, tmp_path):
    """Every flag of the script is accepted."""
    cfg, _ = _parse(SCRIPTS[name][1], tmp_path)
    _check_model(name, cfg)
