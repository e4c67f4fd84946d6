"""Tokenize a jsonl corpus into Megatron .bin/.idx files (Megatron-LM's flags).

Example:
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model \
        --append-eod --workers 4
writes data/corpus_text_document.bin and .idx.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="jsonl file, one JSON object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to tokenize (default: text)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True,
                       help="GPTSentencePieceTokenizer, SentencePieceTokenizer, "
                            "HuggingFaceTokenizer or NullTokenizer")
    group.add_argument("--tokenizer-model", default=None,
                       help="SentencePiece .model or HF tokenizer dir")
    group.add_argument("--vocab-size", type=int, default=None, help="vocab size (NullTokenizer)")
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
    from megatron_h2.data.preprocess import preprocess_jsonl
    from megatron_h2.errors import ConfigError

    try:
        preprocess_jsonl(
            args.input, args.output_prefix, args.tokenizer_type, args.tokenizer_model,
            args.vocab_size, args.json_keys, args.append_eod, args.workers, args.log_interval,
        )
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
