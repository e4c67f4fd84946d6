"""Tokenize a jsonl corpus into Megatron .bin/.idx files (Megatron-LM's flags).

Examples:
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \
        --merge-file gpt2-merges.txt --append-eod --workers 4
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model --append-eod
write data/corpus_text_document.bin and .idx. The tokenizer flags are pretrain_gpt.py's.
"""

from __future__ import annotations

import argparse
import sys

# The tokenizer flags shared with pretrain_gpt.py (megatron_h2.config.DataConfig).
TOKENIZER_FLAGS = ("tokenizer_model", "vocab_file", "merge_file", "vocab_size",
                   "tiktoken_pattern", "tiktoken_num_special_tokens", "tokenizer_special_tokens",
                   "null_tokenizer_eod_id", "tokenizer_hf_no_include_special_tokens")


def _parser() -> argparse.ArgumentParser:
    from megatron_h2.config import TOKENIZER_TYPES, DataConfig
    from megatron_h2.training.arguments import add_config_flags

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="jsonl file, one JSON object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to tokenize (default: text)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES,
                       help="What type of tokenizer to use.")
    add_config_flags(group, DataConfig, TOKENIZER_FLAGS)
    group.add_argument("--append-eod", action="store_true",
                       help="append the eod token to every document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="output path without suffix; writes PREFIX_{key}_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1,
                       help="worker processes (output is identical)")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="documents between progress lines")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the tool; returns the process exit code (2 on a configuration error)."""
    args = _parser().parse_args(argv)
    from megatron_h2.config import DataConfig
    from megatron_h2.data.preprocess import preprocess_jsonl
    from megatron_h2.errors import ConfigError
    from megatron_h2.training.arguments import config_values

    try:
        data = DataConfig(tokenizer_type=args.tokenizer_type, **config_values(args, DataConfig))
        preprocess_jsonl(
            args.input, args.output_prefix, data.tokenizer_type, data.tokenizer_model,
            data.vocab_size, args.json_keys, args.append_eod, args.workers, args.log_interval,
            tokenizer_options=data.tokenizer_options(),
        )
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0

