"""Elastic launcher: train a plan, and when a chip is lost, re-plan for the chips that are left
and resume from the last good checkpoint.

    python -m megatron_h2.elastic.launcher --cluster cluster.yaml --max-restarts 3 \\
        [--plan plan.yaml] -- <pretrain_gpt.py flags, with --save DIR>

(``scripts/run_elastic.sh`` wraps it, also under SLURM.) Each attempt runs the current plan on
this host with torch's elastic agent (what torchrun runs), the workers being children of this
process. When the attempt fails:

1. the failure says which ranks died: ranks killed by a signal (a lost chip, an OOM kill,
   ``kill -9``), else the rank that crashed on its own (not a peer that merely lost its
   connection). Their chips are taken out; a health probe of every chip type (a fresh process
   that touches each device, or ``--health-probe CMD``) may take out more. An error in the
   input or a numerical stop (exit status 2) is not a hardware fault: the launcher stops there;
2. the planner is run for the surviving chips with the same model and global batch, and the
   best plan the runtime accepts is written next to the others (``--run-dir``);
3. the next attempt resumes from the newest complete checkpoint under the new plan (the
   checkpoints do not depend on the layout; the data position, i.e. consumed samples, carries
   over), and the log says what changed: chips, stages, expected tokens/s, and the recovery
   time from detecting the failure to the first iteration under the new plan.

Exit status: 0 trained, or stopped by a signal (SIGTERM, as SLURM sends before a time limit)
after every worker saved and stopped (``--exit-signal-handler``); 2 bad input (as pretrain_gpt);
75 (EX_TEMPFAIL) when a fresh allocation could help: restarts used up, no plan fits the chips
left, or stopped by a signal before every worker saved (the ranks that did not are named).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from megatron_h2.checkpointing import find_latest_iteration, read_checkpoint_files
from megatron_h2.checkpointing.format import iteration_dir, saved_iterations
from megatron_h2.elastic.replan import (
    Planned,
    best_plan,
    change_summary,
    evaluate,
    probe_chips,
    with_counts,
)
from megatron_h2.errors import ConfigError
from megatron_h2.monitoring.metrics import log
from megatron_h2.monitoring.watchdog import STOPPED_ENV, stopped_local_ranks
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner import Cluster
from megatron_h2.training.arguments import config_from_args
from megatron_h2.training.layout import load_hetero_plan
from megatron_h2.training.loop import FAULT_ENV

EXIT_TEMPFAIL = 75
ELASTIC_DIR_ENV = "MEGATRON_H2_ELASTIC_DIR"
FIRST_ITERATION_FILE = "first_iteration.json"
ROOT = Path(__file__).resolve().parents[2]


def say(message: str) -> None:
    log(f"elastic: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_h2.elastic.launcher",
                                description="Train a heterogeneous plan; on a lost chip, re-plan "
                                "for the chips left and resume. Training flags follow '--'.")
    p.add_argument("--cluster", required=True, help="cluster YAML (the chips this host has)")
    p.add_argument("--plan", help="plan to start with (default: plan the cluster)")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--run-dir", help="where plans and notes go (default: SAVE/elastic)")
    p.add_argument("--planner-time-limit", type=float, default=20.0)
    p.add_argument("--health-probe", help="shell command printing {\"type\": healthy count}")
    p.add_argument("--monitor-interval", type=float, default=0.1)
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    return p


@dataclass
class Job:
    """Everything fixed over the attempts of one elastic job."""

    train_args: list[str]
    cluster: Cluster
    run_dir: Path
    save: str
    max_restarts: int
    options: argparse.Namespace
    micro_batch: int  # --micro-batch-size: every plan keeps it, as it keeps the global batch
    global_batch: int
    job_id: str = field(default_factory=lambda: f"elastic-{uuid.uuid4().hex[:12]}")


def _prepare(ns: argparse.Namespace):
    """Check everything once, before any process starts; returns (job, cfg, launch)."""
    from megatron_h2.training.data_setup import prepare_data

    train_args = ns.train_args[1:] if ns.train_args[:1] == ["--"] else ns.train_args
    if "--hetero-plan" in train_args:
        raise ConfigError("give the starting plan as --plan (before '--'); the launcher passes "
                          "--hetero-plan to the workers")
    cfg, launch = config_from_args(train_args)
    if not cfg.training.save:
        raise ConfigError("the elastic launcher resumes from checkpoints: give --save DIR")
    if cfg.training.load not in (None, cfg.training.save):
        raise ConfigError("--load must be --save's directory (or left out) under the elastic "
                          "launcher, which resumes from there")
    if ns.max_restarts < 0:
        raise ConfigError("--max-restarts must be >= 0")
    cluster = Cluster.from_yaml(ns.cluster)
    prepare_data(cfg, lambda message: None)  # checks the data; sets the padded vocabulary
    run_dir = Path(ns.run_dir or Path(cfg.training.save) / "elastic")
    run_dir.mkdir(parents=True, exist_ok=True)
    if "--load" not in train_args:
        train_args = [*train_args, "--load", cfg.training.save]
    if cfg.training.global_batch_size is None:
        raise ConfigError("the elastic launcher keeps the global batch over re-plans: give "
                          "--global-batch-size")
    job = Job(train_args, cluster, run_dir, cfg.training.save, ns.max_restarts, ns,
              cfg.training.micro_batch_size, cfg.training.global_batch_size)
    return job, cfg, launch


def _first_plan(job: Job, cfg, launch, counts: dict[str, int]) -> Planned:
    cluster = with_counts(job.cluster, counts)
    if job.options.plan:
        plan = HeteroPlan.from_yaml(job.options.plan)
        cfg.parallel.hetero_plan = job.options.plan
        load_hetero_plan(cfg, launch.explicit)  # the same reconciliation the workers make
        plan.check_fits(counts, f"the cluster's healthy chips (plan {job.options.plan})")
        return evaluate(plan, cluster, cfg)
    return best_plan(cluster, cfg, job.global_batch, job.micro_batch,
                     job.options.planner_time_limit)


def resume_point(save: str) -> int | None:
    """The newest iteration in ``save`` whose files are complete (checksums are checked by the
    workers as they load, each part once); None for a fresh start."""
    if not Path(save).is_dir():
        return None
    latest = find_latest_iteration(save) if saved_iterations(save) else None
    for iteration in sorted(saved_iterations(save), reverse=True):
        if latest is not None and iteration > latest:
            continue
        try:
            read_checkpoint_files(iteration_dir(save, iteration))
            return iteration
        except ConfigError:
            continue
    return None


@dataclass
class Outcome:
    """How one attempt ended."""

    ok: bool
    lost_ranks: list[int] = field(default_factory=list)
    user_error: bool = False
    signalled: bool = False
    all_saved: bool = False  # stopped by a signal after every worker saved and stopped
    detected_at: float = 0.0
    detail: str = ""


def _crash_notes(run_dir: Path, attempt: int) -> dict[int, dict]:
    notes = {}
    for path in run_dir.glob(f"attempt{attempt}-failure-rank*.json"):
        try:
            note = json.loads(path.read_text())
            notes[int(note["rank"])] = note
        except (ValueError, KeyError, OSError):
            continue
    return notes


def run_attempt(job: Job, plan_path: Path, world: int, attempt: int,
                ckpt_step: int | None) -> Outcome:
    """One torchrun-equivalent launch of the workers; returns how it ended."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    args = [str(ROOT / "pretrain_gpt.py"), *job.train_args, "--hetero-plan", str(plan_path)]
    if ckpt_step is not None:
        args += ["--ckpt-step", str(ckpt_step)]
    stopped = job.run_dir / f"attempt{attempt}-stopped"
    stopped.mkdir(parents=True, exist_ok=True)
    env = {ELASTIC_DIR_ENV: str(job.run_dir), "MEGATRON_H2_JOB_ID": job.job_id,
           "MEGATRON_H2_ATTEMPT": str(attempt), STOPPED_ENV: str(stopped)}
    if attempt > 0:
        os.environ.pop(FAULT_ENV, None)  # a rehearsed fault happens in the first attempt only
    os.environ.update(env)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world,
                          run_id=f"{job.job_id}-{attempt}", rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=job.options.monitor_interval, start_method="spawn",
                          shutdown_timeout=300)
    try:
        elastic_launch(config, sys.executable)(*args)
        return Outcome(ok=True)
    except SignalException as exc:
        saved = stopped_local_ranks(stopped)
        missing = sorted(set(range(world)) - set(saved))
        unsaved = f"; rank(s) {', '.join(map(str, missing))} did not save" if missing else ""
        return Outcome(ok=False, signalled=True, all_saved=not missing,
                       detected_at=time.time(), detail=f"stopped by signal {exc.sigval.name}; "
                       f"{len(saved)} of {world} workers saved and stopped{unsaved}")
    except ChildFailedError as exc:
        detected = time.time()
        notes = _crash_notes(job.run_dir, attempt)
        failures = {int(rank): f.exitcode for rank, f in exc.failures.items()}
        killed = [r for r, code in failures.items() if code < 0 and code != -signal.SIGTERM]
        crashed = [r for r, note in notes.items() if note.get("kind") == "crash"]
        user = any(code == 2 for code in failures.values()) and not killed
        # A rank killed outright is the lost one (the peers that talked to it report gloo's
        # error as their own); otherwise the rank that crashed on its own.
        lost = sorted(killed or crashed) or [exc.get_first_failure()[0]]
        detail = ", ".join(f"rank {r} exit {code}" for r, code in sorted(failures.items()))
        return Outcome(ok=False, lost_ranks=[] if user else lost, user_error=user,
                       detected_at=detected, detail=detail)


def _watch_recovery(run_dir: Path, detected_at: float, attempt: int) -> threading.Thread:
    """Print the recovery time once rank 0 reports its first iteration of ``attempt``."""
    marker = run_dir / FIRST_ITERATION_FILE

    def watch() -> None:
        while True:
            try:
                data = json.loads(marker.read_text())
                if data["attempt"] == attempt:
                    say(f"recovery took {data['time'] - detected_at:.1f} s from detecting the "
                        f"failure to the first iteration ({data['iteration']}) under the new plan")
                    return
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)

    thread = threading.Thread(target=watch, name="recovery-watch", daemon=True)
    thread.start()
    return thread


def _write_plan(job: Job, planned: Planned, attempt: int) -> Path:
    path = job.run_dir / f"plan_attempt{attempt}.yaml"
    planned.plan.to_yaml(path, header=f"elastic attempt {attempt}: {planned.describe()}; "
                         f"predicted {planned.tokens_per_s:,.0f} tokens/s")
    return path


def run(job: Job, cfg, launch) -> int:
    counts = {c.name: c.count for c in job.cluster.chips}
    probed = probe_chips(job.cluster, job.options.health_probe)
    counts = {t: min(n, probed.get(t, 0)) for t, n in counts.items()}
    planned = _first_plan(job, cfg, launch, counts)
    say(f"attempt 0: {planned.describe()}, predicted {planned.tokens_per_s:,.0f} tokens/s")
    watcher = None
    for attempt in range(job.max_restarts + 1):
        plan_path = _write_plan(job, planned, attempt)
        (job.run_dir / FIRST_ITERATION_FILE).unlink(missing_ok=True)
        resume = resume_point(job.save)
        latest = find_latest_iteration(job.save) if resume is not None else None
        outcome = run_attempt(job, plan_path, planned.plan.world_size, attempt,
                              resume if resume != latest else None)
        if watcher is not None:
            watcher.join(timeout=1.0)
        if outcome.ok:
            say(f"training finished (attempt {attempt}, plan {plan_path})")
            return 0
        if outcome.signalled:  # 0 once every worker saved: the job can be resumed as is
            say(f"attempt {attempt} {outcome.detail}")
            return 0 if outcome.all_saved else EXIT_TEMPFAIL
        say(f"attempt {attempt} failed: {outcome.detail}")
        if outcome.user_error:
            say("a worker stopped on bad input or a numerical check (exit 2): not a hardware "
                "fault, so no restart; see its error above")
            return 2
        if attempt == job.max_restarts:
            say(f"--max-restarts {job.max_restarts} used up")
            return EXIT_TEMPFAIL
        planned, counts, watcher = _replan(job, cfg, planned, counts, outcome, attempt + 1)
        if planned is None:
            return EXIT_TEMPFAIL
    return EXIT_TEMPFAIL


def _replan(job: Job, cfg, planned: Planned, counts: dict[str, int], outcome: Outcome,
            attempt: int):
    """Take out the lost chips and the ones the probe misses, plan again, say what changed."""
    before = dict(counts)
    for rank in outcome.lost_ranks:
        chip = planned.plan.rank_chip(rank)  # of any data-parallel pipeline
        counts[chip] -= 1
        say(f"rank {rank} (chip type '{chip}') is lost: taking its chip out")
    probed = probe_chips(job.cluster, job.options.health_probe)
    for chip, healthy in probed.items():
        if healthy < counts[chip]:
            say(f"health probe: only {healthy} healthy '{chip}' chips")
            counts[chip] = healthy
    try:
        cluster = with_counts(job.cluster, counts)
        new = best_plan(cluster, cfg, job.global_batch, job.micro_batch,
                        job.options.planner_time_limit)
    except ConfigError as exc:
        say(f"cannot continue on the chips left: {exc}")
        return None, counts, None
    old = evaluate(planned.plan, with_counts(job.cluster, before), cfg)
    for line in change_summary(old, new, before, counts):
        say(line)
    resume = resume_point(job.save)
    say(f"resuming from {'iteration ' + str(resume) if resume is not None else 'scratch'} in "
        f"{job.save} under the new plan")
    watcher = _watch_recovery(job.run_dir, outcome.detected_at, attempt)
    return new, counts, watcher


def main(argv: list[str] | None = None) -> int:
    """Run the elastic launcher; one-line errors (exit 2) for bad input."""
    try:
        ns = build_parser().parse_args(argv)
        job, cfg, launch = _prepare(ns)
        return run(job, cfg, launch)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
