"""Which rank does what: built once from the plan, then passed to model, schedule and optimizer.

Rank order (the same for uniform layouts and heterogeneous plans, see
:mod:`megatron_h2.hetero_plan`): stage ``s`` owns ``TP_s x DP`` consecutive ranks, stages in
pipeline order; inside a stage ``rank = first_rank + dp_rank * TP_s + tp_rank``. So

* a TP group is ``TP_s`` consecutive ranks of one stage and one DP replica;
* a DP group is every ``TP_s``-th rank of one stage (same ``tp_rank``);
* DP replica ``d``'s pipeline is its TP group in every stage; pipeline traffic goes from
  ``(s, d, t)`` to ``(s + 1, d, t)``.

Example: TP=2, PP=2, DP=2 on 8 ranks: stage 0 = ranks 0-3 (TP groups [0,1], [2,3]; DP groups
[0,2], [1,3]), stage 1 = ranks 4-7; rank 1 sends activations to rank 5.

Nothing here is module-level state: :func:`build_topology` creates the groups and returns one
:class:`Topology` that the caller passes on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from megatron_h2.config import ModelConfig, ParallelConfig, RunConfig, TrainingConfig
from megatron_h2.devices import ACCELERATORS, Accelerator, get_accelerator
from megatron_h2.errors import ConfigError, RankConfigError
from megatron_h2.hetero_plan import ChipSpec, HeteroPlan, StageSpec

# Flags that a heterogeneous plan replaces: giving both is ambiguous, so it is an error.
PLAN_OWNED_FLAGS = {"tensor_model_parallel_size": "--tensor-model-parallel-size",
                    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
                    "pipeline_layer_split": "--pipeline-layer-split",
                    "decoder_first_pipeline_num_layers": "--decoder-first-pipeline-num-layers",
                    "decoder_last_pipeline_num_layers": "--decoder-last-pipeline-num-layers",
                    "recompute_granularity": "--recompute-granularity",
                    "recompute_activations": "--recompute-activations",
                    "device": "--device"}
CHIP_ENV = "MEGATRON_H2_CHIP"


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher (torchrun / srun) says about this process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_environ(cls) -> LaunchEnv:
        def read(name: str, default: int) -> int:
            value = os.environ.get(name, str(default))
            if not value.isdigit():
                raise ConfigError(f"environment variable {name}={value!r} is not a number")
            return int(value)

        return cls(rank=read("RANK", 0), world_size=read("WORLD_SIZE", 1),
                   local_rank=read("LOCAL_RANK", 0))


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
    if training.global_batch_size % (training.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size {training.global_batch_size} is not divisible by "
                          f"--micro-batch-size {training.micro_batch_size} x data-parallel size "
                          f"{dp}; make it a multiple of {training.micro_batch_size * dp}")
    stages = [StageSpec(chip="default", tensor_parallel_size=tp, num_layers=n,
                        recompute=model.recompute)
              for n in parallel.stage_layers(model.num_layers)]
    return HeteroPlan(data_parallel_size=dp, micro_batch_size=training.micro_batch_size,
                      global_batch_size=training.global_batch_size,
                      chips={"default": ChipSpec(device=device)}, stages=stages)


def load_hetero_plan(cfg: RunConfig, explicit: frozenset[str]) -> HeteroPlan:
    """Read ``--hetero-plan`` and reconcile it with the flags (the plan owns the layout and the
    batch sizes; model-shape flags stay on the command line)."""
    plan = HeteroPlan.from_yaml(cfg.parallel.hetero_plan)
    for field_name, flag in PLAN_OWNED_FLAGS.items():
        if field_name in explicit:
            raise ConfigError(f"{flag} conflicts with --hetero-plan, which sets the layout per "
                              f"stage; drop {flag} or edit the plan")
    t = cfg.training
    for name in ("micro_batch_size", "global_batch_size"):
        if name in explicit and getattr(t, name) != getattr(plan, name):
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(t, name)} differs from the "
                              f"plan's {name} {getattr(plan, name)}; drop the flag or edit the "
                              "plan")
        setattr(t, name, getattr(plan, name))
    for name, chip in plan.chips.items():
        if chip.device not in ACCELERATORS:
            raise ConfigError(f"chip '{name}' has unknown device '{chip.device}'; supported: "
                              f"{', '.join(ACCELERATORS)}")
    return plan


def accelerator_for_rank(plan: HeteroPlan, rank: int, local_rank: int) -> Accelerator:
    """This rank's chip as the plan places it; errors name the rank (only it can see them)."""
    stage = plan.rank_coordinates(rank)[0]
    chip_name = plan.stages[stage].chip
    started_as = os.environ.get(CHIP_ENV)
    if started_as and started_as != chip_name:
        raise RankConfigError(f"rank {rank} was started as chip '{started_as}' but the plan puts "
                              f"stage {stage} (chip '{chip_name}') there; launch the components "
                              "in the plan's stage order")
    try:
        return get_accelerator(plan.chips[chip_name].device, local_rank)
    except ConfigError as exc:
        raise RankConfigError(f"stage {stage} (chip '{chip_name}'): {exc}") from None


def default_backend(plan: HeteroPlan) -> str:
    """Backend of the job-wide group: the chip's own when every stage uses one device type,
    else gloo (CPU tensors), the one transport every vendor shares."""
    devices = {chip.device for chip in plan.chips.values()}
    return ACCELERATORS[devices.pop()].dist_backend if len(devices) == 1 else "gloo"


def check_plan_for_model(plan: HeteroPlan, model: ModelConfig, parallel: ParallelConfig,
                         world_size: int) -> None:
    """Everything about the layout that must hold before any process group starts."""
    plan.validate(model.num_layers, model.num_attention_heads, model.num_query_groups,
                  world_size=world_size)
    for index, stage in enumerate(plan.stages):
        tp = stage.tensor_parallel_size
        if model.vocab_size % tp:
            raise ConfigError(f"stage {index} tensor parallel size {tp} does not divide the "
                              f"padded vocabulary {model.vocab_size}; set "
                              "--make-vocab-size-divisible-by to a multiple of it")
        if model.ffn_hidden_size % tp:
            raise ConfigError(f"stage {index} tensor parallel size {tp} does not divide "
                              f"--ffn-hidden-size {model.ffn_hidden_size}")
        if parallel.sequence_parallel and model.seq_length % tp:
            raise ConfigError(f"--sequence-parallel needs --seq-length {model.seq_length} "
                              f"divisible by the tensor parallel size {tp} (stage {index})")
    if len(plan.stages) == 1 and plan.stages[0].num_layers == 0:
        raise ConfigError("the only pipeline stage has no transformer layer")


@dataclass
class Topology:
    """This rank's place in the plan and its process groups (None where a group has one rank)."""

    plan: HeteroPlan
    rank: int
    world_size: int
    stage: int
    dp_rank: int
    tp_rank: int
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None  # gloo over every rank (None: the default group)
    tp_ranks: list[int] = field(default_factory=list)
    dp_ranks: list[int] = field(default_factory=list)

    @property
    def stage_spec(self) -> StageSpec:
        return self.plan.stages[self.stage]

    @property
    def chip(self) -> ChipSpec:
        return self.plan.chips[self.stage_spec.chip]

    @property
    def tp_size(self) -> int:
        return self.stage_spec.tensor_parallel_size

    @property
    def dp_size(self) -> int:
        return self.plan.data_parallel_size

    @property
    def pp_size(self) -> int:
        return len(self.plan.stages)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    @property
    def layer_range(self) -> tuple[int, int]:
        r = self.plan.layer_ranges()[self.stage]
        return r.start, r.stop

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def peer_ranks(self, stage: int) -> list[int]:
        """Ranks of this rank's DP replica in ``stage`` (its TP group there), in tp order."""
        tp = self.plan.stages[stage].tensor_parallel_size
        start = self.plan.stage_ranks(stage).start + self.dp_rank * tp
        return list(range(start, start + tp))

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size}: stage {self.stage}/{self.pp_size} "
                f"(layers {self.layer_range[0]}-{self.layer_range[1] - 1}), tp {self.tp_rank}/"
                f"{self.tp_size}, dp {self.dp_rank}/{self.dp_size}")


def build_topology(plan: HeteroPlan, rank: int, world_size: int) -> Topology:
    """Create every TP and DP group, each on its stage's chip backend, and a gloo group over
    all ranks for job-wide reductions (all ranks must call this in the same order)."""
    stage, dp_rank, tp_rank = plan.rank_coordinates(rank)
    topo = Topology(plan=plan, rank=rank, world_size=world_size, stage=stage, dp_rank=dp_rank,
                    tp_rank=tp_rank)
    if world_size == 1:
        topo.tp_ranks, topo.dp_ranks = [0], [0]
        return topo
    if dist.get_backend() != "gloo":
        topo.cpu_group = dist.new_group(list(range(world_size)), backend="gloo")
    for s, spec in enumerate(plan.stages):
        start, tp = plan.stage_ranks(s).start, spec.tensor_parallel_size
        backend = ACCELERATORS[plan.chips[spec.chip].device].dist_backend
        for d in range(plan.data_parallel_size):  # TP groups
            ranks = list(range(start + d * tp, start + (d + 1) * tp))
            group = dist.new_group(ranks, backend=backend) if tp > 1 else None
            if rank in ranks:
                topo.tp_group, topo.tp_ranks = group, ranks
        for t in range(tp):  # DP groups
            ranks = [start + d * tp + t for d in range(plan.data_parallel_size)]
            group = (dist.new_group(ranks, backend=backend) if plan.data_parallel_size > 1
                     else None)
            if rank in ranks:
                topo.dp_group, topo.dp_ranks = group, ranks
    return topo


def init_process_group(backend: str, env: LaunchEnv, timeout_minutes: float) -> None:
    """Join the job's default process group (env:// rendezvous set up by torchrun / srun)."""
    if env.world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(minutes=timeout_minutes))
