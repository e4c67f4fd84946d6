"""Everything checked before any process group starts: the implementation flags
(``--transformer-impl``, ``--attention-backend``, ``--fp8-*``), the layout, the batch and
learning-rate schedules, data and tokenizer, the checkpoint to load, this rank's chip, and the
``--save`` directory's owner. Each failure is one line (:class:`~megatron_h2.errors.ConfigError`),
raised by every rank alike, or by the one rank that sees it
(:class:`~megatron_h2.errors.RankConfigError`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_h2.checkpointing import find_latest_iteration, iteration_dir
from megatron_h2.checkpointing.checkpoint_io import check_compatible, check_rng_metadata
from megatron_h2.checkpointing.housekeeping import (
    SaveDirOwner,
    acquire_save_dir,
    check_owner,
    clean_leftovers,
    job_id_from_env,
)
from megatron_h2.checkpointing.megatron_open import read_any_metadata
from megatron_h2.config import ModelConfig, RunConfig
from megatron_h2.devices import Accelerator, detect_device_type, get_accelerator
from megatron_h2.devices.attention import check_attention_backend
from megatron_h2.devices.op_replay import DTYPES
from megatron_h2.distributed.topology import LaunchEnv, accelerator_for_rank
from megatron_h2.errors import ConfigError, RankConfigError
from megatron_h2.monitoring.metrics import check_wandb
from megatron_h2.optimizer.lr_schedule import OptimizerParamScheduler
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.training.arguments import LaunchOptions
from megatron_h2.training.batch_schedule import BatchSchedule, check_run_schedule
from megatron_h2.training.data_setup import prepare_data, unused_data_flags
from megatron_h2.training.layout import (
    batch_unit,
    check_plan_for_model,
    check_routing,
    load_hetero_plan,
    uniform_plan,
)

DEFAULT_RUN_DIR = Path("runs") / "default"


def check_implementation(model: ModelConfig) -> None:
    """What every rank decides alike: FP8 and Transformer Engine."""
    if model.fp8_format is not None:
        raise ConfigError(
            f"--fp8-format {model.fp8_format} needs FP8 matrix multiplies from Transformer "
            "Engine's layers on an NVIDIA Hopper-or-newer GPU; megatron_h2 builds its own "
            "tensor-parallel layers and does not train in FP8: drop the --fp8-* flags (--bf16 "
            "is the closest precision)")
    if model.transformer_impl != "transformer_engine":
        return
    if model.attention_backend == "local":
        raise ConfigError("--attention-backend local is Megatron's own attention, not "
                          "Transformer Engine's; use --transformer-impl local with it")
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means: not usable here
        raise ConfigError(
            "--transformer-impl transformer_engine needs NVIDIA Transformer Engine (pip install "
            "'transformer-engine[pytorch]', NVIDIA GPUs only), which does not import here "
            f"({type(exc).__name__}); use --transformer-impl local") from None


def check_attention_on_chip(model: ModelConfig, acc: Accelerator, params: str = "fp32") -> None:
    """What only this rank's chip can answer: can it run the chosen attention kernel for this
    model (``params``: the weights' and activations' dtype, ``Precision.params``; head size,
    grouped heads, dropout)?"""
    if model.transformer_impl == "transformer_engine":
        if acc.device_type != "cuda":
            raise RankConfigError(f"--transformer-impl transformer_engine runs on NVIDIA GPUs; "
                                  f"this rank's chip is {acc.registry_name()}: use "
                                  "--transformer-impl local")
        return
    dtype = DTYPES[params]
    why = check_attention_backend(model.attention_backend, acc.device, dtype,
                                  model.num_attention_heads, model.num_query_groups,
                                  model.kv_channels, model.attention_dropout)
    if why is not None:
        dtype_name = str(dtype).removeprefix("torch.")
        raise RankConfigError(
            f"--attention-backend {model.attention_backend} cannot run on "
            f"{acc.registry_name()} for this model ({dtype_name}, head size {model.kv_channels}, "
            f"{model.num_attention_heads} heads / {model.num_query_groups} key-value heads, "
            f"attention dropout {model.attention_dropout:g}): torch says \"{why}\"; use "
            "--attention-backend auto, or unfused")


@dataclass
class CheckedLaunch:
    """What the checks established: the plan, this rank's chip, the tokenizer, the batch and
    learning-rate schedules (the latter restored from the checkpoint to load, where it is
    resumed with its optimizer) and the number of iterations."""

    plan: HeteroPlan
    accelerator: Accelerator
    tokenizer: object
    batch: BatchSchedule
    schedule: OptimizerParamScheduler
    iterations: int


def apply_demo_defaults(cfg: RunConfig) -> bool:
    """With no data source, the run is the embedded demo: give it save and log directories."""
    if cfg.data.has_source:
        return False
    if cfg.training.save is None:
        cfg.training.save = str(DEFAULT_RUN_DIR / "checkpoints")
    if cfg.training.tensorboard_dir is None:
        cfg.training.tensorboard_dir = str(DEFAULT_RUN_DIR / "tensorboard")
    return True


def check_load(cfg: RunConfig, launch: LaunchOptions, schedule: OptimizerParamScheduler) -> None:
    """Fail early on a --load target that is missing, incomplete, corrupt or of another model
    (after :func:`prepare_data`, which sets the padded vocabulary size); restores the saved
    learning-rate schedule into ``schedule`` where the optimizer state is loaded."""
    load = cfg.training.load
    if not load:
        return
    if not Path(load).exists():
        if load == cfg.training.save:
            return  # first launch of a self-resuming job: nothing saved yet
        raise ConfigError(f"--load directory {load} does not exist")
    iteration = launch.ckpt_step if launch.ckpt_step is not None else find_latest_iteration(load)
    if iteration is None:
        return
    ckpt_dir = iteration_dir(load, iteration)
    metadata = read_any_metadata(ckpt_dir, cfg.training.verify_checkpoint, launch.ckpt_format,
                                 launch.auto_detect_ckpt_format)
    check_compatible(metadata, cfg, ckpt_dir)
    if not (launch.no_load_rng or launch.finetune):
        check_rng_metadata(metadata, ckpt_dir)
    saved = metadata.get("opt_param_scheduler")
    if saved is not None and not (launch.no_load_optim or launch.finetune):
        schedule.load_state_dict(
            saved, override=cfg.optimizer.override_opt_param_scheduler,
            use_checkpoint=cfg.optimizer.use_checkpoint_opt_param_scheduler)


def check_launch(cfg: RunConfig, launch: LaunchOptions, env: LaunchEnv,
                 say: Callable[[str], None]) -> CheckedLaunch:
    """All checks that need no process group. Checks every rank makes alike come first, this
    rank's own chip last."""
    check_implementation(cfg.model)
    check_wandb(cfg.logging)
    if cfg.parallel.hetero_plan:
        plan = load_hetero_plan(cfg, launch.explicit)
        device = None
    else:
        device = cfg.training.device or detect_device_type()
        plan = uniform_plan(cfg.parallel, cfg.model, cfg.training, env.world_size, device)
    batch, iterations, schedule = check_run_schedule(cfg, plan.micro_batch_size,
                                                     batch_unit(plan))
    tokenizer = prepare_data(cfg, say)
    unused = unused_data_flags(cfg.data, launch.explicit)
    if unused:
        say(unused)
    check_plan_for_model(plan, cfg.model, cfg.parallel, env.world_size)
    check_routing(plan, batch.sizes())
    check_load(cfg, launch, schedule)
    accelerator = (accelerator_for_rank(plan, env.rank, env.local_rank) if device is None
                   else get_accelerator(device, env.local_rank))
    check_attention_on_chip(cfg.model, accelerator, cfg.training.precision.params)
    return CheckedLaunch(plan, accelerator, tokenizer, batch, schedule, iterations)


def claim_save_dir(cfg: RunConfig, env: LaunchEnv,
                   say: Callable[[str], None]) -> SaveDirOwner | None:
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
