"""Megatron-compatible command line, mapped onto the typed configs of ``megatron_h2.config``.

Only the mapping lives here; every check sits next to its field in the dataclasses.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from megatron_h2.config import (
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
)
from megatron_h2.errors import ConfigError


@dataclass
class LaunchOptions:
    """Options that shape this launch but are not part of the saved run config."""

    ckpt_step: int | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    explicit: frozenset[str] = frozenset()  # config fields the user set on the command line


def _add_model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--num-query-groups", type=int)
    g.add_argument("--group-query-attention", action="store_true",
                   help="accepted for Megatron compatibility; --num-query-groups sets the groups")
    g.add_argument("--seq-length", type=int)
    g.add_argument("--max-position-embeddings", type=int)
    g.add_argument("--norm-epsilon", type=float)
    g.add_argument("--rotary-base", type=float)
    g.add_argument("--init-method-std", type=float)
    g.add_argument("--hidden-dropout", type=float)
    g.add_argument("--attention-dropout", type=float)
    g.add_argument("--recompute-granularity", choices=["full", "selective"])
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron's shorthand for --recompute-granularity selective")
    # Fixed architecture choices: accepted so that Megatron LLaMA scripts run unchanged.
    g.add_argument("--normalization", choices=["RMSNorm"])
    g.add_argument("--position-embedding-type", choices=["rope"])
    for flag in ("--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                 "--use-rotary-position-embeddings", "--no-masked-softmax-fusion"):
        g.add_argument(flag, action="store_true", help="always on in megatron_h2")


def _add_training(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument("--train-iters", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--bf16", action="store_true", help="bf16 autocast with fp32 master weights")
    g.add_argument("--fp16", action="store_true", help="not supported: use --bf16")
    g.add_argument("--device", help="cpu, cuda, ... (default: detect)")
    g.add_argument("--log-interval", type=int)
    g.add_argument("--eval-interval", type=int)
    g.add_argument("--eval-iters", type=int)
    g.add_argument("--exit-interval", type=int)
    g.add_argument("--tensorboard-dir")
    g.add_argument("--log-jsonl", help="append one JSON object per logged iteration")
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=["adam"], help="AdamW (decoupled weight decay)")
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float)
    g.add_argument("--lr-warmup-iters", type=int)
    g.add_argument("--lr-decay-style", choices=["cosine", "linear", "constant"])
    g.add_argument("--lr-decay-iters", type=int)
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--adam-beta1", type=float)
    g.add_argument("--adam-beta2", type=float)
    g.add_argument("--adam-eps", type=float)
    g.add_argument("--clip-grad", type=float)


def _add_data_and_checkpoint(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+",
                   help="PREFIX [PREFIX ...] or W1 PREFIX1 W2 PREFIX2 ... (default: embedded "
                        "corpus built from the Python standard library)")
    g.add_argument("--split")
    g.add_argument("--tokenizer-type")
    g.add_argument("--tokenizer-model")
    g.add_argument("--vocab-size", type=int, help="vocabulary size for NullTokenizer")
    g.add_argument("--make-vocab-size-divisible-by", type=int)
    g.add_argument("--data-cache-path")
    g.add_argument("--num-workers", type=int)
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save")
    g.add_argument("--load")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--ckpt-step", type=int, help="load this iteration instead of the latest")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load weights only and start at iteration 0")


def _layer_split(text: str) -> list[int] | list[list[int]]:
    """``3,1`` -> [3, 1] (layers per stage); ``2,1/1,2`` -> [[2, 1], [1, 2]] (per model chunk,
    the stages' counts of chunk 0, then of chunk 1: the layers in model order)."""
    try:
        chunks = [[int(x) for x in chunk.split(",")] for chunk in text.split("/")]
    except ValueError:
        raise ConfigError(f"--pipeline-layer-split expects layer counts per stage separated by "
                          f"',' and model chunks separated by '/', such as 3,1 or 2,1/1,2; got "
                          f"{text!r}") from None
    return chunks[0] if len(chunks) == 1 else chunks


def _add_parallel(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (DP = world size / (TP x PP))")
    g.add_argument("--tensor-model-parallel-size", type=int)
    g.add_argument("--pipeline-model-parallel-size", type=int)
    g.add_argument("--pipeline-layer-split",
                   help="layers per pipeline stage, e.g. 3,1 (embedding on the first stage, "
                        "head and loss on the last); with virtual stages per model chunk, "
                        "chunks separated by '/': 2,1/1,2 = chunk 0 of stages 0 and 1 (2 and 1 "
                        "layers), then chunk 1 (1 and 2), the layers in model order")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state over data-parallel ranks (ZeRO-1)")
    g.add_argument("--distributed-timeout-minutes", type=float)
    g.add_argument("--ddp-bucket-size-mb", type=float)
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="always on: gradient all-reduce overlaps the last backward")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int,
                   help="model chunks per pipeline stage (Megatron's interleaved schedule)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int,
                   help="layers per model chunk: virtual pipeline size = layers / PP / N")
    g.add_argument("--pipeline-schedule", choices=["1f1b", "interleaved", "zero-bubble"],
                   help="default: interleaved with virtual stages, else 1f1b; zero-bubble "
                        "splits the backward and defers weight gradients into the bubble")
    g = p.add_argument_group("heterogeneous clusters")
    g.add_argument("--hetero-plan", help="YAML plan (tools/plan.py writes one): pipeline stages "
                   "on chip types, each with its own TP, layers and recompute")
    g.add_argument("--force-bridge", action="store_true",
                   help="route every stage boundary through the host-staged cross-vendor bridge")
    g.add_argument("--bridge-dtype", choices=["fp32", "bf16"],
                   help="precision of activations and gradients crossing the bridge")
    g.add_argument("--bridge-chunk-mb", type=float)
    g.add_argument("--timeline-trace", help="write a Chrome/Perfetto trace of every rank's "
                   "forward, backward, send and receive per micro-batch")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py", description="Megatron-style GPT pretraining (megatron_h2). With "
        "no flags, trains a small model on an embedded corpus.")
    _add_model(p)
    _add_training(p)
    _add_data_and_checkpoint(p)
    _add_parallel(p)
    return p


def _pick(ns: argparse.Namespace, cls: type, renames: dict[str, str] | None = None,
          exclude: tuple[str, ...] = ()) -> dict:
    """Flags that were given (not None) and that name a field of ``cls``."""
    renames = renames or {}
    names = {f.name for f in fields(cls)} - set(exclude)
    out = {}
    for key, value in vars(ns).items():
        key = renames.get(key, key)
        if key in names and value is not None:
            out[key] = value
    return out


def config_from_args(argv: list[str] | None = None) -> tuple[RunConfig, LaunchOptions]:
    """Parse Megatron-style flags into a validated :class:`RunConfig`."""
    ns = build_parser().parse_args(argv)
    if ns.fp16:
        raise ConfigError("--fp16 is not supported; use --bf16 (fp32 master weights, no loss "
                          "scaling needed)")
    if ns.pipeline_layer_split is not None:  # parsed here: a bad one is a one-line error
        ns.pipeline_layer_split = _layer_split(ns.pipeline_layer_split)
    if ns.recompute_activations and ns.recompute_granularity is None:
        ns.recompute_granularity = "selective"
    model = ModelConfig(**_pick(ns, ModelConfig, {"recompute_granularity": "recompute"},
                               exclude=("vocab_size",)))
    data = DataConfig(**_pick(ns, DataConfig))
    optim = OptimizerConfig(**_pick(ns, OptimizerConfig))
    training = TrainingConfig(**_pick(ns, TrainingConfig))
    parallel = ParallelConfig(**_pick(ns, ParallelConfig))
    explicit = frozenset(k for k, v in vars(ns).items() if v not in (None, False))
    launch = LaunchOptions(ckpt_step=ns.ckpt_step, no_load_optim=ns.no_load_optim,
                           no_load_rng=ns.no_load_rng, finetune=ns.finetune, explicit=explicit)
    return RunConfig(model=model, data=data, optimizer=optim, training=training,
                     parallel=parallel), launch
