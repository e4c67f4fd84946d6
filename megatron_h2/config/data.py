"""Where the tokens come from: data paths, tokenizer, splits, mock data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_h2.config.flags import _positive, flag
from megatron_h2.config.model_config import pad_vocab_size
from megatron_h2.errors import ConfigError

TOKENIZER_TYPES = ("GPT2BPETokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
                   "Llama2Tokenizer", "NullTokenizer", "SentencePieceTokenizer", "TikTokenizer")
LEGACY_SPLIT = "969, 30, 1"
"""Megatron's split when --data-path comes without --split."""
MOCK_SPLIT = "1,1,1"
"""Megatron's split of --mock-data (it ignores --split)."""


@dataclass
class DataConfig:
    """Where the tokens come from and how text becomes tokens. Without any data source the run
    is the embedded demo (its own corpus and tokenizer)."""

    data_path: list[str] = flag(
        [], "PREFIX [PREFIX ...] (blended by size) or W1 PREFIX1 W2 PREFIX2 ... of Megatron "
        ".bin/.idx files, cut into training / validation / test documents by --split; default: "
        "the embedded demo corpus built from the Python standard library.", metavar="PATH")
    split: str | None = flag(
        None, "Comma-separated proportions for training, validation and test documents, e.g. "
        "99,1,0 (quotes and spaces are ignored); default with --data-path: '969, 30, 1'.")
    train_data_path: list[str] = flag(
        [], "Weights and prefixes (as --data-path) of a separate training dataset, used whole.",
        metavar="PATH")
    valid_data_path: list[str] = flag(
        [], "Weights and prefixes of a separate validation dataset, used whole.", metavar="PATH")
    test_data_path: list[str] = flag(
        [], "Weights and prefixes of a separate test dataset, used whole.", metavar="PATH")
    mock_data: bool = flag(False, "Train on synthetic documents instead of files (Megatron's "
                           "MockGPTDataset); the split is then 1,1,1.")
    mmap_bin_files: bool = flag(True, "Read the .bin files with file reads instead of "
                                "memory-mapping them; default: memory-mapped.",
                                name="--no-mmap-bin-files", negative=True)
    tokenizer_type: str = flag("GPT2BPETokenizer", "What type of tokenizer to use.",
                               choices=TOKENIZER_TYPES)
    tokenizer_model: str | None = flag(
        None, "Tokenizer model: SentencePiece .model file (SentencePieceTokenizer, "
        "GPTSentencePieceTokenizer, Llama2Tokenizer), tiktoken .json vocabulary (TikTokenizer) "
        "or Hugging Face tokenizer directory (HuggingFaceTokenizer).")
    vocab_file: str | None = flag(None, "Path to the vocab file (GPT2BPETokenizer: vocab.json).")
    merge_file: str | None = flag(None, "Path to the BPE merge file (GPT2BPETokenizer: "
                                  "merges.txt).")
    vocab_size: int | None = flag(
        None, "Size of the vocabulary before padding: NullTokenizer's ids are 0..N-1 with eod "
        "N-1; TikTokenizer's vocabulary (default 131072).")
    tiktoken_pattern: str | None = flag(None, "Pre-tokenization pattern of TikTokenizer; "
                                        "default: v2.", choices=("v1", "v2"))
    tiktoken_num_special_tokens: int = flag(
        1000, "Number of special tokens at the start of TikTokenizer's vocabulary.")
    tokenizer_special_tokens: list[str] | None = flag(
        None, "TikTokenizer's special tokens (must include <unk> <s> </s> <mask> <pad> <cls> "
        "<sep>); default: those seven.", metavar="TOKEN")
    null_tokenizer_eod_id: int | None = flag(
        None, "EOD token id of NullTokenizer; default: --vocab-size - 1.")
    tokenizer_hf_no_include_special_tokens: bool = flag(
        False, "HuggingFaceTokenizer: do not add the tokenizer's special tokens (e.g. BOS) when "
        "converting text to ids.")
    make_vocab_size_divisible_by: int = flag(
        128, "Pad the vocabulary to be divisible by this value (not multiplied by the TP size, "
        "so every layout builds the same model).")
    data_cache_path: str | None = flag(None, "Directory to hold cached index files.")
    eod_mask_loss: bool = flag(False, "Mask loss for the end of document tokens (positions "
                               "whose input token is the tokenizer's eod).")

    def __post_init__(self) -> None:
        _positive(self, "make_vocab_size_divisible_by")
        per_split = self.per_split_paths
        sources = [name for name, used in (("--data-path", self.data_path),
                                           ("--mock-data", self.mock_data),
                                           ("--train/valid/test-data-path", per_split))
                   if used]
        if len(sources) > 1:
            raise ConfigError(f"give one data source, not {' and '.join(sources)}")
        if per_split and self.split is not None:
            raise ConfigError("--split applies to --data-path; the --train/valid/test-data-path "
                              "datasets are used whole, so drop --split")
        if per_split and not self.train_data_path:
            raise ConfigError("--valid-data-path / --test-data-path need --train-data-path")
        if self.tiktoken_num_special_tokens < 0:
            raise ConfigError("--tiktoken-num-special-tokens must be >= 0")
        if self.vocab_size is not None:
            _positive(self, "vocab_size")

    @property
    def per_split_paths(self) -> bool:
        """Whether separate --train/valid/test-data-path datasets are given."""
        return bool(self.train_data_path or self.valid_data_path or self.test_data_path)

    @property
    def has_source(self) -> bool:
        """Whether the run names its data (otherwise it is the embedded demo)."""
        return bool(self.data_path or self.mock_data or self.per_split_paths)

    def effective_split(self) -> str:
        """The split the datasets are cut by: 1,1,1 for --mock-data (Megatron), --split, or
        Megatron's legacy default."""
        if self.mock_data:
            return MOCK_SPLIT
        return self.split if self.split is not None else LEGACY_SPLIT

    def tokenizer_options(self) -> dict[str, Any]:
        """The keyword arguments of ``megatron_h2.data.build_tokenizer`` beyond type, model and
        vocabulary size."""
        return {"vocab_file": self.vocab_file, "merge_file": self.merge_file,
                "tiktoken_pattern": self.tiktoken_pattern,
                "tiktoken_num_special_tokens": self.tiktoken_num_special_tokens,
                "special_tokens": self.tokenizer_special_tokens,
                "null_tokenizer_eod_id": self.null_tokenizer_eod_id,
                "hf_include_special_tokens": not self.tokenizer_hf_no_include_special_tokens}

    def padded_vocab_size(self, vocab_size: int) -> int:
        """The model's vocabulary for a tokenizer of ``vocab_size`` (see :func:`pad_vocab_size`)."""
        return pad_vocab_size(vocab_size, self.make_vocab_size_divisible_by)
