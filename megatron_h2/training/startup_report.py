"""What a run says at start-up and at its end: the flags the demo set or that change nothing,
the device, precision, model, parallel layout, every pipeline stage, the bridge, the data and the
run's length; then where its checkpoint and logs are.

Everything here only formats lines for ``say`` (rank 0's logger); nothing is built or checked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron_h2.config import ParallelConfig, RunConfig
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.training.arguments import LaunchOptions, describe_demo, describe_no_effect
from megatron_h2.training.data_setup import describe_source
from megatron_h2.training.layout import describe_dp

if TYPE_CHECKING:
    from megatron_h2.checkpointing.checkpoint_io import TrainProgress
    from megatron_h2.training.build import Run

Say = Callable[[str], None]


def say_launch_flags(launch: LaunchOptions, cfg: RunConfig, say: Say) -> None:
    """The embedded demo's line (what it set) and the flags accepted without effect."""
    for line in (describe_demo(launch, cfg.model), describe_no_effect(launch)):
        if line:
            say(line)


def say_loss_scaling(cfg: RunConfig, say: Say) -> None:
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


def say_bridges(plan: HeteroPlan, parallel: ParallelConfig, say: Say) -> None:
    """Log the transport of every boundary that crosses the bridge, and any plan
    ``transports`` entry that no such boundary uses (it has no effect)."""
    bridged = set()
    for number, pipe in enumerate(plan.pipeline_plans):
        where = f"pipeline {number} " if plan.pipelines else ""
        for index in range(len(pipe.stages) - 1):
            a, b = pipe.stages[index].chip, pipe.stages[index + 1].chip
            if parallel.force_bridge or plan.chips[a].device != plan.chips[b].device:
                bridged.add(frozenset((a, b)))
                say(f"{where}boundary {index}-{index + 1}: bridge over "
                    f"{plan.transport_between(a, b)} (chunks of {parallel.bridge_chunk_mb:g} "
                    f"MiB, {parallel.bridge_dtype} on the wire)")
    if plan.pipelines:
        devices = {plan.chips[chip].device for chip in plan.chips_in_use()}
        path = ("the bridge (gloo, host-staged, fp32)" if parallel.force_bridge
                or len(devices) > 1 else "direct point-to-point messages (fp32)")
        say(f"gradients summed across the {len(plan.pipelines)} pipelines by parameter ranges "
            f"over {path}" + (" where device types differ, else directly"
                              if len(devices) > 1 and not parallel.force_bridge else ""))
    for link in plan.transports:
        if frozenset(link.chips) not in bridged:
            say(f"note: transports entry {'/'.join(link.chips)} ({link.transport}) has no "
                "effect: no boundary between these chip types crosses the bridge (it is used "
                "between different device types, or everywhere with --force-bridge)")


def pipeline_lines(plan: HeteroPlan) -> list[str]:
    """The start-up lines on the pipeline(s) and their stages (each pipeline with its share
    of the global batch where there are several)."""
    if not plan.pipelines:
        return [pipeline_line(plan), *stage_lines(plan)]
    lines = [f"data-parallel pipelines: {len(plan.pipelines)} | batch shares "
             f"{' + '.join(str(p.global_batch_size) for p in plan.pipelines)} = "
             f"{plan.global_batch_size} sequences"]
    for index, pipe in enumerate(plan.pipelines):
        lines.append(f"pipeline {index} (ranks {pipe.first_rank}-"
                     f"{pipe.first_rank + pipe.world_size - 1}, {pipe.global_batch_size} "
                     f"sequences): {pipeline_line(pipe).removeprefix('pipeline: ')}")
        lines += [f"  {line}" for line in stage_lines(pipe)]
    return lines


def pipeline_line(plan: HeteroPlan) -> str:
    """The start-up line on the pipeline schedule (of one pipeline)."""
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


def stage_lines(plan: HeteroPlan) -> list[str]:
    """One line per pipeline stage: chip, TP, DP, EP, layers, recompute, emulated slowdown."""
    lines = []
    for index, (spec, chunks) in enumerate(zip(plan.stages, plan.chunk_layer_ranges())):
        chip = plan.chips[spec.chip]
        slow = (f" | emulating a chip {chip.emulate_slowdown:g}x slower (compute padded with "
                "sleep)" if chip.emulate_slowdown != 1.0 else "")
        layers = ", ".join(f"{r.start}-{r.stop - 1}" if len(r) else "none" for r in chunks)
        dp = "" if plan.uniform_dp else f" | DP {plan.stage_dp(index)}"
        ep = spec.expert_model_parallel_size
        split = ep > 1 or spec.expert_tp != spec.tensor_parallel_size
        dp += f" | EP {ep} (expert TP {spec.expert_tp})" if split else ""
        lines.append(f"stage {index}: chip {spec.chip} ({chip.device}) | TP "
                     f"{spec.tensor_parallel_size}{dp} | layers {layers} ({spec.num_layers}) | "
                     f"recompute {spec.recompute}{slow}")
    return lines


def say_run(run: Run) -> None:
    """Everything a built run says before its first iteration."""
    cfg, say, m = run.cfg, run.say, run.cfg.model
    say(f"device: {run.accelerator.describe()} | precision: {cfg.training.precision.describe()}")
    say_loss_scaling(cfg, say)
    say(f"model: {m.num_parameters() / 1e6:.2f}M parameters | layers {m.num_layers} | hidden "
        f"{m.hidden_size} | heads {m.num_attention_heads} (query groups {m.num_query_groups}) | "
        f"ffn {m.ffn_hidden_size} | seq {m.seq_length} | vocab {run.tokenizer.vocab_size} "
        f"(padded {m.vocab_size}) | recompute {m.recompute}")
    say(f"architecture: {m.describe_architecture()}")
    say(f"parallel: world {run.topo.world_size} | DP {describe_dp(run.plan)} | distributed "
        f"optimizer {cfg.parallel.use_distributed_optimizer} | sequence parallel "
        f"{cfg.parallel.sequence_parallel}")
    for line in pipeline_lines(run.plan):
        say(line)
    say_bridges(run.plan, cfg.parallel, say)
    say(f"data: {describe_source(cfg.data)} | {len(run.train_ds)} training samples | setup took "
        f"{time.perf_counter() - run.started:.1f} s")
    say(f"training: {run.iterations} iterations | global batch size {run.batch.describe()}")
    if run.precision is not None:
        say(f"precision check every {cfg.training.precision_check_interval} iterations: one "
            "micro-batch per stage replayed on cpu fp64")


def say_finished(run: Run, progress: TrainProgress) -> None:
    """The closing lines: where training stopped, its checkpoint and its logs."""
    t, say = run.cfg.training, run.say
    say(f"training finished at iteration {progress.iteration} in "
        f"{time.perf_counter() - run.started:.1f} s")
    if t.save:
        say(f"checkpoint: {t.save}")
    if t.tensorboard_dir:
        say(f"TensorBoard logs: {t.tensorboard_dir} "
            f"(view with: tensorboard --logdir {t.tensorboard_dir})")
    if run.demo:
        say("this was the embedded demo; see README.md for training on your own data")
