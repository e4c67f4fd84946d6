"""The run's data source (``--data-path``, ``--train/valid/test-data-path``, ``--mock-data``
or the embedded corpus): its checks and the tokenizer before any process group starts, the
datasets, and a start-up line for tokenizer and data flags that the chosen tokenizer or source
does not use."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from megatron_h2.config import DataConfig, RunConfig
from megatron_h2.distributed.topology import Topology

# Tokenizer flags and the tokenizer types they apply to.
_TOKENIZER_FLAGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "vocab_file": ("--vocab-file", ("GPT2BPETokenizer",)),
    "merge_file": ("--merge-file", ("GPT2BPETokenizer",)),
    "tiktoken_pattern": ("--tiktoken-pattern", ("TikTokenizer",)),
    "tiktoken_num_special_tokens": ("--tiktoken-num-special-tokens", ("TikTokenizer",)),
    "tokenizer_special_tokens": ("--tokenizer-special-tokens", ("TikTokenizer",)),
    "null_tokenizer_eod_id": ("--null-tokenizer-eod-id", ("NullTokenizer",)),
    "tokenizer_hf_no_include_special_tokens": ("--tokenizer-hf-no-include-special-tokens",
                                               ("HuggingFaceTokenizer",)),
    "vocab_size": ("--vocab-size", ("NullTokenizer", "TikTokenizer")),
}


def data_prefixes(data: DataConfig) -> list[str]:
    """Every ``.bin``/``.idx`` prefix the run reads (--data-path and the per-split paths)."""
    from megatron_h2.data import parse_data_path

    return [prefix for paths in (data.data_path, data.train_data_path, data.valid_data_path,
                                 data.test_data_path) if paths
            for _, prefix in parse_data_path(paths)]


def check_data_files(data: DataConfig) -> None:
    """Every named ``.bin``/``.idx`` pair exists and is consistent (one-line errors)."""
    from megatron_h2.data import check_data_prefix

    for prefix in data_prefixes(data):
        check_data_prefix(prefix)


def unused_data_flags(data: DataConfig, explicit: frozenset[str]) -> str | None:
    """One start-up line naming the tokenizer / data flags given that change nothing here."""
    unused = [f"{flag} (only {' / '.join(kinds)})"
              for name, (flag, kinds) in _TOKENIZER_FLAGS.items()
              if name in explicit and data.tokenizer_type not in kinds]
    if data.mock_data and "split" in explicit:
        unused.append("--split (mock data is split 1,1,1, as in Megatron)")
    if data.mock_data and "mmap_bin_files" in explicit:
        unused.append("--no-mmap-bin-files (mock data has no files)")
    if not unused:
        return None
    return f"with --tokenizer-type {data.tokenizer_type}, no effect: " + "; ".join(unused)


def describe_source(data: DataConfig) -> str:
    """The data source for the start-up log."""
    if data.mock_data:
        return "mock data (Megatron's MockGPTDataset) | split 1,1,1"
    if data.per_split_paths:
        return " | ".join(f"{name} {' '.join(paths)}" for name, paths in (
            ("train", data.train_data_path), ("valid", data.valid_data_path),
            ("test", data.test_data_path)) if paths)
    return f"{' '.join(data.data_path)} | split {data.effective_split()}"


def build_split_datasets(cfg: RunConfig, tokenizer, num_samples: tuple[int, int, int]):
    """(train, valid, test) datasets of the run's source; None where a split has nothing."""
    from megatron_h2.data import build_gpt_datasets
    from megatron_h2.data.gpt_dataset import build_per_split_datasets
    from megatron_h2.data.mock_dataset import build_mock_gpt_datasets

    data, seq, seed = cfg.data, cfg.model.seq_length, cfg.training.seed
    if data.mock_data:
        return build_mock_gpt_datasets(tokenizer.vocab_size, tokenizer.eod, seq, seed,
                                       num_samples, data.data_cache_path)
    if data.per_split_paths:
        return build_per_split_datasets(
            (data.train_data_path, data.valid_data_path, data.test_data_path), seq, seed,
            num_samples, data.data_cache_path, data.mmap_bin_files)
    return build_gpt_datasets(data.data_path, data.effective_split(), seq, seed, num_samples,
                              data.data_cache_path, data.mmap_bin_files)


def default_cache_dir() -> Path:
    """Where the embedded corpus and chip profiles are cached (``$MEGATRON_H2_CACHE`` or
    ~/.cache/megatron_h2)."""
    return Path(os.environ.get("MEGATRON_H2_CACHE", Path.home() / ".cache" / "megatron_h2"))


def prepare_data(cfg: RunConfig, say: Callable[[str], None]):
    """Resolve data and tokenizer; fills ``cfg.model.vocab_size``. Returns the tokenizer."""
    from megatron_h2.data import build_tokenizer, check_token_ids, ensure_default_corpus

    if not cfg.data.has_source:
        say("no --data-path given: using the embedded corpus (Python standard library sources)")
        prefix, spm_model = ensure_default_corpus(str(default_cache_dir() / "default_corpus"))
        cfg.data.data_path = [prefix]
        cfg.data.tokenizer_type = "SentencePieceTokenizer"
        cfg.data.tokenizer_model = spm_model
    else:
        check_data_files(cfg.data)
    tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model,
                                cfg.data.vocab_size, **cfg.data.tokenizer_options())
    for prefix in data_prefixes(cfg.data):  # cached per corpus: a scan, once
        check_token_ids(prefix, tokenizer.vocab_size, cfg.data.data_cache_path,
                        f"the tokenizer ({cfg.data.tokenizer_type})")
    # Padding does not depend on the layout (unlike Megatron's), so checkpoints move between
    # layouts; every stage's TP degree must divide the padded size (checked with the plan).
    cfg.model.vocab_size = cfg.data.padded_vocab_size(tokenizer.vocab_size)
    return tokenizer


def build_datasets(cfg: RunConfig, topo: Topology, train_samples: int, tokenizer):
    """Train / validation datasets; rank 0 builds the index caches before the others read them."""
    t = cfg.training
    # The test split is not used during training: ask for none so small corpora still work.
    num_samples = (train_samples, t.eval_iters * t.global_batch_size, 0)
    result = build_split_datasets(cfg, tokenizer, num_samples) if topo.rank == 0 else None
    if topo.distributed:
        dist.barrier(group=topo.cpu_group)
    return result if result is not None else build_split_datasets(cfg, tokenizer, num_samples)


__all__ = ["build_datasets", "build_split_datasets", "check_data_files", "data_prefixes",
           "default_cache_dir", "describe_source", "prepare_data", "unused_data_flags"]
