"""Entry point behind ``pretrain_gpt.py``: validate, build, train.

Everything the user can get wrong is checked before the model is built: flags (in the config
dataclasses), data files, the tokenizer, the checkpoint to load.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import numpy as np

from megatron_h2.checkpointing import find_latest_iteration, iteration_dir, read_metadata
from megatron_h2.config import RunConfig
from megatron_h2.devices import Accelerator, get_accelerator
from megatron_h2.errors import ConfigError, TrainingError
from megatron_h2.training.arguments import LaunchOptions, config_from_args
from megatron_h2.training.metrics import MetricsWriter, log
from megatron_h2.training.state import TrainProgress, check_compatible, load_training_state

DEFAULT_RUN_DIR = Path("runs") / "default"


def default_cache_dir() -> Path:
    """Where the embedded corpus is cached (``$MEGATRON_H2_CACHE`` or ~/.cache/megatron_h2)."""
    return Path(os.environ.get("MEGATRON_H2_CACHE", Path.home() / ".cache" / "megatron_h2"))


def prepare_data(cfg: RunConfig):
    """Resolve data and tokenizer; fills ``cfg.model.vocab_size``. Returns the tokenizer."""
    from megatron_h2.data import (
        build_tokenizer,
        check_data_prefix,
        ensure_default_corpus,
        parse_data_path,
    )

    if not cfg.data.data_path:
        log("no --data-path given: using the embedded corpus (Python standard library sources)")
        prefix, spm_model = ensure_default_corpus(str(default_cache_dir() / "default_corpus"))
        cfg.data.data_path = [prefix]
        cfg.data.tokenizer_type = "SentencePieceTokenizer"
        cfg.data.tokenizer_model = spm_model
    else:
        for _, prefix in parse_data_path(cfg.data.data_path):
            check_data_prefix(prefix)
    tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model,
                                cfg.data.vocab_size)
    cfg.model.vocab_size = cfg.data.padded_vocab_size(tokenizer.vocab_size)
    return tokenizer


def check_load(cfg: RunConfig, launch: LaunchOptions) -> None:
    """Fail early on a --load target that is missing, incomplete, corrupt or of another model.

    Runs after :func:`prepare_data`, which sets the padded vocabulary size.
    """
    load = cfg.training.load
    if not load:
        return
    if not Path(load).exists():
        if load == cfg.training.save:
            return  # first launch of a self-resuming job: nothing saved yet
        raise ConfigError(f"--load directory {load} does not exist")
    iteration = launch.ckpt_step if launch.ckpt_step is not None else find_latest_iteration(load)
    if iteration is not None:
        ckpt_dir = iteration_dir(load, iteration)
        check_compatible(read_metadata(ckpt_dir), cfg, ckpt_dir)


def build_datasets(cfg: RunConfig):
    from megatron_h2.data import build_gpt_datasets

    t = cfg.training
    # The test split is not used during training: ask for none so small corpora still work.
    num_samples = (t.train_iters * t.global_batch_size, t.eval_iters * t.global_batch_size, 0)
    return build_gpt_datasets(cfg.data.data_path, cfg.data.split, cfg.model.seq_length, t.seed,
                              num_samples, cache_dir=cfg.data.data_cache_path)


def seed_everything(seed: int, accelerator: Accelerator) -> None:
    random.seed(seed)
    np.random.seed(seed)
    accelerator.manual_seed(seed)


def restore(cfg: RunConfig, launch: LaunchOptions, model, optimizer,
            accelerator: Accelerator) -> TrainProgress:
    load = cfg.training.load
    if not load or not Path(load).exists():
        if load:
            log(f"no checkpoint found in {load}: starting from scratch")
        return TrainProgress()
    progress = load_training_state(
        load, model, optimizer, cfg, accelerator, iteration=launch.ckpt_step,
        load_optim=not (launch.no_load_optim or launch.finetune),
        load_rng=not (launch.no_load_rng or launch.finetune))
    if progress is None:
        log(f"no checkpoint found in {load}: starting from scratch")
        return TrainProgress()
    if launch.finetune:
        log(f"loaded weights from {load} (iteration {progress.iteration}); finetuning from 0")
        return TrainProgress()
    log(f"resumed from {load} at iteration {progress.iteration} "
        f"({progress.consumed_samples} samples consumed)")
    return progress


def apply_demo_defaults(cfg: RunConfig) -> bool:
    """With no --data-path, the run is the embedded demo: give it save and log directories."""
    if cfg.data.data_path:
        return False
    if cfg.training.save is None:
        cfg.training.save = str(DEFAULT_RUN_DIR / "checkpoints")
    if cfg.training.tensorboard_dir is None:
        cfg.training.tensorboard_dir = str(DEFAULT_RUN_DIR / "tensorboard")
    return True


def train(cfg: RunConfig, launch: LaunchOptions) -> TrainProgress:
    """Build everything for ``cfg`` and train; returns the final progress."""
    from megatron_h2.models.gpt import GPTModel, init_parameters, num_parameters
    from megatron_h2.training.optimizer import build_optimizer
    from megatron_h2.training.trainer import Trainer

    start = time.perf_counter()
    accelerator = get_accelerator(cfg.training.device)
    demo = apply_demo_defaults(cfg)
    tokenizer = prepare_data(cfg)
    check_load(cfg, launch)
    train_ds, valid_ds, _ = build_datasets(cfg)
    if train_ds is None:
        raise ConfigError(f"--split {cfg.data.split} leaves no training data")
    seed_everything(cfg.training.seed, accelerator)
    model = GPTModel(cfg.model, accelerator.kernels)
    init_parameters(model, cfg.model, cfg.training.seed)
    model.to(accelerator.device)
    optimizer = build_optimizer(model, cfg.optimizer, accelerator.kernels)
    progress = restore(cfg, launch, model, optimizer, accelerator)
    m = cfg.model
    log(f"device: {accelerator.describe()} | bf16: {cfg.training.bf16}")
    log(f"model: {num_parameters(m) / 1e6:.2f}M parameters | layers {m.num_layers} | hidden "
        f"{m.hidden_size} | heads {m.num_attention_heads} (query groups {m.num_query_groups}) | "
        f"ffn {m.ffn_hidden_size} | seq {m.seq_length} | vocab {tokenizer.vocab_size} "
        f"(padded {m.vocab_size}) | recompute {m.recompute}")
    log(f"data: {' '.join(cfg.data.data_path)} | split {cfg.data.split} | "
        f"{len(train_ds)} training samples | setup took {time.perf_counter() - start:.1f} s")
    if progress.iteration >= cfg.training.train_iters:
        log(f"checkpoint is already at iteration {progress.iteration} >= --train-iters "
            f"{cfg.training.train_iters}: nothing to train")
        return progress
    metrics = MetricsWriter(cfg.training.train_iters, cfg.training.log_jsonl,
                            cfg.training.tensorboard_dir)
    try:
        progress = Trainer(cfg, accelerator, model, optimizer, train_ds, valid_ds, metrics,
                           progress).run()
    finally:
        metrics.close()
    log(f"training finished at iteration {progress.iteration} in "
        f"{time.perf_counter() - start:.1f} s")
    if cfg.training.save:
        log(f"checkpoint: {cfg.training.save}")
    if cfg.training.tensorboard_dir:
        log(f"TensorBoard logs: {cfg.training.tensorboard_dir} "
            f"(view with: tensorboard --logdir {cfg.training.tensorboard_dir})")
    if demo:
        log("this was the embedded demo; see README.md for training on your own data")
    return progress


def main(argv: list[str] | None = None) -> int:
    """Run training; user errors print one line (``error: ...``) and return 2."""
    try:
        cfg, launch = config_from_args(argv)
        train(cfg, launch)
    except (ConfigError, TrainingError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0
