"""Data pipeline: Megatron indexed datasets, tokenizers, preprocessing, GPT/blended datasets."""

from megatron_h2.data.blended_dataset import BlendedDataset, build_blending_indices, component_sizes
from megatron_h2.data.bpe_tokenizers import GPT2BPETokenizer, TikTokenizer
from megatron_h2.data.default_corpus import TOKENIZER_TYPE as DEFAULT_CORPUS_TOKENIZER_TYPE
from megatron_h2.data.default_corpus import ensure_default_corpus
from megatron_h2.data.gpt_dataset import (
    GPTDataset,
    build_gpt_datasets,
    build_per_split_datasets,
    check_token_ids,
    parse_data_path,
    parse_split,
    split_document_ranges,
)
from megatron_h2.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetBuilder,
    check_data_prefix,
    get_bin_path,
    get_idx_path,
    optimal_dtype,
)
from megatron_h2.data.mock_dataset import MockLowLevelDataset, build_mock_gpt_datasets
from megatron_h2.data.preprocess import preprocess_jsonl
from megatron_h2.data.tokenizer import (
    TOKENIZER_TYPES,
    GPTSentencePieceTokenizer,
    HuggingFaceTokenizer,
    Llama2Tokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    build_tokenizer,
    train_sentencepiece,
)

__all__ = [
    "BlendedDataset",
    "DEFAULT_CORPUS_TOKENIZER_TYPE",
    "DTYPE_CODES",
    "GPT2BPETokenizer",
    "GPTDataset",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "Llama2Tokenizer",
    "MockLowLevelDataset",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TOKENIZER_TYPES",
    "TikTokenizer",
    "Tokenizer",
    "build_blending_indices",
    "build_gpt_datasets",
    "build_mock_gpt_datasets",
    "build_per_split_datasets",
    "build_tokenizer",
    "check_data_prefix",
    "check_token_ids",
    "component_sizes",
    "ensure_default_corpus",
    "get_bin_path",
    "get_idx_path",
    "optimal_dtype",
    "parse_data_path",
    "parse_split",
    "preprocess_jsonl",
    "split_document_ranges",
    "train_sentencepiece",
]
