"""Build a run once: :func:`build_run` turns the typed config into a :class:`Run` (topology,
model, optimizer, checkpoint IO, step runner, datasets, batch and learning-rate schedules,
metrics), which the loop (:func:`megatron_h2.training.loop.train`) trains.

Every user input is checked first (:func:`~megatron_h2.training.launch_checks.check_launch`,
one-line errors before any process group starts); then the process group starts and each part
is built exactly once.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from megatron_h2.checkpointing.checkpoint_io import CheckpointIO, TrainProgress
from megatron_h2.checkpointing.housekeeping import SaveDirOwner
from megatron_h2.config import RunConfig
from megatron_h2.devices import Accelerator
from megatron_h2.devices.op_replay import DTYPES, KernelProbe
from megatron_h2.distributed.failures import JobFailures
from megatron_h2.distributed.topology import (
    LaunchEnv,
    Topology,
    build_topology,
    default_backend,
    init_process_group,
)
from megatron_h2.errors import ConfigError
from megatron_h2.models.gpt import GPTModel, cast_parameters, init_parameters
from megatron_h2.monitoring.metrics import MetricsWriter, log
from megatron_h2.monitoring.precision_monitor import PrecisionMonitor
from megatron_h2.monitoring.timeline import Timeline
from megatron_h2.optimizer.distributed_optimizer import DataParallelOptimizer
from megatron_h2.optimizer.expert_optimizer import build_stage_optimizer
from megatron_h2.optimizer.lr_schedule import OptimizerParamScheduler
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.training.arguments import LaunchOptions
from megatron_h2.training.batch_schedule import BatchSchedule
from megatron_h2.training.data_setup import build_datasets
from megatron_h2.training.launch_checks import apply_demo_defaults, check_launch, claim_save_dir
from megatron_h2.training.startup_report import say_launch_flags
from megatron_h2.training.step import StepRunner

Say = Callable[[str], None]


def quiet(message: str) -> None:
    """The logger of ranks other than 0."""


@dataclass
class Run:
    """Everything this rank trains with, built once by :func:`build_run`."""

    cfg: RunConfig
    plan: HeteroPlan
    topo: Topology
    accelerator: Accelerator
    tokenizer: object
    model: GPTModel
    optimizer: DataParallelOptimizer
    ckpt: CheckpointIO
    runner: StepRunner
    train_ds: object
    valid_ds: object | None
    batch: BatchSchedule
    schedule: OptimizerParamScheduler  # restored with the optimizer state where resumed
    iterations: int
    progress: TrainProgress  # where training starts: iteration and consumed samples
    metrics: MetricsWriter
    timeline: Timeline
    precision: PrecisionMonitor | None  # --precision-check-interval
    say: Say  # rank 0's logger; quiet elsewhere
    started: float  # time.perf_counter() when the program started (--exit-duration-in-mins)
    demo: bool  # the embedded demo (no data source given)
    owner: SaveDirOwner | None  # this job's claim on --save (rank 0)

    def close(self) -> None:
        """Flush the metrics and give up the claim on the save directory."""
        self.metrics.close()
        if self.owner is not None:
            self.owner.release()


def seed_everything(seed: int, accelerator: Accelerator) -> None:
    random.seed(seed)
    np.random.seed(seed)
    accelerator.manual_seed(seed)


def build_model(cfg: RunConfig, topo: Topology, accelerator: Accelerator
                ) -> tuple[GPTModel, KernelProbe | None]:
    """This rank's stage of the model, initialised as one process would (layers keyed by
    global index), in the weights' dtype; with the operator probe of the precision check."""
    seed_everything(cfg.training.seed + 100 * topo.stage, accelerator)
    stage_cfg = replace(cfg.model, recompute=topo.stage_spec.recompute)
    probe = KernelProbe(accelerator.kernels) if cfg.training.precision_check_interval else None
    model = GPTModel(stage_cfg, probe.kernels if probe else accelerator.kernels,
                     pre_process=topo.is_first_stage, post_process=topo.is_last_stage,
                     tp=topo.tp_context(cfg.parallel.sequence_parallel), chunks=topo.chunk_ranges,
                     ep=topo.ep_context(), etp=topo.etp_context())
    init_parameters(model, cfg.model, cfg.training.seed)
    model.to(accelerator.device)
    cast_parameters(model, DTYPES[cfg.training.precision.params])  # fp32 main weights: optimizer
    return model, probe


def build_optimizer(cfg: RunConfig, topo: Topology, model: GPTModel,
                    accelerator: Accelerator) -> DataParallelOptimizer:
    """The data-parallel (or ZeRO-1) optimizer over the stage's own DP group (the routed
    experts' parameters over the expert-DP group under expert parallelism)."""
    tied = model.tied_embedding_weight()  # its gradient is summed across stages before DP sync
    par = cfg.parallel
    return build_stage_optimizer(
        model, cfg.optimizer, topo.dp_group, topo.dp_ranks, topo.edp_group, topo.edp_ranks,
        use_distributed_optimizer=par.use_distributed_optimizer,
        bucket_size_mb=par.bucket_size_mb(topo.dp_size), overlap=par.overlap_grad_reduce,
        kernels=accelerator.kernels, deferred=[tied] if tied is not None else [],
        grad_dtype=DTYPES[cfg.training.precision.grads],
        overlap_param_gather=par.overlap_param_gather)


def restore(cfg: RunConfig, launch: LaunchOptions, ckpt: CheckpointIO, say: Say) -> TrainProgress:
    """Load ``--load``'s checkpoint into model and optimizer; where training starts."""
    load = cfg.training.load
    if not load or not Path(load).exists():
        if load:
            say(f"no checkpoint found in {load}: starting from scratch")
        return TrainProgress()
    progress = ckpt.load(load, launch.ckpt_step,
                         load_optim=not (launch.no_load_optim or launch.finetune),
                         load_rng=not (launch.no_load_rng or launch.finetune), log=say,
                         verify=cfg.training.verify_checkpoint, ckpt_format=launch.ckpt_format,
                         auto_detect=launch.auto_detect_ckpt_format)
    if progress is None:
        say(f"no checkpoint found in {load}: starting from scratch")
        return TrainProgress()
    if launch.finetune:
        say(f"loaded weights from {load} (iteration {progress.iteration}); finetuning from 0")
        return TrainProgress()
    say(f"resumed from {load} at iteration {progress.iteration} "
        f"({progress.consumed_samples} samples consumed)")
    return progress


def build_run(cfg: RunConfig, launch: LaunchOptions, env: LaunchEnv | None = None,
              failures: JobFailures | None = None, say: Say | None = None) -> Run:
    """Check everything, start the process group and build this rank's :class:`Run`.

    ``env`` (default: one process) is what the launcher says of this process; ``failures`` is
    given the job's store once the process group starts; ``say`` defaults to the log on rank 0.
    """
    started = time.perf_counter()
    env = env or LaunchEnv()
    say = say or (log if env.rank == 0 else quiet)
    demo = apply_demo_defaults(cfg)
    say_launch_flags(launch, cfg, say)
    checked = check_launch(cfg, launch, env, say)
    owner = claim_save_dir(cfg, env, say)
    try:
        # ---- from here on process groups start: all user input has been checked ----
        store = init_process_group(default_backend(checked.plan), env,
                                   cfg.parallel.distributed_timeout_minutes)
        if failures is not None:
            failures.attach(store)
        topo = build_topology(checked.plan, env.rank, env.world_size)
        acc = checked.accelerator
        train_samples = max(cfg.training.train_samples or 0,
                            checked.batch.samples_for(checked.iterations))
        train_ds, valid_ds, _ = build_datasets(cfg, topo, train_samples, checked.tokenizer)
        if train_ds is None:
            raise ConfigError(f"--split {cfg.data.effective_split()} leaves no training data")
        model, probe = build_model(cfg, topo, acc)
        optimizer = build_optimizer(cfg, topo, model, acc)
        ckpt = CheckpointIO(cfg, acc, topo, topo.tp_context(cfg.parallel.sequence_parallel),
                            model, optimizer)
        ckpt.owner = owner
        ckpt.save_format = launch.ckpt_format if launch.ckpt_format == "torch_dist" else None
        progress = restore(cfg, launch, ckpt, say)
        timeline = Timeline.for_plan(checked.plan, env.rank,
                                     enabled=bool(cfg.training.timeline_trace))
        eod = checked.tokenizer.eod if cfg.data.eod_mask_loss else None
        runner = StepRunner(cfg, acc, topo, ckpt.tp, model, optimizer, timeline, eod_mask=eod)
        runner.load_grad_scaler_state(progress.grad_scaler)
        precision = None if probe is None else PrecisionMonitor(  # no autocast: weights' dtype
            model, probe, acc, topo, False, cfg.training.seed)
        to_train = progress.iteration < checked.iterations  # else: no logs to open
        metrics = MetricsWriter(checked.iterations, cfg.training.log_jsonl,
                                cfg.training.tensorboard_dir, enabled=env.rank == 0 and to_train,
                                logging_cfg=cfg.logging, save_dir=cfg.training.save,
                                run_config=cfg.to_dict())
    except BaseException:
        if owner is not None:
            owner.release()
        raise
    return Run(cfg, checked.plan, topo, acc, checked.tokenizer, model, optimizer, ckpt, runner,
               train_ds, valid_ds, checked.batch, checked.schedule, checked.iterations, progress,
               metrics, timeline, precision, say, started, demo, owner)
