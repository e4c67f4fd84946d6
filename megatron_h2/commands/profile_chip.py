"""Profile this machine's chip for the planner: times one transformer layer, the embedding and
the head, forward and backward, a layer's extra backward under selective recompute, for a few
micro-batch sizes, and the optimizer step per parameter; writes the profile table that
`tools/plan.py --profile` reads.

    python tools/profile_chip.py --chip fast --chip slow --model examples/models/tiny.yaml \\
        --micro-batch-sizes 1,2,4 --output runs/profile.yaml

Model flags are pretrain_gpt.py's, as tools/plan.py reads them (or `--model FILE`, a model YAML
as in examples/models/, whose keys they override), dropout included: give the run's
`--hidden-dropout` / `--attention-dropout` (Megatron's default is 0.1 each), since the masks take
time; the table records them and the planner refuses it for a model with other values.
Measure with the thread count your training processes use (`--threads`).

CPU emulation (every chip of a cluster is a single-threaded process on this machine):
`--emulate PLAN` measures while one process per rank of PLAN measures at once, those of chips
with `emulate_slowdown` padding with sleep as the runtime does, so the times are those of one
chip of that cluster sharing this machine's cores. The table also records each pass's CPU time
(`cpu_micro_batch_sizes`: what it computes, however much of a core it got), and with
`--emulate` the calibrated cluster (below) records the cores the processes got together
(`host_cores`: their CPU time over the wall time), so that the planner times a step of such
processes from their CPU work (the cluster's `host_cores` in megatron_h2/planner/cluster.py).
`--cluster FILE --calibrated-cluster OUT` also measures gloo between two processes and writes
FILE with bandwidths fitted to it.
`--cache` reuses an earlier measurement of the same inputs on this machine (same torch).
"""

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_h2.errors import ConfigError
from megatron_h2.planner.model_input import add_model_arguments, model_from_arguments

CACHE_FORMAT = 3  # 3: CPU times and, with --emulate, host_cores


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chip", action="append",
                   help="chip name(s) of the cluster file this measurement stands for "
                        "(default: every chip type of --cluster)")
    add_model_arguments(p)
    p.add_argument("--micro-batch-sizes", default="1,2,4")
    p.add_argument("--device", help="cpu, cuda, ... (default: detect)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--output", required=True)
    p.add_argument("--emulate", metavar="PLAN",
                   help="measure as one chip of PLAN's CPU-emulated cluster: one single-threaded "
                        "process per rank measuring at once (see above)")
    p.add_argument("--window", type=float, default=1.0, metavar="S",
                   help="with --emulate: every measurement keeps all processes busy for at least "
                        "S seconds (default 1)")
    p.add_argument("--cluster", metavar="FILE",
                   help="the cluster YAML the profile is for (its chip types name the table)")
    p.add_argument("--calibrated-cluster", metavar="OUT",
                   help="measure gloo between two processes and write --cluster with bandwidths "
                        "fitted to it here")
    p.add_argument("--cache", action="store_true",
                   help="reuse the measurement of the same inputs on this machine if there is one "
                        "($MEGATRON_H2_CACHE/profiles, default ~/.cache/megatron_h2/profiles)")
    p.add_argument("--max-wait", type=float, default=60.0, metavar="S",
                   help="wait up to S seconds for other processes to leave the cores before "
                        "measuring, and measure again once if they came back meanwhile (a "
                        "disturbed measurement is not cached; default 60; 0: measure at once and "
                        "keep it, whatever else runs)")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--worker-task", choices=("emulate", "links"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.calibrated_cluster and not a.cluster:
        raise ConfigError("--calibrated-cluster needs --cluster (the file to calibrate)")
    if not a.chip:
        if not a.cluster:
            raise ConfigError("give --chip NAME (or --cluster FILE to use its chip types)")
        from megatron_h2.planner.cluster import Cluster

        a.chip = list(Cluster.from_yaml(a.cluster).names)
    if a.emulate and a.threads != 1:
        raise ConfigError("--emulate measures single-threaded processes; leave out --threads")
    return a


def model_config(a):
    """The model of the flags and --model file (the vocabulary padded as pretrain_gpt.py and the
    planner pad it)."""
    return model_from_arguments(a, require_global_batch=False)[0]


def micro_batch_sizes(a) -> list[int]:
    try:
        sizes = [int(x) for x in a.micro_batch_sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(x <= 0 for x in sizes):
        raise ConfigError("--micro-batch-sizes must be positive integers such as 1,2,4")
    return sizes


def rank_slowdowns(plan_path: str) -> list[float]:
    """The emulate_slowdown of every rank's chip, in rank order."""
    from megatron_h2.plan.schema import HeteroPlan

    plan = HeteroPlan.from_yaml(plan_path)
    return [plan.chips[plan.rank_chip(r)].emulate_slowdown for r in range(plan.world_size)]


def link_bytes(cfg) -> tuple[int, int]:
    """fp32 gradients of the whole model, fp32 activations of one sample."""
    return int(cfg.num_parameters()) * 4, cfg.seq_length * cfg.hidden_size * 4


# ----------------------------------------------------------------------- measuring processes
def worker(a) -> None:
    """Under torchrun: ``--emulate`` (every rank measures) or the gloo links (2 ranks)."""
    import torch
    import torch.distributed as dist

    from megatron_h2.devices import get_accelerator
    from megatron_h2.measurement.chip_timing import (
        Pace,
        link_times,
        optimizer_ns_per_param,
        profile_model,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, cfg = dist.get_rank(), model_config(a)
    if a.worker_task == "links":
        result = link_times(*link_bytes(cfg))
    else:
        slowdown = rank_slowdowns(a.emulate)[rank]
        pace = Pace(slowdown, a.window, dist.barrier)
        acc = get_accelerator("cpu")
        dist.barrier()
        cpu, wall = time.process_time(), time.perf_counter()
        table = profile_model(cfg, acc, micro_batch_sizes(a), a.bf16, a.warmup, a.reps,
                              log=lambda message: None, pace=pace)
        cpu_ns: list[float] = []
        optimizer_ns = optimizer_ns_per_param(cfg, acc, a.warmup, a.reps, pace, cpu_ns)
        mine = {"slowdown": slowdown, "table": table, "optimizer_ns": optimizer_ns,
                "optimizer_cpu_ns": cpu_ns[0], "cpu_s": time.process_time() - cpu,
                "wall_s": time.perf_counter() - wall}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        result = gathered
    if rank == 0:
        Path(a.worker).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    # the work is done and written; gloo's threads can still abort the interpreter's
    # finalization ("terminate called without an active exception", SIGABRT: seen in about
    # half of the demo's six-process measurements), so leave without finalizing
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_workers(argv: list[str], task: str, nproc: int, out: Path) -> object:
    # --standalone: the launcher binds a free port itself and keeps it (no port picked here
    # and released, which another launch starting at the same time could take)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "-m", "megatron_h2.commands.profile_chip", *argv, "--worker", str(out),
           "--worker-task", task]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"measuring processes failed ({proc.returncode}):\n"
                           f"{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def measure(a, argv: list[str], cfg, sizes: list[int], work: Path) -> dict:
    """One measurement: {"table", "optimizer_ns", "note", optionally "links"}."""
    result: dict = {}
    if a.emulate:
        slowdowns = rank_slowdowns(a.emulate)
        ranks = run_workers(argv, "emulate", len(slowdowns), work / "emulate.json")
        steady = min(r["slowdown"] for r in ranks)  # ranks that do not pad compute throughout
        chosen = [r for r in ranks if r["slowdown"] == steady]
        result["table"] = median_tables([r["table"] for r in chosen])
        result["optimizer_ns"] = median([r["optimizer_ns"] for r in chosen])
        result["optimizer_cpu_ns"] = median([r["optimizer_cpu_ns"] for r in chosen])
        # the cores the processes got together: their CPU time over the common wall time
        result["host_cores"] = round(sum(r["cpu_s"] for r in ranks)
                                     / median([r["wall_s"] for r in ranks]), 3)
        mix = ", ".join(f"{slowdowns.count(x)} at slowdown {x:g}" for x in sorted(set(slowdowns)))
        result["note"] = (f"measured by tools/profile_chip.py --emulate: {len(ranks)} "
                          f"single-threaded processes at once ({mix}) on {describe_machine()};"
                          f" median of the {len(chosen)} at slowdown {steady:g}; the processes "
                          f"got {result['host_cores']:.2f} cores together")
    else:
        import torch

        from megatron_h2.devices import get_accelerator
        from megatron_h2.measurement.chip_timing import optimizer_ns_per_param, profile_model

        torch.set_num_threads(a.threads)
        acc = get_accelerator(a.device)
        table = profile_model(cfg, acc, sizes, a.bf16, a.warmup, a.reps)
        cpu_ns: list[float] = []
        result.update(table=table, optimizer_ns=optimizer_ns_per_param(cfg, acc, a.warmup,
                                                                       a.reps, cpu_ns=cpu_ns))
        result["optimizer_cpu_ns"] = cpu_ns[0]
        # the thread's CPU time is the work only single-threaded on the CPU
        result["cpu"] = acc.device_type == "cpu" and a.threads == 1
        result["note"] = (f"measured by tools/profile_chip.py on {acc.device_type} "
                          f"({describe_machine()}), {a.threads} thread(s), bf16 {a.bf16}")
    if a.calibrated_cluster:
        result["links"] = run_workers(argv, "links", 2, work / "links.json")
    return result


def median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def median_tables(tables: list[dict]) -> dict:
    """Per-entry median of tables of the same shape (JSON turns the sizes into strings)."""
    first = tables[0]
    return {int(size): {key: round(median([t[size][key] for t in tables]), 4) for key in row}
            for size, row in first.items()}


# ------------------------------------------------------------------------------ this machine
def describe_machine() -> str:
    from megatron_h2.measurement.host_load import usable_cores

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {usable_cores()} cores, host {platform.node()}"


def cache_file(a, cfg, sizes: list[int]) -> Path:
    """Where the measurement of these inputs on this machine is cached."""
    import torch

    from megatron_h2.training.data_setup import default_cache_dir

    key = {"format": CACHE_FORMAT, "model": {k: getattr(cfg, k) for k in sorted(vars(cfg))},
           "sizes": sizes, "bf16": a.bf16, "threads": a.threads, "device": a.device,
           "warmup": a.warmup, "reps": a.reps, "torch": torch.__version__,
           "python": platform.python_version(), "machine": describe_machine(),
           "emulate": rank_slowdowns(a.emulate) if a.emulate else None,
           "window": a.window if a.emulate else None,
           "links": link_bytes(cfg) if a.calibrated_cluster else None}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return default_cache_dir() / "profiles" / f"{digest[:24]}.json"


def measure_quietly(a, argv: list[str], cfg, sizes: list[int]) -> tuple[dict, bool]:
    """Measure once other processes left the cores; repeat once if they came back meanwhile.
    Returns the result and whether it was disturbed all the same."""
    from megatron_h2.measurement.host_load import OtherLoad, wait_for_quiet

    budget = [a.max_wait]
    with tempfile.TemporaryDirectory(prefix="profile_chip_") as tmp:
        attempts = 2 if a.max_wait > 0 else 1
        for attempt in range(attempts):
            quiet = wait_for_quiet(budget) if a.max_wait > 0 else 0.0
            if quiet >= 0.5:
                print(f"other processes still use {quiet:.1f} cores after waiting "
                      f"{a.max_wait:.0f} s: measuring anyway", flush=True)
            with OtherLoad() as other:
                result = measure(a, argv, cfg, sizes, Path(tmp))
            others = "unknown" if other.cores != other.cores else f"{other.cores:.2f}"
            again = attempt + 1 < attempts
            print(f"other processes used {others} cores meanwhile"
                  + (" (disturbed" + ("; measuring again)" if again else ")")
                     if other.disturbed else ""), flush=True)
            if not other.disturbed or attempts == 1:  # --max-wait 0: whatever else runs
                return result, False
    return result, True


def write_outputs(a, cfg, result: dict) -> None:
    from megatron_h2.measurement.chip_timing import write_profile

    write_profile(a.output, cfg, a.chip, result["table"], result["note"],
                  result["optimizer_ns"], result.get("optimizer_cpu_ns"),
                  result.get("cpu", True))
    print(f"profile table written to {a.output} (optimizer step "
          f"{result['optimizer_ns']:.2f} ns per parameter)")
    if a.calibrated_cluster:
        import yaml

        from megatron_h2.plan.yaml_io import load_yaml_mapping
        from megatron_h2.planner.calibration import LinkTimes, calibrated_cluster

        links = LinkTimes.from_dict(result["links"])
        host = result.get("host_cores")
        data = calibrated_cluster(load_yaml_mapping(a.cluster, "cluster"), links,
                                  host_cores=host)
        Path(a.calibrated_cluster).parent.mkdir(parents=True, exist_ok=True)
        Path(a.calibrated_cluster).write_text(
            f"# {a.cluster} with bandwidths fitted to gloo on {describe_machine()}: all-reduce "
            f"of {links.allreduce_bytes / 2**20:.1f} MiB over 2 processes "
            f"{1e3 * links.allreduce_s:.1f} ms, point-to-point of {links.p2p_bytes / 2**10:.0f} "
            f"KiB {1e3 * links.p2p_s:.2f} ms"
            + (f"; host_cores: what the processes of {a.emulate} got together" if host else "")
            + "\n" + yaml.safe_dump(data, sort_keys=False))
        print(f"calibrated cluster written to {a.calibrated_cluster}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        a = parse(argv)
        sizes = micro_batch_sizes(a)
        cfg = model_config(a)
        if a.worker:
            worker(a)
            return 0
        cached = cache_file(a, cfg, sizes) if a.cache else None
        if cached is not None and cached.is_file():
            result = json.loads(cached.read_text())
            result["table"] = {int(k): v for k, v in result["table"].items()}
            print(f"using the measurement of {result['measured_at']} cached in {cached} "
                  "(delete it to measure again)")
        else:
            what = f"as one chip of {a.emulate}" if a.emulate else f"with {a.threads} thread(s)"
            print(f"profiling {describe_machine()} {what}: hidden {cfg.hidden_size}, seq "
                  f"{cfg.seq_length}, micro-batches {sizes}", flush=True)
            result, disturbed = measure_quietly(a, argv, cfg, sizes)
            result["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
            if cached is not None and not disturbed:
                cached.parent.mkdir(parents=True, exist_ok=True)
                temp = cached.with_suffix(f".tmp{os.getpid()}")
                temp.write_text(json.dumps(result))
                os.replace(temp, cached)
            elif cached is not None:
                print("not cached: other processes disturbed the measurement")
        write_outputs(a, cfg, result)
    except ValueError as exc:  # ConfigError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # the measuring processes: torchrun -m megatron_h2.commands.profile_chip
    sys.exit(main())
