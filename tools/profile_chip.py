#!/usr/bin/env python3
"""Profile this machine's chip for the planner: times one transformer layer, the embedding and
the head, forward and backward, for a few micro-batch sizes, and writes the profile table that
`tools/plan.py --profile` reads.

    python tools/profile_chip.py --chip fast --chip slow --model examples/models/tiny.yaml \\
        --micro-batch-sizes 1,2,4 --output runs/profile.yaml

Model flags are pretrain_gpt.py's, as tools/plan.py reads them (or `--model FILE`, a model YAML
as in examples/models/, whose keys they override).
Measure with the thread count your training processes use (`--threads`).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_h2.errors import ConfigError  # noqa: E402
from megatron_h2.planner.model import add_model_arguments, model_from_arguments  # noqa: E402


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chip", action="append", required=True,
                   help="chip name(s) of the cluster file this measurement stands for")
    add_model_arguments(p)
    p.add_argument("--micro-batch-sizes", default="1,2,4")
    p.add_argument("--device", help="cpu, cuda, ... (default: detect)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--output", required=True)
    return p.parse_args(argv)


def model_config(a):
    """The model of the flags and --model file (the vocabulary padded as pretrain_gpt.py and the
    planner pad it)."""
    return model_from_arguments(a, require_global_batch=False)[0]


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse(argv)
        sizes = [int(x) for x in a.micro_batch_sizes.split(",")]
        if any(x <= 0 for x in sizes):
            raise ConfigError("--micro-batch-sizes must be positive integers such as 1,2,4")
        cfg = model_config(a)
        import torch

        from megatron_h2.devices import get_accelerator
        from megatron_h2.training.profile_chip import profile_model, write_profile

        torch.set_num_threads(a.threads)
        acc = get_accelerator(a.device)
        print(f"profiling {acc.describe()} with {a.threads} thread(s): hidden {cfg.hidden_size},"
              f" seq {cfg.seq_length}, micro-batches {sizes}", flush=True)
        table = profile_model(cfg, acc, sizes, a.bf16, a.warmup, a.reps)
        write_profile(a.output, cfg, a.chip, table,
                      f"measured by tools/profile_chip.py on {acc.device_type}, "
                      f"{a.threads} thread(s), bf16 {a.bf16}")
        print(f"profile table written to {a.output}")
    except ValueError as exc:  # ConfigError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
