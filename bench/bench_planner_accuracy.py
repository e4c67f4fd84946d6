#!/usr/bin/env python3
"""Planner accuracy benchmark (not a test): predicted vs measured step time of real runs.

On this machine's CPU (each "chip" is one single-threaded process; the chip type `slow` is the
same CPU with `emulate_slowdown: 2.0`), the script

1. measures what the planner needs: `tools/profile_chip.py --threads 1` (layer / embedding /
   head forward and backward and a layer's extra backward under selective recompute per
   micro-batch size, the optimizer's once-per-step work per parameter); and gloo's loopback
   all-reduce and point-to-point times (written into the cluster file as bandwidths);
2. plans the two-chip cluster (`fast` + `slow`) with `tools/plan.py --profile`;
3. runs every plan of a fixed set (1-2 processes: even and uneven splits, emulated slowdown,
   recompute none / selective / full, DP 2) plus the planner's plan and the same stages with a
   uniform layer split, for real (`torchrun pretrain_gpt.py --hetero-plan PLAN`,
   OMP_NUM_THREADS=1), and takes the median `iteration_ms` after the warm-up iterations;
4. prints, per plan, the cost model's (`CostModel.evaluate`) and the 1F1B simulator's predicted
   step time against the measured one, the relative errors and their medians (target: median
   error <= 10%), and the planned-vs-uniform speed-up, predicted and measured.

Measurements alternate: every round re-profiles and runs all plans, in reversed order every
other round; the profile used for the predictions is the per-entry median over rounds and a
plan's measured time is the median over rounds. Other processes on the two cores (other sessions'
tests and benchmarks) slow the runs far more than anything the cost model misses, so before every
profile and run the script waits (up to --max-wait seconds in all) until they use less than
--busy cores, measures the cores they used during each run (/proc/stat minus this script's
children) and prints it; a run (or profile) they disturbed all the same is repeated once and the
disturbed one is dropped. Slowdowns that /proc/stat does not show (the host's other guests) remain:
they are what the rounds and medians are for.

    .venv/bin/python bench/bench_planner_accuracy.py                 # ~8 minutes on 2 cores
    .venv/bin/python bench/bench_planner_accuracy.py --rounds 1 --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml
from emulated_runs import (
    ROOT,
    add_quiet_arguments,
    log,
    median_profile,
    profile_chips,
    quiet_waiter,
    run,
    torchrun_cmd,
    train_flags,
    write_corpus,
)
from emulated_runs import measure as measure_plan
from emulated_runs import plan_label as label

from megatron_h2.measurement.host_load import OtherLoad, load_average
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner.calibration import LinkTimes, fitted_gb_per_s
from megatron_h2.planner.cluster import Cluster
from megatron_h2.planner.cost_model import CostConfig, CostModel
from megatron_h2.planner.model_input import model_from_dict
from megatron_h2.planner.profile import ProfileTable
from megatron_h2.planner.simulator import simulate

# hidden 256 / seq 256 / 8 layers: a layer's forward is ~6 ms on one core, so compute dominates
# the Python and launch overheads while a whole step stays around one second.
MODEL = {"num_layers": 8, "hidden_size": 256, "ffn_hidden_size": 704, "num_attention_heads": 8,
         "group_query_attention": True, "num_query_groups": 4, "seq_length": 256,
         "max_position_embeddings": 256, "vocab_size": 4096, "global_batch_size": 8,
         "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
         "disable_bias_linear": True, "untie_embeddings_and_output_weights": True,
         "hidden_dropout": 0.0, "attention_dropout": 0.0}  # LLaMA-style
# NullTokenizer(V) has V tokens (V - 1 is the end-of-document id): 4096 = the planner's
# vocabulary, already a multiple of 128, so the runtime pads nothing.
TOKENIZER_VOCAB = MODEL["vocab_size"]


def planner_model():
    """The bench's model as the planner and pretrain_gpt.py see it."""
    return model_from_dict({k: v for k, v in MODEL.items() if k != "global_batch_size"})


SLOWDOWN = 2.0
CHIPS = {"fast": {"device": "cpu"}, "slow": {"device": "cpu", "emulate_slowdown": SLOWDOWN}}
PROFILE_SIZES = (1, 2, 4)

# name -> (stages as (chip, TP, layers, recompute), DP); micro-batch 1, global batch 8.
PLANS: dict[str, tuple[list[tuple[str, int, int, str]], int]] = {
    "fast 8": ([("fast", 1, 8, "none")], 1),
    "fast 8 full": ([("fast", 1, 8, "full")], 1),
    "fast 4 | fast 4": ([("fast", 1, 4, "none"), ("fast", 1, 4, "none")], 1),
    "fast 6 sel | fast 2": ([("fast", 1, 6, "selective"), ("fast", 1, 2, "none")], 1),
    "fast 5 | slow 3": ([("fast", 1, 5, "none"), ("slow", 1, 3, "none")], 1),
    "slow 2 full | fast 6": ([("slow", 1, 2, "full"), ("fast", 1, 6, "none")], 1),
    "DP 2 x fast 8": ([("fast", 1, 8, "none")], 2),
}
TP_PLAN = {"TP 2 fast 8": ([("fast", 2, 8, "none")], 1)}  # --with-tp: informational


# ---------------------------------------------------------------------------------- probes
def probe_gloo(out: str, dp_bytes: int, act_bytes: int) -> None:
    """Under torchrun, 2 ranks: all-reduce of the DP gradient size and a point-to-point
    exchange of one micro-batch's activation (fp32, as the runtime sends them)."""
    import torch
    import torch.distributed as dist

    from megatron_h2.measurement.chip_timing import link_times

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = link_times(dp_bytes, act_bytes)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ setup files
def cluster_dict(count: int, gloo: dict) -> dict:
    """The CPU-emulated cluster: `count` chips of each type, bandwidths fitted to gloo
    (megatron_h2.planner.calibration.fitted_gb_per_s): DP all-reduces in a node at the
    all-reduce figure, pipeline transfers at the point-to-point one."""
    intra, inter = fitted_gb_per_s(LinkTimes.from_dict(gloo))
    chip = {"device": "cpu", "count": count, "chips_per_node": count,
            # only the MFU column uses the peak: with a profile the measured times rule
            "tflops_bf16": 0.1, "memory_gib": 8, "intra_node_gb_per_s": intra,
            "inter_node_gb_per_s": inter}
    return {"chips": {"fast": dict(chip), "slow": dict(chip, emulate_slowdown=SLOWDOWN)},
            "cross_chip_gb_per_s": inter}


def plan_dict(stages: list[tuple[str, int, int, str]], dp: int, mbs: int = 1) -> dict:
    return {"data_parallel_size": dp, "micro_batch_size": mbs,
            "global_batch_size": MODEL["global_batch_size"],
            "chips": {c: dict(CHIPS[c]) for c in sorted({s[0] for s in stages})},
            "stages": [{"chip": c, "tensor_parallel_size": t, "num_layers": n, "recompute": r}
                       for c, t, n, r in stages]}


def uniform_of(plan: HeteroPlan) -> dict:
    """The same stages, DP and micro-batch with the layers split as evenly as possible (the
    first stages take the remainder)."""
    p, layers = plan.pipeline_parallel_size, MODEL["num_layers"]
    counts = [layers // p + (1 if i < layers % p else 0) for i in range(p)]
    stages = [(s.chip, s.tensor_parallel_size, n, s.recompute)
              for s, n in zip(plan.stages, counts)]
    d = plan_dict(stages, plan.data_parallel_size, plan.micro_batch_size)
    d["chips"] = {name: {"device": c.device, **({"emulate_slowdown": c.emulate_slowdown}
                                                 if c.emulate_slowdown != 1.0 else {})}
                  for name, c in plan.chips.items()}
    return d


def profile_round(work: Path, r: int) -> dict:
    """tools/profile_chip.py --threads 1 (it measures the optimizer step and selective
    recompute too); the bench waits for quiet cores itself."""
    data, output = profile_chips(work, f"r{r}", planner_model(), ["fast", "slow"],
                                 PROFILE_SIZES)
    chip = data["chips"]["fast"]
    sel = ", ".join(f"mb {k}: {v['selective_recompute_ms']:.2f} ms"
                    for k, v in chip["micro_batch_sizes"].items())
    log(f"optimizer step (norm, clip, AdamW, zero_grad): {chip['optimizer_ns_per_param']:.2f} "
        f"ns/param; selective recompute adds per layer {sel}")
    (work / f"profile_r{r}.txt").write_text(output)
    return data


# ------------------------------------------------------------------------------------ main
def rel(pred: float, meas: float | None) -> float | None:
    return None if meas is None else (pred - meas) / meas


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of profiling + running every plan (default 3)")
    parser.add_argument("--iters", type=int, default=8, help="training iterations per run")
    parser.add_argument("--skip", type=int, default=3, help="warm-up iterations not counted")
    parser.add_argument("--with-tp", action="store_true",
                        help="also run a TP 2 plan (informational, not in the medians)")
    parser.add_argument("--time-limit", type=float, default=30.0, help="planner time limit (s)")
    add_quiet_arguments(parser, 540.0)
    parser.add_argument("--workdir", help="keep the files here (default: a temporary folder)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--probe-gloo", nargs=3, metavar=("OUT", "DP_BYTES", "ACT_BYTES"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe_gloo:
        probe_gloo(args.probe_gloo[0], int(args.probe_gloo[1]), int(args.probe_gloo[2]))
        return 0
    if args.iters <= args.skip:
        parser.error("--iters must exceed --skip")

    bench_start = time.perf_counter()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="plan_acc_"))
    work.mkdir(parents=True, exist_ok=True)
    log(f"planner accuracy on this machine: {os.cpu_count()} cores, load average "
        f"{load_average():.2f}; files in {work}")
    model = planner_model()
    log(f"model: {model.num_layers} layers, hidden {model.hidden_size}, ffn "
        f"{model.ffn_hidden_size}, heads {model.num_attention_heads}/{model.num_query_groups}, seq "
        f"{model.seq_length}, vocab {model.vocab_size}, {model.num_parameters() / 1e6:.1f}M "
        f"params; global batch {MODEL['global_batch_size']}; OMP_NUM_THREADS=1 per process")
    (work / "model.yaml").write_text(yaml.safe_dump(MODEL, sort_keys=False))
    data = write_corpus(work, TOKENIZER_VOCAB)

    # ---- calibration: gloo loopback and the optimizer step
    dp_bytes = int(model.num_parameters()) * 4  # fp32 gradients of the whole model
    act_bytes = MODEL["seq_length"] * MODEL["hidden_size"] * 4  # one micro-batch, fp32
    run(torchrun_cmd(2, Path(__file__).resolve(),
                     ["--probe-gloo", str(work / "gloo.json"), str(dp_bytes), str(act_bytes)]))
    gloo = json.loads((work / "gloo.json").read_text())
    log(f"gloo loopback: all-reduce of {dp_bytes / 2**20:.0f} MiB over 2 ranks "
        f"{1e3 * gloo['allreduce_s']:.1f} ms; point-to-point {act_bytes / 2**10:.0f} KiB "
        f"{1e3 * gloo['p2p_s']:.2f} ms")
    for count, name in ((1, "cluster_plan.yaml"), (2, "cluster_eval.yaml")):
        (work / name).write_text(yaml.safe_dump(cluster_dict(count, gloo), sort_keys=False))

    quiet = quiet_waiter(args)

    def profile_with_load(r: int) -> dict:
        """Profile once; if other processes disturbed it, once more (and keep that one)."""
        for attempt in range(2):
            quiet()
            with OtherLoad() as other:
                table = profile_round(work, r)
            calm = not other.cores >= args.busy
            log(f"profile round {r + 1}: other processes used {other.cores:.2f} cores meanwhile"
                + ("" if calm else " (disturbed" + ("; again)" if attempt == 0 else ")")))
            if calm:
                break
        profile_load.append(other.cores)
        return table

    profile_load: list[float] = []
    profiles = [profile_with_load(0)]
    row = profiles[0]["chips"]["fast"]["micro_batch_sizes"][1]
    log(f"profile (round 1, micro-batch 1): layer {row['layer_forward_ms']:.2f}/"
        f"{row['layer_backward_ms']:.2f} ms, head {row['head_forward_ms']:.2f}/"
        f"{row['head_backward_ms']:.2f} ms (forward/backward)")
    (work / "profile.yaml").write_text(yaml.safe_dump(profiles[0], sort_keys=False))

    # ---- plan the two-chip cluster with the profile
    planned_path = work / "planned.yaml"
    proc = run([sys.executable, str(ROOT / "tools" / "plan.py"), "--cluster",
                str(work / "cluster_plan.yaml"), "--model", str(work / "model.yaml"),
                "--profile", str(work / "profile.yaml"), "--output", str(planned_path),
                "--time-limit", str(args.time_limit), "--top", "3"])
    (work / "plan_output.txt").write_text(proc.stdout)
    planned = HeteroPlan.from_yaml(planned_path)
    uniform_path = work / "uniform.yaml"
    uniform_path.write_text(yaml.safe_dump(uniform_of(planned), sort_keys=False))
    uniform = HeteroPlan.from_yaml(uniform_path)
    split_differs = [s.num_layers for s in planned.stages] != [s.num_layers for s in uniform.stages]
    log(f"planner's plan: {label(planned)}; uniform split: {label(uniform)}")

    # ---- the plans to run
    cases: list[tuple[str, Path, bool]] = []  # (name, plan file, counts in the medians)
    fixed = dict(PLANS, **(TP_PLAN if args.with_tp else {}))
    for i, (name, (stages, dp)) in enumerate(fixed.items()):
        path = work / f"plan_{i}.yaml"
        path.write_text(yaml.safe_dump(plan_dict(stages, dp), sort_keys=False))
        cases.append((name, path, name not in TP_PLAN))
    cases.append(("planned", planned_path, True))
    if split_differs:
        cases.append(("uniform", uniform_path, True))
    plans = {name: HeteroPlan.from_yaml(path) for name, path, _ in cases}

    measured: dict[str, list[dict]] = {name: [] for name, _, _ in cases}

    def disturbed(result: dict) -> bool:
        return result["load"] >= args.busy

    def run_case(name: str, path: Path, tag: str) -> None:
        plan = plans[name]
        nproc = sum(s.tensor_parallel_size for s in plan.stages) * plan.data_parallel_size
        quiet()
        result = measure_plan(path, train_flags(model, TOKENIZER_VOCAB, data, args.iters),
                              args.skip, work / "log.jsonl")
        if result["load"] != result["load"]:
            result["load"] = 0.0  # unknown: treat as calm
        measured[name].append(result)
        text = (f"{result['ms']:.0f} ms (iterations {result['iterations_ms']}, "
                f"{result['wall_s']} s)" if "ms" in result
                else f"FAILED: {result['error'].strip().splitlines()[-1:]}")
        flag = " DISTURBED" if disturbed(result) else ""
        log(f"{tag} {label(plan):<28} {nproc} proc, others {result['load']:.2f} cores{flag}: "
            f"{text}")

    for r in range(args.rounds):
        if r > 0:
            profiles.append(profile_with_load(r))
        order = cases if r % 2 == 0 else cases[::-1]
        for name, path, _ in order:
            run_case(name, path, f"round {r + 1}/{args.rounds}")
    # a run that other processes disturbed is repeated once (while the time budget lasts); the
    # disturbed one is then dropped
    pending = [(name, path) for name, path, _ in cases for m in measured[name] if disturbed(m)]
    for index, (name, path) in enumerate(pending):
        if time.perf_counter() - bench_start > args.budget:
            log(f"time budget of {args.budget:.0f} s spent: {len(pending) - index} disturbed "
                "run(s) not repeated")
            break
        run_case(name, path, "repeat   ")

    # ---- predictions from the median profile, errors
    profile_data = median_profile(profiles)
    (work / "profile_median.yaml").write_text(yaml.safe_dump(profile_data, sort_keys=False))
    profile = ProfileTable.from_dict(profile_data)
    cluster = Cluster.from_yaml(work / "cluster_eval.yaml")
    cost = CostModel(cluster, model, CostConfig(), profile)
    rows = []
    for name, _, counted in cases:
        plan = plans[name]
        est = cost.evaluate(plan)
        sim = simulate(plan, cost)
        runs = [m for m in measured[name] if "ms" in m]
        calm_runs = [m for m in runs if not disturbed(m)]
        used = calm_runs or runs  # the undisturbed runs, or all where every one was disturbed
        ok = [m["ms"] for m in used]
        meas = statistics.median(ok) if ok else None
        others = [m["load"] for m in used]
        rows.append({"name": name, "plan": label(plan), "counted": counted,
                     "processes": sum(s.tensor_parallel_size for s in plan.stages)
                     * plan.data_parallel_size,
                     "predicted_ms": 1e3 * est.step_time_s, "simulated_ms": 1e3 * sim.step_time_s,
                     "optimizer_ms": 1e3 * max(s.optimizer_s for s in est.stages),
                     "measured_ms": meas, "rounds_ms": [round(m, 1) for m in ok],
                     "other_cores": statistics.median(others) if others else None,
                     "error": rel(1e3 * est.step_time_s, meas),
                     "sim_error": rel(1e3 * sim.step_time_s, meas)})

    log("\npredicted (cost model / 1F1B simulator, with the median profile) vs measured step time")
    head = (f"{'plan':<28} {'proc':>4} {'model ms':>9} {'sim ms':>7} {'measured ms':>11} "
            f"{'rounds ms':<15} {'others':>6} {'model err':>9} {'sim err':>8}")
    log(head)
    log("-" * len(head))
    for row in rows:
        meas = "-" if row["measured_ms"] is None else f"{row['measured_ms']:.0f}"
        rounds = ",".join(f"{x:.0f}" for x in row["rounds_ms"])
        mark = "" if row["counted"] else "  (not in the median)"
        others = "-" if row["other_cores"] is None else f"{row['other_cores']:.2f}"
        log(f"{row['plan']:<28} {row['processes']:>4} {row['predicted_ms']:>9.0f} "
            f"{row['simulated_ms']:>7.0f} {meas:>11} {rounds:<15} {others:>6} "
            f"{pct(row['error']):>9} {pct(row['sim_error']):>8}{mark}")
    log(f"(rounds: the runs used, undisturbed ones where there are any; others: cores other "
        f"processes used meanwhile, median; during profiling: "
        f"{', '.join(f'{x:.2f}' for x in profile_load)})")
    counted = [r for r in rows if r["counted"] and r["error"] is not None]
    med = statistics.median(abs(r["error"]) for r in counted) if counted else None
    med_sim = statistics.median(abs(r["sim_error"]) for r in counted) if counted else None
    verdict = "OK" if med is not None and med <= 0.10 else "MISSED"
    log(f"median |error| over {len(counted)} plans: cost model "
        f"{'-' if med is None else pct(med)[1:]}, simulator "
        f"{'-' if med_sim is None else pct(med_sim)[1:]} (target <= 10%: {verdict})")
    calm = [r for r in counted if r["other_cores"] is not None and r["other_cores"] < args.busy]
    if len(calm) < len(counted):
        med_calm = statistics.median(abs(r["error"]) for r in calm) if calm else None
        log(f"  {len(counted) - len(calm)} plan(s) ran while other processes used >= "
            f"{args.busy} cores (disturbed); over the {len(calm)} others: "
            f"{'-' if med_calm is None else pct(med_calm)[1:]}")

    # ---- beats uniform
    by_name = {r["name"]: r for r in rows}
    comparison = None
    if not split_differs:
        log("\nthe planner's split equals the uniform split: nothing to win on this cluster")
    elif by_name["planned"]["measured_ms"] and by_name["uniform"]["measured_ms"]:
        p, u = by_name["planned"], by_name["uniform"]
        pred_ratio = u["predicted_ms"] / p["predicted_ms"]
        sim_ratio = u["simulated_ms"] / p["simulated_ms"]
        meas_ratio = u["measured_ms"] / p["measured_ms"]
        agree = abs(meas_ratio / pred_ratio - 1) <= 0.10
        comparison = {"planned": p["plan"], "uniform": u["plan"], "predicted_ratio": pred_ratio,
                      "simulated_ratio": sim_ratio, "measured_ratio": meas_ratio,
                      "agree_within_10pct": agree}
        log(f"\nplanner vs uniform split on the two-chip cluster (fast + slow at {SLOWDOWN:g}x):")
        log(f"  planned {p['plan']}: predicted {p['predicted_ms']:.0f} ms, measured "
            f"{p['measured_ms']:.0f} ms")
        log(f"  uniform {u['plan']}: predicted {u['predicted_ms']:.0f} ms, measured "
            f"{u['measured_ms']:.0f} ms")
        log(f"  uniform / planned: predicted {pred_ratio:.3f} (simulator {sim_ratio:.3f}), "
            f"measured {meas_ratio:.3f}; agree within 10%: {'yes' if agree else 'NO'}")
    elapsed = time.perf_counter() - bench_start
    log(f"\ntotal {elapsed:.0f} s; load average now {load_average():.2f}")
    if args.json:
        result = {"model": MODEL, "rounds": args.rounds, "iterations": args.iters,
                  "skip": args.skip, "gloo": gloo,
                  "cluster": cluster_dict(2, gloo), "profile": profile_data,
                  "planned": label(planned), "rows": rows, "median_abs_error": med,
                  "median_abs_sim_error": med_sim, "uniform_comparison": comparison,
                  "profile_other_cores": profile_load,
                  "runs": measured, "seconds": elapsed}
        Path(args.json).write_text(json.dumps(result, indent=1))
        log(f"wrote {args.json}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
