"""Convert checkpoints between Hugging Face (Llama, GPT-2), Megatron-LM and megatron_h2.

    python tools/convert_checkpoint.py --from hf --to megatron_h2 --input HF_DIR --output SAVE
    python tools/convert_checkpoint.py --from megatron_h2 --to hf --input SAVE --output HF_DIR \
        [--iteration N]
    python tools/convert_checkpoint.py --from megatron --to megatron_h2|hf \
        --input MEGATRON_DIR --output DIR [--iteration N]
    python tools/convert_checkpoint.py --from megatron_h2 --to megatron --input SAVE \
        --output MEGATRON_DIR --target-tensor-parallel-size T \
        --target-pipeline-parallel-size P [--make-vocab-size-divisible-by 128] [--iteration N]

A thin command line over :mod:`megatron_h2.checkpointing.hf` and
:mod:`megatron_h2.checkpointing.megatron_write`. Megatron-LM checkpoints are read in either
format (torch_dist or the legacy torch) at any TP/PP and written as torch_dist. Bad input
prints one line, ``error: <what to fix>``, and exits with status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from megatron_h2.checkpointing.hf import (
    DEFAULT_MAX_SHARD_SIZE,
    convert_hf_to_megatron,
    convert_megatron_to_hf,
)
from megatron_h2.checkpointing.megatron_write import (
    convert_megatron_to_ours,
    convert_ours_to_megatron,
)
from megatron_h2.errors import ConfigError

FORMATS = ("hf", "megatron_h2", "megatron")
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
    parser = _Parser(description="Convert checkpoints between Hugging Face (Llama, GPT-2), "
                                 "Megatron-LM and megatron_h2.")
    parser.add_argument("--from", dest="src", required=True, help="hf, megatron_h2 or megatron")
    parser.add_argument("--to", dest="dst", required=True, help="hf, megatron_h2 or megatron")
    parser.add_argument("--input", required=True, help="directory to read")
    parser.add_argument("--output", required=True, help="directory to write (new or empty)")
    parser.add_argument("--iteration", type=int, default=None,
                        help="iteration to convert (default: the latest)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                        help="pad the vocabulary to a multiple of this (default 128; "
                             "--to megatron: times the target TP, as Megatron-LM pads)")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=None,
                        help="--to megatron: the TP of the Megatron-LM run that will load it")
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                        help="--to megatron: the PP of the Megatron-LM run that will load it")
    parser.add_argument("--max-shard-size", default=None,
                        help="largest HF safetensors file, e.g. 5GB (default 5GiB)")
    return parser


def _check_directions(args: argparse.Namespace) -> None:
    for flag, value in (("--from", args.src), ("--to", args.dst)):
        if value not in FORMATS:
            raise ConfigError(f"{flag} must be one of {', '.join(FORMATS)}, got {value!r}")
    if args.src == args.dst:
        raise ConfigError(f"--from and --to are both {args.src}; nothing to convert")
    if "megatron" in (args.src, args.dst) and "hf" in (args.src, args.dst) \
            and args.src != "megatron":
        raise ConfigError("convert between Hugging Face and Megatron-LM through megatron_h2 "
                          "(--from hf --to megatron_h2, then --from megatron_h2 --to megatron)")
    if args.src == "hf" and args.iteration is not None:
        raise ConfigError("--iteration applies only to --from megatron_h2 or megatron")
    if args.dst == "hf" and args.make_vocab_size_divisible_by is not None:
        raise ConfigError("--make-vocab-size-divisible-by applies only to --to megatron_h2 "
                          "or megatron")
    if args.dst != "hf" and args.max_shard_size is not None:
        raise ConfigError("--max-shard-size applies only to --to hf")
    targets = (args.target_tensor_parallel_size, args.target_pipeline_parallel_size)
    if args.dst == "megatron" and None in targets:
        raise ConfigError("--to megatron needs --target-tensor-parallel-size and "
                          "--target-pipeline-parallel-size (the layout of the run that loads it)")
    if args.dst != "megatron" and targets != (None, None):
        raise ConfigError("--target-tensor-parallel-size / --target-pipeline-parallel-size "
                          "apply only to --to megatron")
    if args.src == "megatron" and args.make_vocab_size_divisible_by is not None:
        raise ConfigError("--make-vocab-size-divisible-by does not apply to --from megatron: "
                          "its vocabulary comes padded")


def _run_megatron(args: argparse.Namespace) -> str:
    if args.dst == "megatron":
        divisible_by = args.make_vocab_size_divisible_by or 128
        path = convert_ours_to_megatron(args.input, args.output,
                                        args.target_tensor_parallel_size,
                                        args.target_pipeline_parallel_size, divisible_by,
                                        args.iteration)
        return (f"converted megatron_h2 checkpoint {args.input} to Megatron-LM torch_dist "
                f"checkpoint {path} (TP {args.target_tensor_parallel_size}, PP "
                f"{args.target_pipeline_parallel_size})")
    if args.dst == "megatron_h2":
        path = convert_megatron_to_ours(args.input, args.output, args.iteration)
        return f"converted Megatron-LM checkpoint {args.input} to megatron_h2 checkpoint {path}"
    with tempfile.TemporaryDirectory() as tmp:
        convert_megatron_to_ours(args.input, Path(tmp) / "ours", args.iteration)
        shard = parse_size(args.max_shard_size) if args.max_shard_size else \
            DEFAULT_MAX_SHARD_SIZE
        path = convert_megatron_to_hf(Path(tmp) / "ours", args.output, None, shard)
    return f"converted Megatron-LM checkpoint {args.input} to Hugging Face model {path}"


def run(args: argparse.Namespace) -> str:
    """Do the conversion; returns a one-line summary."""
    _check_directions(args)
    if "megatron" in (args.src, args.dst):
        return _run_megatron(args)
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

