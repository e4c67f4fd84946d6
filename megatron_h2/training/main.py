"""Entry point behind ``pretrain_gpt.py``: validate, build, train.

Everything the user can get wrong is checked before any process group starts and before the
model is built: flags (in the config dataclasses), the parallel layout, data files, the
tokenizer, the checkpoint to load. A rank that fails later takes the job down at once: it
prints its error, exits, and the other ranks' collectives fail instead of waiting.
"""

from __future__ import annotations

import os
import random
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch.distributed as dist

from megatron_h2.checkpointing import find_latest_iteration, iteration_dir, read_metadata
from megatron_h2.checkpointing.distributed import TrainProgress, check_compatible
from megatron_h2.config import RunConfig
from megatron_h2.devices import Accelerator, detect_device_type, get_accelerator
from megatron_h2.distributed.topology import (
    LaunchEnv,
    Topology,
    accelerator_for_rank,
    build_topology,
    default_backend,
    init_process_group,
)
from megatron_h2.errors import ConfigError, RankConfigError, TrainingError
from megatron_h2.hetero_plan import HeteroPlan
from megatron_h2.training.arguments import LaunchOptions, config_from_args
from megatron_h2.training.layout import check_plan_for_model, load_hetero_plan, uniform_plan
from megatron_h2.training.metrics import MetricsWriter, log

DEFAULT_RUN_DIR = Path("runs") / "default"


def quiet(message: str) -> None:
    """The logger of ranks other than 0."""


def default_cache_dir() -> Path:
    """Where the embedded corpus is cached (``$MEGATRON_H2_CACHE`` or ~/.cache/megatron_h2)."""
    return Path(os.environ.get("MEGATRON_H2_CACHE", Path.home() / ".cache" / "megatron_h2"))


def prepare_data(cfg: RunConfig, say) -> object:
    """Resolve data and tokenizer; fills ``cfg.model.vocab_size``. Returns the tokenizer."""
    from megatron_h2.data import (
        build_tokenizer,
        check_data_prefix,
        ensure_default_corpus,
        parse_data_path,
    )

    if not cfg.data.data_path:
        say("no --data-path given: using the embedded corpus (Python standard library sources)")
        prefix, spm_model = ensure_default_corpus(str(default_cache_dir() / "default_corpus"))
        cfg.data.data_path = [prefix]
        cfg.data.tokenizer_type = "SentencePieceTokenizer"
        cfg.data.tokenizer_model = spm_model
    else:
        for _, prefix in parse_data_path(cfg.data.data_path):
            check_data_prefix(prefix)
    tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model,
                                cfg.data.vocab_size)
    # Padding does not depend on the layout (unlike Megatron's), so checkpoints move between
    # layouts; every stage's TP degree must divide the padded size (checked with the plan).
    cfg.model.vocab_size = cfg.data.padded_vocab_size(tokenizer.vocab_size)
    return tokenizer


def check_load(cfg: RunConfig, launch: LaunchOptions) -> None:
    """Fail early on a --load target that is missing, incomplete, corrupt or of another model
    (after :func:`prepare_data`, which sets the padded vocabulary size)."""
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


def build_datasets(cfg: RunConfig, topo: Topology):
    """Train / validation datasets; rank 0 builds the index caches before the others read them."""
    from megatron_h2.data import build_gpt_datasets

    t = cfg.training
    # The test split is not used during training: ask for none so small corpora still work.
    num_samples = (t.train_iters * t.global_batch_size, t.eval_iters * t.global_batch_size, 0)

    def build():
        return build_gpt_datasets(cfg.data.data_path, cfg.data.split, cfg.model.seq_length,
                                  t.seed, num_samples, cache_dir=cfg.data.data_cache_path)

    result = build() if topo.rank == 0 else None
    if topo.distributed:
        dist.barrier(group=topo.cpu_group)
    return result if result is not None else build()


def seed_everything(seed: int, accelerator: Accelerator) -> None:
    random.seed(seed)
    np.random.seed(seed)
    accelerator.manual_seed(seed)


def apply_demo_defaults(cfg: RunConfig) -> bool:
    """With no --data-path, the run is the embedded demo: give it save and log directories."""
    if cfg.data.data_path:
        return False
    if cfg.training.save is None:
        cfg.training.save = str(DEFAULT_RUN_DIR / "checkpoints")
    if cfg.training.tensorboard_dir is None:
        cfg.training.tensorboard_dir = str(DEFAULT_RUN_DIR / "tensorboard")
    return True


def validate_launch(cfg: RunConfig, launch: LaunchOptions, env: LaunchEnv, say):
    """All checks that need no process group; returns the plan, this rank's accelerator and
    the tokenizer. Checks every rank makes alike come first, this rank's own chip last."""
    if cfg.parallel.hetero_plan:
        plan = load_hetero_plan(cfg, launch.explicit)
        device = None
    else:
        device = cfg.training.device or detect_device_type()
        plan = uniform_plan(cfg.parallel, cfg.model, cfg.training, env.world_size, device)
    tokenizer = prepare_data(cfg, say)
    check_plan_for_model(plan, cfg.model, cfg.parallel, env.world_size)
    check_load(cfg, launch)
    accelerator = (accelerator_for_rank(plan, env.rank, env.local_rank) if device is None
                   else get_accelerator(device, env.local_rank))
    return plan, accelerator, tokenizer


def restore(cfg: RunConfig, launch: LaunchOptions, ckpt, say) -> TrainProgress:
    load = cfg.training.load
    if not load or not Path(load).exists():
        if load:
            say(f"no checkpoint found in {load}: starting from scratch")
        return TrainProgress()
    progress = ckpt.load(load, launch.ckpt_step,
                         load_optim=not (launch.no_load_optim or launch.finetune),
                         load_rng=not (launch.no_load_rng or launch.finetune), log=say)
    if progress is None:
        say(f"no checkpoint found in {load}: starting from scratch")
        return TrainProgress()
    if launch.finetune:
        say(f"loaded weights from {load} (iteration {progress.iteration}); finetuning from 0")
        return TrainProgress()
    say(f"resumed from {load} at iteration {progress.iteration} "
        f"({progress.consumed_samples} samples consumed)")
    return progress


def train(cfg: RunConfig, launch: LaunchOptions, env: LaunchEnv) -> TrainProgress:
    """Build everything for ``cfg`` on this rank and train; returns the final progress."""
    from megatron_h2.checkpointing.distributed import CheckpointIO
    from megatron_h2.models.gpt import GPTModel, init_parameters
    from megatron_h2.optimizer.distributed_optimizer import build_data_parallel_optimizer
    from megatron_h2.training.step import StepRunner
    from megatron_h2.training.timeline import Timeline, format_summary, gather_and_write
    from megatron_h2.training.trainer import Trainer

    start = time.perf_counter()
    say = log if env.rank == 0 else quiet
    demo = apply_demo_defaults(cfg)
    plan, accelerator, tokenizer = validate_launch(cfg, launch, env, say)
    # ---- everything below may start process groups: all user input has been checked ----
    init_process_group(default_backend(plan), env, cfg.parallel.distributed_timeout_minutes)
    topo = build_topology(plan, env.rank, env.world_size)
    tp = topo.tp_context(cfg.parallel.sequence_parallel)
    train_ds, valid_ds, _ = build_datasets(cfg, topo)
    if train_ds is None:
        raise ConfigError(f"--split {cfg.data.split} leaves no training data")
    seed_everything(cfg.training.seed + 100 * topo.stage, accelerator)
    stage_cfg = replace(cfg.model, recompute=topo.stage_spec.recompute)
    model = GPTModel(stage_cfg, accelerator.kernels, pre_process=topo.is_first_stage,
                     post_process=topo.is_last_stage, tp=tp, chunks=topo.chunk_ranges)
    init_parameters(model, cfg.model, cfg.training.seed)
    model.to(accelerator.device)
    optimizer = build_data_parallel_optimizer(
        model, cfg.optimizer, topo.dp_group,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        bucket_size_mb=cfg.parallel.ddp_bucket_size_mb, kernels=accelerator.kernels)
    ckpt = CheckpointIO(cfg, accelerator, topo, tp, model, optimizer)
    progress = restore(cfg, launch, ckpt, say)
    m = cfg.model
    say(f"device: {accelerator.describe()} | bf16: {cfg.training.bf16}")
    say(f"model: {m.num_parameters() / 1e6:.2f}M parameters | layers {m.num_layers} | hidden "
        f"{m.hidden_size} | heads {m.num_attention_heads} (query groups {m.num_query_groups}) | "
        f"ffn {m.ffn_hidden_size} | seq {m.seq_length} | vocab {tokenizer.vocab_size} "
        f"(padded {m.vocab_size}) | recompute {m.recompute}")
    say(f"parallel: world {env.world_size} | DP {plan.data_parallel_size} | distributed "
        f"optimizer {cfg.parallel.use_distributed_optimizer} | sequence parallel "
        f"{cfg.parallel.sequence_parallel}")
    say(pipeline_line(plan))
    for index, (spec, chunks) in enumerate(zip(plan.stages, plan.chunk_layer_ranges())):
        chip = plan.chips[spec.chip]
        slow = (f" | emulating a chip {chip.emulate_slowdown:g}x slower (compute padded with "
                "sleep)" if chip.emulate_slowdown != 1.0 else "")
        layers = ", ".join(f"{r.start}-{r.stop - 1}" if len(r) else "none" for r in chunks)
        say(f"stage {index}: chip {spec.chip} ({chip.device}) | TP {spec.tensor_parallel_size} |"
            f" layers {layers} ({spec.num_layers}) | recompute {spec.recompute}{slow}")
    say(f"data: {' '.join(cfg.data.data_path)} | split {cfg.data.split} | "
        f"{len(train_ds)} training samples | setup took {time.perf_counter() - start:.1f} s")
    if progress.iteration >= cfg.training.train_iters:
        say(f"checkpoint is already at iteration {progress.iteration} >= --train-iters "
            f"{cfg.training.train_iters}: nothing to train")
        return progress
    metrics = MetricsWriter(cfg.training.train_iters, cfg.training.log_jsonl,
                            cfg.training.tensorboard_dir, enabled=env.rank == 0)
    timeline = Timeline.for_plan(plan, env.rank, enabled=bool(cfg.training.timeline_trace))
    runner = StepRunner(cfg, accelerator, topo, tp, model, optimizer, timeline)
    try:
        progress = Trainer(cfg, runner, train_ds, valid_ds, metrics, progress, ckpt, say).run()
    finally:
        metrics.close()
    if cfg.training.timeline_trace:  # collective: every rank sends its events to rank 0
        summary = gather_and_write(timeline, cfg.training.timeline_trace, group=topo.cpu_group)
        if summary is not None:
            say(f"timeline trace: {cfg.training.timeline_trace} (open in ui.perfetto.dev or "
                "chrome://tracing)")
            for line in format_summary(summary).splitlines():
                say(line)
    say(f"training finished at iteration {progress.iteration} in "
        f"{time.perf_counter() - start:.1f} s")
    if cfg.training.save:
        say(f"checkpoint: {cfg.training.save}")
    if cfg.training.tensorboard_dir:
        say(f"TensorBoard logs: {cfg.training.tensorboard_dir} "
            f"(view with: tensorboard --logdir {cfg.training.tensorboard_dir})")
    if demo:
        say("this was the embedded demo; see README.md for training on your own data")
    return progress


def pipeline_line(plan: HeteroPlan) -> str:
    """The start-up line on the pipeline schedule."""
    v, m = plan.virtual_pipeline_size, plan.num_micro_batches
    line = (f"pipeline: {plan.pipeline_parallel_size} stage(s) | schedule {plan.schedule} | "
            f"{m} micro-batches per replica" + (f" | {v} model chunks per stage (layers "
                                               "chunk-major)" if v > 1 else ""))
    full = [str(i) for i, s in enumerate(plan.stages) if s.recompute == "full"]
    if plan.schedule == "zero-bubble" and full:
        line += (f" | stage(s) {', '.join(full)} recompute full layers: their weight gradients "
                 "run with the input gradients, not deferred")
    return line


def _fail(env: LaunchEnv, message: str, code: int) -> int:
    """Report a failure once and leave; in a multi-rank job, leave at once (no hang)."""
    if message:
        print(message, file=sys.stderr, flush=True)
    if env.world_size > 1 and dist.is_initialized():
        sys.stdout.flush()
        os._exit(code)  # peers' collectives fail at once instead of waiting for us
    return code


def main(argv: list[str] | None = None) -> int:
    """Run training; user errors print one line (``error: ...``) and return 2."""
    try:
        env = LaunchEnv.from_environ()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    prefix = f"[rank {env.rank}] " if env.world_size > 1 else ""
    try:
        cfg, launch = config_from_args(argv)
        train(cfg, launch, env)
    except (ConfigError, TrainingError) as exc:
        # Before the process groups start every rank fails alike (rank 0 speaks for all),
        # except on what only this rank can see (its own chip).
        own = isinstance(exc, RankConfigError) or dist.is_initialized()
        if own:
            return _fail(env, f"error: {prefix}{exc}", 2)
        return _fail(env, f"error: {exc}" if env.rank == 0 else "", 2)
    except Exception as exc:  # noqa: BLE001 - a crash on one rank must end the whole job
        if env.world_size > 1 and _is_comm_failure(exc):
            return _fail(env, f"{prefix}stopping: another rank failed or the connection was lost"
                         f" ({type(exc).__name__})", 1)
        return _fail(env, f"error: {prefix}{type(exc).__name__}: {exc}\n"
                     f"{traceback.format_exc()}", 1)
    if env.world_size > 1 and dist.is_initialized():
        dist.barrier()  # nobody tears down while a peer is still talking to it
        dist.destroy_process_group()
        # Leave without interpreter teardown: destroying leftover communication threads there
        # can abort the process (seen with gloo) after a run that succeeded.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _is_comm_failure(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, dist.DistError) or any(
        k in text for k in ("gloo", "nccl", "connection", "timed out", "broken pipe"))
