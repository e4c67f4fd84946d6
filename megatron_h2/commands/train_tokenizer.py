"""Train a byte-fallback SentencePiece tokenizer on jsonl or text files.

Example:
    python tools/train_tokenizer.py --input corpus.jsonl --vocab-size 8000 --model-prefix tok
writes tok.model and tok.vocab; use them with --tokenizer-type GPTSentencePieceTokenizer.
"""

from __future__ import annotations

import argparse
import sys
import time


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help=".jsonl/.json files (read via --json-keys) or plain text files")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="keys holding text (default: text)")
    parser.add_argument("--vocab-size", type=int, required=True, help="number of pieces")
    parser.add_argument("--model-prefix", required=True, help="output path without .model/.vocab")
    parser.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    parser.add_argument("--max-lines", type=int, default=2_000_000,
                        help="train on at most this many (first) lines; 0 for all")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the tool; returns the process exit code (2 on a configuration error)."""
    args = _parser().parse_args(argv)
    from megatron_h2.data.tokenizer import build_tokenizer, train_sentencepiece
    from megatron_h2.errors import ConfigError

    started = time.perf_counter()
    try:
        model = train_sentencepiece(
            args.input, args.model_prefix, args.vocab_size, model_type=args.model_type,
            json_keys=args.json_keys, max_lines=args.max_lines or None,
        )
        tokenizer = build_tokenizer("GPTSentencePieceTokenizer", model)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {model} ({tokenizer.vocab_size} pieces, eod id {tokenizer.eod}) "
          f"in {time.perf_counter() - started:.1f} s", flush=True)
    return 0

