"""Entry point behind ``pretrain_gpt.py``: validate, build, train.

Everything the user can get wrong is checked before any process group starts and before the
model is built: flags (in the config dataclasses), the parallel layout, data files, the
tokenizer, the checkpoint to load. A rank that fails later takes the job down at once: it
records its failure in the job's store, prints its error and exits; the other ranks'
collectives fail instead of waiting, and they say only that they stop
(:class:`~megatron_h2.distributed.failures.JobFailures`).
"""

from __future__ import annotations

import json
import math
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
from megatron_h2.checkpointing.checkpoint_io import (
    TrainProgress,
    check_compatible,
    check_rng_metadata,
)
from megatron_h2.checkpointing.housekeeping import (
    SaveDirOwner,
    acquire_save_dir,
    check_owner,
    clean_leftovers,
    job_id_from_env,
)
from megatron_h2.config import ParallelConfig, RunConfig
from megatron_h2.devices import (
    Accelerator,
    detect_device_type,
    get_accelerator,
    load_plugins,
)
from megatron_h2.distributed.failures import JobFailures
from megatron_h2.distributed.topology import (
    LaunchEnv,
    Topology,
    accelerator_for_rank,
    build_topology,
    default_backend,
    init_process_group,
)
from megatron_h2.errors import ConfigError, JobConfigError, RankConfigError, TrainingError
from megatron_h2.monitoring.health import JobTrainingError
from megatron_h2.monitoring.metrics import MetricsWriter, check_wandb, configure_logging, log
from megatron_h2.monitoring.watchdog import start_orphan_watchdog
from megatron_h2.optimizer.lr_schedule import OptimizerParamScheduler
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.training.arguments import (
    LaunchOptions,
    config_from_args,
    describe_demo,
    describe_no_effect,
)
from megatron_h2.training.batch_schedule import check_run_schedule
from megatron_h2.training.data_setup import (
    build_split_datasets,
    check_data_files,
    data_prefixes,
    describe_source,
    unused_data_flags,
)
from megatron_h2.training.launch_checks import check_attention_on_chip, check_implementation
from megatron_h2.training.layout import (
    check_plan_for_model,
    check_routing,
    describe_dp,
    load_hetero_plan,
    stage_dps,
    uniform_plan,
)

DEFAULT_RUN_DIR = Path("runs") / "default"


def quiet(message: str) -> None:
    """The logger of ranks other than 0."""


def default_cache_dir() -> Path:
    """Where the embedded corpus is cached (``$MEGATRON_H2_CACHE`` or ~/.cache/megatron_h2)."""
    return Path(os.environ.get("MEGATRON_H2_CACHE", Path.home() / ".cache" / "megatron_h2"))


def prepare_data(cfg: RunConfig, say) -> object:
    """Resolve data and tokenizer; fills ``cfg.model.vocab_size``. Returns the tokenizer."""
    from megatron_h2.data import build_tokenizer, check_token_ids, ensure_default_corpus

    if not cfg.data.has_source:
        say("no --data-path given: using the embedded corpus (Python standard library sources)")
        prefix, spm_model = ensure_default_corpus(str(default_cache_dir() / "default_corpus"))
        cfg.data.data_path = [prefix]
        cfg.data.tokenizer_type = "SentencePieceTokenizer"
        cfg.data.tokenizer_model = spm_model
    else:
        check_data_files(cfg.data)
    tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model,
                                cfg.data.vocab_size, **cfg.data.tokenizer_options())
    for prefix in data_prefixes(cfg.data):  # cached per corpus: a scan, once
        check_token_ids(prefix, tokenizer.vocab_size, cfg.data.data_cache_path,
                        f"the tokenizer ({cfg.data.tokenizer_type})")
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
        metadata = read_metadata(ckpt_dir, cfg.training.verify_checkpoint)
        check_compatible(metadata, cfg, ckpt_dir)
        if not (launch.no_load_rng or launch.finetune):
            check_rng_metadata(metadata, ckpt_dir)
        saved = metadata.get("opt_param_scheduler")
        if saved is not None and not (launch.no_load_optim or launch.finetune):
            OptimizerParamScheduler.from_config(cfg.optimizer, cfg.training).load_state_dict(
                saved, override=cfg.optimizer.override_opt_param_scheduler,
                use_checkpoint=cfg.optimizer.use_checkpoint_opt_param_scheduler)


def claim_save_dir(cfg: RunConfig, env: LaunchEnv, say) -> SaveDirOwner | None:
    """One writing job per --save directory: rank 0 claims it (taking over from a dead owner)
    and removes leftovers of interrupted saves; every rank fails alike if a live job owns it."""
    save = cfg.training.save
    if not save:
        return None
    job = job_id_from_env()
    check_owner(save, job)
    if env.rank != 0:
        return None
    owner = acquire_save_dir(save, job, say)
    removed = clean_leftovers(save)
    if removed:
        say(f"removed leftovers of interrupted saves in {save}: {', '.join(removed)}")
    return owner


def build_datasets(cfg: RunConfig, topo: Topology, train_samples: int, tokenizer):
    """Train / validation datasets; rank 0 builds the index caches before the others read them."""
    t = cfg.training
    # The test split is not used during training: ask for none so small corpora still work.
    num_samples = (train_samples, t.eval_iters * t.global_batch_size, 0)
    result = build_split_datasets(cfg, tokenizer, num_samples) if topo.rank == 0 else None
    if topo.distributed:
        dist.barrier(group=topo.cpu_group)
    return result if result is not None else build_split_datasets(cfg, tokenizer, num_samples)


def seed_everything(seed: int, accelerator: Accelerator) -> None:
    random.seed(seed)
    np.random.seed(seed)
    accelerator.manual_seed(seed)


def apply_demo_defaults(cfg: RunConfig) -> bool:
    """With no data source, the run is the embedded demo: give it save and log directories."""
    if cfg.data.has_source:
        return False
    if cfg.training.save is None:
        cfg.training.save = str(DEFAULT_RUN_DIR / "checkpoints")
    if cfg.training.tensorboard_dir is None:
        cfg.training.tensorboard_dir = str(DEFAULT_RUN_DIR / "tensorboard")
    return True


def validate_launch(cfg: RunConfig, launch: LaunchOptions, env: LaunchEnv, say):
    """All checks that need no process group; returns the plan, this rank's accelerator, the
    tokenizer, the batch schedule and the number of iterations. Checks every rank makes alike
    come first, this rank's own chip last."""
    check_implementation(cfg.model)
    check_wandb(cfg.logging)
    if cfg.parallel.hetero_plan:
        plan = load_hetero_plan(cfg, launch.explicit)
        device = None
    else:
        device = cfg.training.device or detect_device_type()
        plan = uniform_plan(cfg.parallel, cfg.model, cfg.training, env.world_size, device)
    batch, iterations = check_run_schedule(cfg, plan.micro_batch_size,
                                           math.lcm(*stage_dps(plan)))
    tokenizer = prepare_data(cfg, say)
    unused = unused_data_flags(cfg.data, launch.explicit)
    if unused:
        say(unused)
    check_plan_for_model(plan, cfg.model, cfg.parallel, env.world_size)
    check_routing(plan, batch.sizes())
    check_load(cfg, launch)
    accelerator = (accelerator_for_rank(plan, env.rank, env.local_rank) if device is None
                   else get_accelerator(device, env.local_rank))
    check_attention_on_chip(cfg.model, accelerator, cfg.training.precision.params)
    return plan, accelerator, tokenizer, batch, iterations


def restore(cfg: RunConfig, launch: LaunchOptions, ckpt, say) -> TrainProgress:
    load = cfg.training.load
    if not load or not Path(load).exists():
        if load:
            say(f"no checkpoint found in {load}: starting from scratch")
        return TrainProgress()
    progress = ckpt.load(load, launch.ckpt_step,
                         load_optim=not (launch.no_load_optim or launch.finetune),
                         load_rng=not (launch.no_load_rng or launch.finetune), log=say,
                         verify=cfg.training.verify_checkpoint)
    if progress is None:
        say(f"no checkpoint found in {load}: starting from scratch")
        return TrainProgress()
    if launch.finetune:
        say(f"loaded weights from {load} (iteration {progress.iteration}); finetuning from 0")
        return TrainProgress()
    say(f"resumed from {load} at iteration {progress.iteration} "
        f"({progress.consumed_samples} samples consumed)")
    return progress


def say_loss_scaling(cfg: RunConfig, say) -> None:
    """The start-up line on loss scaling (Megatron's choice of scaler for these flags)."""
    t = cfg.training
    if t.loss_scale is not None:
        if t.fp16 or t.bf16 or cfg.parallel.use_distributed_optimizer:
            say(f"loss scaling: constant {t.loss_scale:g} (--loss-scale); steps whose gradients "
                "overflow are skipped")
        else:
            say("accepted, no effect: --loss-scale (fp32 training without the distributed "
                "optimizer does not scale the loss, as in Megatron)")
    elif t.fp16:
        say(f"loss scaling: dynamic from {t.initial_loss_scale:g} (x2 after "
            f"{t.loss_scale_window:g} clean iterations, x0.5 after {t.hysteresis} overflow(s), "
            f"at least {t.min_loss_scale:g}); overflowing steps are skipped and the NaN check "
            "is off, as in Megatron")


def say_bridges(plan: HeteroPlan, parallel: ParallelConfig, say) -> None:
    """Log the transport of every boundary that crosses the bridge, and any plan
    ``transports`` entry that no such boundary uses (it has no effect)."""
    bridged = set()
    for index in range(len(plan.stages) - 1):
        a, b = plan.stages[index].chip, plan.stages[index + 1].chip
        if parallel.force_bridge or plan.chips[a].device != plan.chips[b].device:
            bridged.add(frozenset((a, b)))
            say(f"boundary {index}-{index + 1}: bridge over {plan.transport_between(a, b)} "
                f"(chunks of {parallel.bridge_chunk_mb:g} MiB, {parallel.bridge_dtype} "
                "on the wire)")
    for link in plan.transports:
        if frozenset(link.chips) not in bridged:
            say(f"note: transports entry {'/'.join(link.chips)} ({link.transport}) has no "
                "effect: no boundary between these chip types crosses the bridge (it is used "
                "between different device types, or everywhere with --force-bridge)")


def train(cfg: RunConfig, launch: LaunchOptions, env: LaunchEnv,
          failures: JobFailures) -> TrainProgress:
    """Build everything for ``cfg`` on this rank and train; returns the final progress.

    ``failures`` is given the job's store once the process group starts.
    """
    start = time.perf_counter()
    say = log if env.rank == 0 else quiet
    demo = apply_demo_defaults(cfg)
    demo_line = describe_demo(launch, cfg.model)
    if demo_line:
        say(demo_line)
    no_effect = describe_no_effect(launch)
    if no_effect:
        say(no_effect)
    plan, accelerator, tokenizer, batch, iterations = validate_launch(cfg, launch, env, say)
    owner = claim_save_dir(cfg, env, say)
    try:
        return _train(cfg, launch, env, failures, plan, accelerator, tokenizer, batch,
                      iterations, owner, say, start, demo)
    finally:
        if owner is not None:
            owner.release()


def _train(cfg: RunConfig, launch: LaunchOptions, env: LaunchEnv, failures: JobFailures, plan,
           accelerator, tokenizer, batch, iterations: int, owner: SaveDirOwner | None, say,
           start: float, demo: bool) -> TrainProgress:
    """The part of :func:`train` that starts process groups (all user input is checked)."""
    from megatron_h2.checkpointing.checkpoint_io import CheckpointIO
    from megatron_h2.devices.op_replay import DTYPES, KernelProbe
    from megatron_h2.models.gpt import GPTModel, cast_parameters, init_parameters
    from megatron_h2.monitoring.precision_monitor import PrecisionMonitor
    from megatron_h2.monitoring.timeline import Timeline, format_summary, gather_and_write
    from megatron_h2.optimizer.distributed_optimizer import build_data_parallel_optimizer
    from megatron_h2.training.loop import Trainer
    from megatron_h2.training.step import StepRunner

    # ---- everything below may start process groups: all user input has been checked ----
    failures.attach(init_process_group(default_backend(plan), env,
                                       cfg.parallel.distributed_timeout_minutes))
    topo = build_topology(plan, env.rank, env.world_size)
    tp = topo.tp_context(cfg.parallel.sequence_parallel)
    train_samples = max(cfg.training.train_samples or 0, batch.samples_for(iterations))
    train_ds, valid_ds, _ = build_datasets(cfg, topo, train_samples, tokenizer)
    if train_ds is None:
        raise ConfigError(f"--split {cfg.data.effective_split()} leaves no training data")
    seed_everything(cfg.training.seed + 100 * topo.stage, accelerator)
    stage_cfg = replace(cfg.model, recompute=topo.stage_spec.recompute)
    probe = KernelProbe(accelerator.kernels) if cfg.training.precision_check_interval else None
    model = GPTModel(stage_cfg, probe.kernels if probe else accelerator.kernels,
                     pre_process=topo.is_first_stage, post_process=topo.is_last_stage, tp=tp,
                     chunks=topo.chunk_ranges)
    init_parameters(model, cfg.model, cfg.training.seed)
    model.to(accelerator.device)
    dtypes = cfg.training.precision
    cast_parameters(model, DTYPES[dtypes.params])  # the optimizer keeps fp32 main weights
    tied = model.tied_embedding_weight()  # its gradient is summed across stages before DP sync
    optimizer = build_data_parallel_optimizer(
        model, cfg.optimizer, topo.dp_group,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        bucket_size_mb=cfg.parallel.bucket_size_mb(topo.dp_size),
        overlap=cfg.parallel.overlap_grad_reduce, kernels=accelerator.kernels,
        deferred=[tied] if tied is not None else [], grad_dtype=DTYPES[dtypes.grads],
        overlap_param_gather=cfg.parallel.overlap_param_gather)
    ckpt = CheckpointIO(cfg, accelerator, topo, tp, model, optimizer)
    ckpt.owner = owner
    progress = restore(cfg, launch, ckpt, say)
    m = cfg.model
    say(f"device: {accelerator.describe()} | precision: {dtypes.describe()}")
    say_loss_scaling(cfg, say)
    say(f"model: {m.num_parameters() / 1e6:.2f}M parameters | layers {m.num_layers} | hidden "
        f"{m.hidden_size} | heads {m.num_attention_heads} (query groups {m.num_query_groups}) | "
        f"ffn {m.ffn_hidden_size} | seq {m.seq_length} | vocab {tokenizer.vocab_size} "
        f"(padded {m.vocab_size}) | recompute {m.recompute}")
    say(f"architecture: {m.describe_architecture()}")
    say(f"parallel: world {env.world_size} | DP {describe_dp(plan)} | distributed "
        f"optimizer {cfg.parallel.use_distributed_optimizer} | sequence parallel "
        f"{cfg.parallel.sequence_parallel}")
    say(pipeline_line(plan))
    for index, (spec, chunks) in enumerate(zip(plan.stages, plan.chunk_layer_ranges())):
        chip = plan.chips[spec.chip]
        slow = (f" | emulating a chip {chip.emulate_slowdown:g}x slower (compute padded with "
                "sleep)" if chip.emulate_slowdown != 1.0 else "")
        layers = ", ".join(f"{r.start}-{r.stop - 1}" if len(r) else "none" for r in chunks)
        dp = "" if plan.uniform_dp else f" | DP {plan.stage_dp(index)}"
        say(f"stage {index}: chip {spec.chip} ({chip.device}) | TP {spec.tensor_parallel_size}"
            f"{dp} | layers {layers} ({spec.num_layers}) | recompute {spec.recompute}{slow}")
    say_bridges(plan, cfg.parallel, say)
    say(f"data: {describe_source(cfg.data)} | {len(train_ds)} training samples | setup took "
        f"{time.perf_counter() - start:.1f} s")
    say(f"training: {iterations} iterations | global batch size {batch.describe()}")
    if progress.iteration >= iterations:
        say(f"checkpoint is already at iteration {progress.iteration} >= the run's "
            f"{iterations} iterations: nothing to train")
        return progress
    metrics = MetricsWriter(iterations, cfg.training.log_jsonl,
                            cfg.training.tensorboard_dir, enabled=env.rank == 0,
                            logging_cfg=cfg.logging, save_dir=cfg.training.save,
                            run_config=cfg.to_dict())
    timeline = Timeline.for_plan(plan, env.rank, enabled=bool(cfg.training.timeline_trace))
    runner = StepRunner(cfg, accelerator, topo, tp, model, optimizer, timeline,
                        eod_mask=tokenizer.eod if cfg.data.eod_mask_loss else None)
    precision = None if probe is None else PrecisionMonitor(  # no autocast: weights carry dtype
        model, probe, accelerator, topo, False, cfg.training.seed)
    if precision is not None:
        say(f"precision check every {cfg.training.precision_check_interval} iterations: one "
            "micro-batch per stage replayed on cpu fp64")
    try:
        progress = Trainer(cfg, runner, train_ds, valid_ds, metrics, progress, ckpt, say,
                           started=start, precision=precision,
                           tokenizer_vocab=tokenizer.vocab_size).run()
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
    v = plan.virtual_pipeline_size
    m = (str(plan.num_micro_batches) if plan.uniform_dp else
         "/".join(str(plan.stage_micro_batches(s)) for s in range(plan.pipeline_parallel_size)))
    line = (f"pipeline: {plan.pipeline_parallel_size} stage(s) | schedule {plan.schedule} | "
            f"{m} micro-batches per replica" + (f" | {v} model chunks per stage (layers "
                                               "chunk-major)" if v > 1 else ""))
    full = [str(i) for i, s in enumerate(plan.stages) if s.recompute == "full"]
    if plan.schedule == "zero-bubble" and full:
        line += (f" | stage(s) {', '.join(full)} recompute full layers: their weight gradients "
                 "run with the input gradients, not deferred")
    return line


def _fail(env: LaunchEnv, message: str, code: int, agreed: bool = False) -> int:
    """Report a failure once and leave; in a multi-rank job, leave at once (no hang). An
    ``agreed`` failure happened on every rank alike: they wait for rank 0's report first."""
    if message:
        print(message, file=sys.stderr, flush=True)
    if env.world_size > 1 and dist.is_initialized():
        sys.stdout.flush()
        if agreed:
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - leaving anyway
                pass
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
    failures = JobFailures()
    try:
        load_plugins()  # vendor accelerators named by entry points / $MEGATRON_H2_PLUGINS
        load_plugins()  # vendor accelerators named by entry points / $MEGATRON_H2_PLUGINS
        cfg, launch = config_from_args(argv)
        configure_logging(cfg.logging.logging_level)
        start_orphan_watchdog(log, grace_s=60.0 * cfg.parallel.distributed_timeout_minutes + 60)
        train(cfg, launch, env, failures)
    except (ConfigError, TrainingError) as exc:
        # Before the process groups start every rank fails alike (rank 0 speaks for all),
        # except on what only this rank can see (its own chip); after, only on what the
        # ranks established together.
        agreed = isinstance(exc, (JobConfigError, JobTrainingError))
        own = isinstance(exc, RankConfigError) or (dist.is_initialized() and not agreed)
        if own:
            failures.record_own_failure()
            return _fail(env, f"error: {prefix}{exc}", 2)
        return _fail(env, f"error: {exc}" if env.rank == 0 else "", 2, agreed)
    except Exception as exc:  # noqa: BLE001 - a crash on one rank must end the whole job
        peer = env.world_size > 1 and failures.is_fallout(exc)
        _note_failure(env, "peer" if peer else "crash", exc)
        if peer:
            return _fail(env, f"{prefix}stopping: another rank failed or the connection was lost"
                         f" ({type(exc).__name__})", 1)
        failures.record_own_failure()
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


def _note_failure(env: LaunchEnv, kind: str, exc: BaseException) -> None:
    """For the elastic launcher: whether this rank crashed on its own or lost a peer."""
    folder = os.environ.get("MEGATRON_H2_ELASTIC_DIR")
    if not folder:
        return
    attempt = os.environ.get("MEGATRON_H2_ATTEMPT", "0")
    note = {"rank": env.rank, "kind": kind, "time": time.time(),
            "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    try:
        Path(folder, f"attempt{attempt}-failure-rank{env.rank}.json").write_text(json.dumps(note))
    except OSError:
        pass
