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
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from megatron_h2.checkpointing.checkpoint_io import TrainProgress
from megatron_h2.config import RunConfig
from megatron_h2.devices import load_plugins
from megatron_h2.distributed.failures import JobFailures
from megatron_h2.distributed.topology import LaunchEnv
from megatron_h2.errors import ConfigError, JobConfigError, RankConfigError, TrainingError
from megatron_h2.monitoring.health import JobTrainingError
from megatron_h2.monitoring.metrics import configure_logging, log
from megatron_h2.monitoring.timeline import format_summary, gather_and_write
from megatron_h2.monitoring.watchdog import mark_stopped, start_orphan_watchdog
from megatron_h2.training.arguments import LaunchOptions, config_from_args
from megatron_h2.training.build import Run, build_run, quiet  # noqa: F401 - quiet: old path
from megatron_h2.training.data_setup import (  # noqa: F401 - importable from here as before
    build_datasets,
    default_cache_dir,
    prepare_data,
)
from megatron_h2.training.launch_checks import (  # noqa: F401 - importable from here as before
    DEFAULT_RUN_DIR,
    apply_demo_defaults,
    check_load,
    claim_save_dir,
)
from megatron_h2.training.loop import Trainer
from megatron_h2.training.startup_report import (  # noqa: F401 - importable from here as before
    pipeline_line,
    say_bridges,
    say_finished,
    say_loss_scaling,
    say_run,
)


def train(cfg: RunConfig, launch: LaunchOptions, env: LaunchEnv,
          failures: JobFailures) -> TrainProgress:
    """Build this rank's run for ``cfg`` and train it; returns the final progress.

    ``failures`` is given the job's store once the process group starts.
    """
    run = build_run(cfg, launch, env, failures)
    try:
        start_heartbeat(run, env, failures)
        say_run(run)
        if run.progress.iteration >= run.iterations:
            run.say(f"checkpoint is already at iteration {run.progress.iteration} >= the run's "
                    f"{run.iterations} iterations: nothing to train")
            return run.progress
        progress = Trainer(run).train()
        finish_timeline(run)
        say_finished(run, progress)
        return progress
    finally:
        run.close()


def start_heartbeat(run: Run, env: LaunchEnv, failures: JobFailures) -> None:
    """Register this rank (host, stage) and start beating; a watched rank that falls silent
    for --heartbeat-timeout seconds ends the job with one line naming it."""
    topo = run.topo
    pipeline = f"pipeline {topo.pipeline} " if topo.num_pipelines > 1 else ""
    who = (f"rank {env.rank} (host {socket.gethostname()}, pid {os.getpid()}, {pipeline}stage "
           f"{topo.stage}, chip {topo.stage_spec.chip})")

    def silent(line: str) -> None:
        print(f"error: [rank {env.rank}] {line}", file=sys.stderr, flush=True)
        failures.record_own_failure()
        os._exit(1)

    failures.start_heartbeat(env.rank, env.world_size, who, run.cfg.parallel.heartbeat_timeout,
                             silent)


def finish_timeline(run: Run) -> None:
    """With ``--timeline-trace``: every rank sends its events to rank 0, which writes the trace
    and logs its summary (collective)."""
    path = run.cfg.training.timeline_trace
    if not path:
        return
    summary = gather_and_write(run.timeline, path, group=run.topo.cpu_group)
    if summary is not None:
        run.say(f"timeline trace: {path} (open in ui.perfetto.dev or chrome://tracing)")
        for line in format_summary(summary).splitlines():
            run.say(line)


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
            lost = ", ".join(failures.describe(r) for r in failures.silent_peers(
                env.rank, env.world_size))
            what = (f"{lost} failed or stopped responding" if lost
                    else "another rank failed or the connection was lost")
            restart = "; restart from the last checkpoint" if lost else ""
            return _fail(env, f"{prefix}stopping: {what} ({type(exc).__name__}){restart}", 1)
        failures.record_own_failure()
        return _fail(env, f"error: {prefix}{type(exc).__name__}: {exc}\n"
                     f"{traceback.format_exc()}", 1)
    mark_stopped(env.local_rank)  # for our launchers: this worker saved and ended normally
    if env.world_size > 1 and dist.is_initialized():
        failures.stop_heartbeat(env.rank)
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
