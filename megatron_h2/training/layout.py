"""The launch's layout: the plan a run trains, from Megatron's uniform flags or a
``--hetero-plan`` file, reconciled with the command line and checked against the model before
any process group starts."""

from __future__ import annotations

import math
from dataclasses import fields

from megatron_h2.config import (
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
    flag_name,
)
from megatron_h2.devices import ACCELERATORS, PLUGINS_ENV
from megatron_h2.distributed.transport import check_transport
from megatron_h2.errors import ConfigError
from megatron_h2.plan.orders import (
    check_micro_batches,
    check_orders,
    check_replica_micro_batches,
    routed_orders,
)
from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec

# Config fields that a heterogeneous plan replaces: giving both is ambiguous, so it is an error.
PLAN_OWNED: tuple[tuple[type, str], ...] = (
    (ParallelConfig, "tensor_model_parallel_size"),
    (ParallelConfig, "pipeline_model_parallel_size"),
    (ParallelConfig, "pipeline_layer_split"),
    (ParallelConfig, "decoder_first_pipeline_num_layers"),
    (ParallelConfig, "decoder_last_pipeline_num_layers"),
    (ModelConfig, "recompute"),
    (ModelConfig, "recompute_method"),
    (ModelConfig, "recompute_num_layers"),
    (TrainingConfig, "device"),
    (ParallelConfig, "virtual_pipeline_model_parallel_size"),
    (ParallelConfig, "num_layers_per_virtual_pipeline_stage"),
    (ParallelConfig, "expert_model_parallel_size"),
    (ParallelConfig, "expert_tensor_parallel_size"),
)


def uniform_plan(parallel: ParallelConfig, model: ModelConfig, training: TrainingConfig,
                 world_size: int, device: str) -> HeteroPlan:
    """The plan for Megatron's uniform flags (one chip type, same TP on every stage).

    DP is the world size divided by TP x PP; every check raises a one-line ConfigError.
    """
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ConfigError(f"world size {world_size} is not TP x PP x DP: it is not divisible by "
                          f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size "
                          f"{pp} = {tp * pp}; launch a multiple of {tp * pp} processes")
    dp = world_size // (tp * pp)
    if training.global_batch_size is None:  # Megatron's default: one micro-batch per replica
        training.global_batch_size = training.micro_batch_size * dp
    if training.global_batch_size % (training.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size {training.global_batch_size} is not divisible by "
                          f"--micro-batch-size {training.micro_batch_size} x data-parallel size "
                          f"{dp}; make it a multiple of {training.micro_batch_size * dp}")
    layers = parallel.chunk_layers(model.num_layers)  # [stage][chunk]
    chunks = len(layers[0])
    schedule = parallel.pipeline_schedule or ("interleaved" if chunks > 1 else "1f1b")
    check_micro_batches(schedule, pp, chunks,
                        training.global_batch_size // (training.micro_batch_size * dp))
    stages = [StageSpec(chip="default", tensor_parallel_size=tp, num_layers=sum(counts),
                        recompute=model.recompute,
                        chunk_layers=tuple(counts) if chunks > 1 else (),
                        expert_model_parallel_size=parallel.expert_model_parallel_size,
                        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size)
              for counts in layers]
    return HeteroPlan(data_parallel_size=dp, micro_batch_size=training.micro_batch_size,
                      global_batch_size=training.global_batch_size,
                      chips={"default": ChipSpec(device=device)}, stages=stages,
                      schedule=schedule)


def load_hetero_plan(cfg: RunConfig, explicit: frozenset[str]) -> HeteroPlan:
    """Read ``--hetero-plan`` and reconcile it with the flags (the plan owns the layout and the
    batch sizes; model-shape flags stay on the command line)."""
    plan = HeteroPlan.from_yaml(cfg.parallel.hetero_plan)
    for cls, field_name in PLAN_OWNED:
        if field_name in explicit:
            flag = flag_name(next(f for f in fields(cls) if f.name == field_name))
            raise ConfigError(f"{flag} conflicts with --hetero-plan, which sets the layout per "
                              f"stage; drop {flag} or edit the plan")
    schedule = cfg.parallel.pipeline_schedule
    planned = sorted({str(pipe.schedule) for pipe in plan.pipeline_plans})
    if "pipeline_schedule" in explicit and planned != [schedule]:
        raise ConfigError(f"--pipeline-schedule {schedule} differs from the plan's schedule "
                          f"{' / '.join(planned)}; drop the flag or edit the plan")
    t = cfg.training
    for name in ("micro_batch_size", "global_batch_size"):
        if name in explicit and getattr(t, name) != getattr(plan, name):
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(t, name)} differs from the "
                              f"plan's {name} {getattr(plan, name)}; drop the flag or edit the "
                              "plan")
        setattr(t, name, getattr(plan, name))
    for link in plan.transports:
        check_transport(link.transport)  # its library must be installed on every rank
    for name, chip in plan.chips.items():
        if chip.device not in ACCELERATORS:
            raise ConfigError(f"chip '{name}' has unknown device '{chip.device}'; supported: "
                              f"{', '.join(ACCELERATORS)} (vendor plug-ins load from "
                              f"${PLUGINS_ENV}, see docs/devices.md)")
    return plan


def check_plan_for_model(plan: HeteroPlan, model: ModelConfig, parallel: ParallelConfig,
                         world_size: int) -> None:
    """Everything about the layout that must hold before any process group starts (of every
    pipeline of a plan of several, each error naming its pipeline)."""
    plan.validate(model.num_layers, model.num_attention_heads, model.num_query_groups,
                  world_size=world_size, num_experts=model.num_experts)
    check_routing(plan, [plan.global_batch_size])
    for index, pipe in enumerate(plan.pipelines):
        if any(stage.expert_tp != stage.tensor_parallel_size for stage in pipe.stages):
            raise ConfigError(f"pipeline {index} sets an expert tensor parallel size other than "
                              "its stage's TP, which plans of several data-parallel pipelines "
                              "do not run yet; omit expert_tensor_parallel_size there")
        try:
            _check_stages_for_model(pipe, model, parallel)
        except ConfigError as exc:
            raise ConfigError(f"pipeline {index}: {exc}") from None
    if not plan.pipelines:
        _check_stages_for_model(plan, model, parallel)


def _check_stages_for_model(plan: HeteroPlan, model: ModelConfig,
                            parallel: ParallelConfig) -> None:
    for index, stage in enumerate(plan.stages):
        tp = stage.tensor_parallel_size
        if model.vocab_size % tp:
            raise ConfigError(f"stage {index} tensor parallel size {tp} does not divide the "
                              f"padded vocabulary {model.vocab_size}; set "
                              "--make-vocab-size-divisible-by to a multiple of it")
        if model.ffn_hidden_size % tp:
            raise ConfigError(f"stage {index} tensor parallel size {tp} does not divide "
                              f"--ffn-hidden-size {model.ffn_hidden_size}")
        _check_stage_experts(index, stage, model, parallel)
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            size = getattr(model, name) if model.is_moe else None
            if size and size % tp:
                raise ConfigError(f"stage {index} tensor parallel size {tp} does not divide "
                                  f"--{name.replace('_', '-')} {size}")
        if parallel.sequence_parallel and model.seq_length % tp:
            raise ConfigError(f"--sequence-parallel needs --seq-length {model.seq_length} "
                              f"divisible by the tensor parallel size {tp} (stage {index})")
    if len(plan.stages) == 1 and plan.stages[0].num_layers == 0:
        raise ConfigError("the only pipeline stage has no transformer layer")


def _check_stage_experts(index: int, stage: StageSpec, model: ModelConfig,
                         parallel: ParallelConfig) -> None:
    """What expert parallelism runs: experts split over TP like the dense MLP (ETP = TP), or
    over an expert-TP group of their own (ETP != TP: each TP rank dispatches its 1/TP of the
    tokens, the routed rows are all-gathered over the ETP group and the outputs reduce-scattered
    back, as Megatron-Core's dispatchers do); EP groups across data-parallel replicas (which
    hold different tokens; each MoE block routes its TP group's whole sequence)."""
    tp, etp = stage.tensor_parallel_size, stage.expert_tp
    if etp == tp or not model.is_moe:
        return
    if (model.moe_ffn_hidden_size or 0) % etp:
        raise ConfigError(f"stage {index}: expert tensor parallel size {etp} does not divide "
                          f"--moe-ffn-hidden-size {model.moe_ffn_hidden_size}")
    if model.seq_length % tp:
        raise ConfigError(f"stage {index}: an expert tensor parallel size ({etp}) other than "
                          f"TP {tp} needs --seq-length {model.seq_length} divisible by TP (each "
                          "TP rank dispatches its share of the sequence)")


def stage_dps(plan: HeteroPlan) -> tuple[int, ...]:
    """Every stage's DP degree, in pipeline order (of one pipeline)."""
    return tuple(plan.stage_dp(s) for s in range(plan.pipeline_parallel_size))


def batch_unit(plan: HeteroPlan) -> int:
    """The data-parallel size every global batch size must split over (in micro-batches): the
    least common multiple of the stages' DP degrees; 1 for a plan of several pipelines, whose
    one global batch their shares split (:func:`check_routing`)."""
    return 1 if plan.pipelines else math.lcm(*stage_dps(plan))


def describe_dp(plan: HeteroPlan) -> str:
    """``2`` with one DP degree, ``2/1/2 per stage (micro-batch j on replica j mod DP)``; with
    pipelines each pipeline's, ``1 | 2/1 per stage per pipeline``."""
    if plan.pipelines:
        return " | ".join(str(p.data_parallel_size) if p.uniform_dp
                          else "/".join(map(str, stage_dps(p))) + " per stage"
                          for p in plan.pipelines) + " per pipeline"
    if plan.uniform_dp:
        return str(plan.data_parallel_size)
    return ("/".join(map(str, stage_dps(plan))) + " per stage (micro-batch j on replica j mod "
            "DP)")


def check_routing(plan: HeteroPlan, batch_sizes: list[int]) -> None:
    """Every global batch size splits into micro-batches that each stage's replicas can run
    under the plan's schedule (Megatron's rules per replica); with per-stage DP degrees, the
    replay of every replica's order proves that the routed schedule cannot hang. A plan of
    several pipelines runs one global batch, each pipeline its share."""
    if plan.pipelines:
        sizes = sorted(set(batch_sizes))
        if sizes != [plan.global_batch_size]:
            raise ConfigError(f"a plan of {len(plan.pipelines)} pipelines splits its global "
                              f"batch {plan.global_batch_size} into fixed shares; the batch-size "
                              f"schedule asks for {', '.join(map(str, sizes))}: drop "
                              "--rampup-batch-size")
        for index, pipe in enumerate(plan.pipelines):
            try:
                check_routing(pipe, [pipe.global_batch_size])
            except ConfigError as exc:
                raise ConfigError(f"pipeline {index}: {exc}") from None
        return
    dps, chunks = stage_dps(plan), plan.virtual_pipeline_size
    for batch in batch_sizes:
        total = batch // plan.micro_batch_size
        check_replica_micro_batches(plan.schedule, dps, chunks, total)
        if plan.uniform_dp:
            continue
        try:
            for forward_only in (False, True):
                check_orders(routed_orders(plan.schedule, dps, chunks, total, forward_only),
                             chunks, dps)
        except AssertionError as exc:  # never seen: the orders are built to pass
            raise ConfigError(f"the {plan.schedule} schedule cannot run {total} micro-batches "
                              f"over data-parallel sizes {list(dps)}: {exc}") from None
