"""Convert checkpoints between Hugging Face (Llama, GPT-2) and megatron_h2.

    python tools/convert_checkpoint.py --from hf --to megatron_h2 --input HF_DIR --output SAVE
    python tools/convert_checkpoint.py --from megatron_h2 --to hf --input SAVE --output HF_DIR \
        [--iteration N]

A thin command line over :mod:`megatron_h2.checkpointing.hf`. Bad input prints one line,
``error: <what to fix>``, and exits with status 2.
"""

from __future__ import annotations

import argparse
import re
import sys

from megatron_h2.checkpointing.hf import (
    DEFAULT_MAX_SHARD_SIZE,
    convert_hf_to_megatron,
    convert_megatron_to_hf,
)
from megatron_h2.errors import ConfigError

FORMATS = ("hf", "megatron_h2")
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10,
               "MIB": 2**20, "GIB": 2**30}


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"`` or a plain byte count -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _SIZE_UNITS or int(match.group(1)) <= 0:
        raise ConfigError(f"--max-shard-size must be a positive size like 5GB or 500MB, "
                          f"got {text!r}")
    return int(match.group(1)) * _SIZE_UNITS[unit]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(description="Convert checkpoints between Hugging Face (Llama, GPT-2) "
                                 "and megatron_h2.")
    parser.add_argument("--from", dest="src", required=True, help="hf or megatron_h2")
    parser.add_argument("--to", dest="dst", required=True, help="hf or megatron_h2")
    parser.add_argument("--input", required=True, help="directory to read")
    parser.add_argument("--output", required=True, help="directory to write (new or empty)")
    parser.add_argument("--iteration", type=int, default=None,
                        help="megatron_h2 iteration to convert (default: the latest)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                        help="pad the vocabulary to a multiple of this (default 128)")
    parser.add_argument("--max-shard-size", default=None,
                        help="largest HF safetensors file, e.g. 5GB (default 5GiB)")
    return parser


def _check_directions(args: argparse.Namespace) -> None:
    for flag, value in (("--from", args.src), ("--to", args.dst)):
        if value not in FORMATS:
            raise ConfigError(f"{flag} must be one of {', '.join(FORMATS)}, got {value!r}")
    if args.src == args.dst:
        raise ConfigError(f"--from and --to are both {args.src}; nothing to convert")
    if args.src == "hf" and args.iteration is not None:
        raise ConfigError("--iteration applies only to --from megatron_h2")
    if args.dst == "hf" and args.make_vocab_size_divisible_by is not None:
        raise ConfigError("--make-vocab-size-divisible-by applies only to --to megatron_h2")
    if args.dst == "megatron_h2" and args.max_shard_size is not None:
        raise ConfigError("--max-shard-size applies only to --to hf")


def run(args: argparse.Namespace) -> str:
    """Do the conversion; returns a one-line summary."""
    _check_directions(args)
    if args.src == "hf":
        divisible_by = args.make_vocab_size_divisible_by
        divisible_by = 128 if divisible_by is None else divisible_by
        path = convert_hf_to_megatron(args.input, args.output, divisible_by)
        return f"converted Hugging Face model {args.input} to megatron_h2 checkpoint {path}"
    shard = parse_size(args.max_shard_size) if args.max_shard_size else DEFAULT_MAX_SHARD_SIZE
    path = convert_megatron_to_hf(args.input, args.output, args.iteration, shard)
    return f"converted megatron_h2 checkpoint {args.input} to Hugging Face model {path}"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 ok, 2 bad input)."""
    try:
        print(run(build_parser().parse_args(argv)))
    except (ConfigError, OSError) as exc:
        message = " ".join(str(exc).split())  # always one line
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0

