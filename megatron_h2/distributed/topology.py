"""Which rank does what: built once from the plan, then passed to model, schedule and optimizer.

Rank order (the same for uniform layouts and heterogeneous plans, see
:mod:`megatron_h2.plan.schema`): stage ``s`` owns ``TP_s x DP_s`` consecutive ranks, stages in
pipeline order; inside a stage ``rank = first_rank + dp_rank * TP_s + tp_rank``. So

* a TP group is ``TP_s`` consecutive ranks of one stage and one DP replica;
* a DP group is every ``TP_s``-th rank of one stage (same ``tp_rank``), ``DP_s`` ranks: each
  stage sums its gradients over its own replicas;
* micro-batch ``j`` runs on replica ``j mod DP_s`` of every stage ``s``: pipeline traffic goes from
  the TP group of replica ``j mod DP_s`` of stage ``s`` to that of replica ``j mod DP_{s+1}`` of
  stage ``s + 1`` (the same replica when both stages have the same DP degree; see
  :mod:`megatron_h2.distributed.boundary`).

Example: TP=2, PP=2, DP=2 on 8 ranks: stage 0 = ranks 0-3 (TP groups [0,1], [2,3]; DP groups
[0,2], [1,3]), stage 1 = ranks 4-7; rank 1 sends activations to rank 5. With DP 2 on stage 0
(TP 1, ranks 0-1) and DP 1 on stage 1 (TP 2, ranks 2-3), ranks 0 and 1 both send to ranks 2-3:
rank 0 the even micro-batches, rank 1 the odd ones.

Data-parallel pipelines (a plan of several pipelines, see :mod:`megatron_h2.plan.schema`): each
rank belongs to one pipeline, whose ranks follow those of the pipelines before it; inside its
pipeline everything above holds, with :attr:`Topology.plan` that pipeline (a plan of one pipeline
whose ranks start at its ``first_rank``) and :attr:`Topology.job_plan` the whole plan. The groups
of every pipeline are created on every rank, in pipeline order, plus one gloo group over the job
for the gradient sum across pipelines (:attr:`Topology.pipelines_group`).

Expert parallelism (MoE layers), carved from each stage's ``TP_s x DP_s`` ranks as Megatron-Core
carves a pipeline stage's ranks for its experts: with ``o`` a rank's offset in its stage, its
expert-TP rank is ``o mod ETP``, its EP rank ``(o // ETP) mod EP`` and its expert-DP rank
``o // (ETP x EP)``. So an ETP group is ``ETP`` consecutive ranks, an EP group every ``ETP``-th
rank of a run of ``ETP x EP`` (tokens go all-to-all there), and an expert-DP group every
``ETP x EP``-th rank of the stage (the experts' gradients are summed there, the dense ones over
the DP group). With ``ETP = TP`` the ETP group is the TP group and an EP group spans DP
replicas; with EP 1 and ``ETP = TP`` the expert-DP group is the DP group. With ``ETP != TP``
each rank dispatches its own share of the tokens (its TP rank's 1/TP of its replica's) and an
ETP group all-gathers its ranks' routed rows (:mod:`megatron_h2.parallel.expert_parallel`).

Nothing here is module-level state: :func:`build_topology` creates the groups and returns one
:class:`Topology` that the caller passes on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from megatron_h2.devices import ACCELERATORS, Accelerator, get_accelerator
from megatron_h2.distributed.boundary import replica_ranks
from megatron_h2.errors import ConfigError, RankConfigError
from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec

CHIP_ENV = "MEGATRON_H2_CHIP"
EXPERT_PARALLEL_ATTR = "expert_parallel"
"""Set (True) on a MoE layer's routed experts' parameters: each is held by one EP rank and its
gradient is summed over the expert-data-parallel group (the others' over the DP group)."""


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


def rank_place(plan: HeteroPlan, rank: int) -> str:
    """Where ``rank`` runs, in words: ``stage 1`` (``pipeline 0 stage 1`` with pipelines)."""
    pipeline = plan.pipeline_of_rank(rank)
    stage = plan.pipeline_plans[pipeline].rank_coordinates(rank)[0]
    return f"pipeline {pipeline} stage {stage}" if plan.pipelines else f"stage {stage}"


def accelerator_for_rank(plan: HeteroPlan, rank: int, local_rank: int) -> Accelerator:
    """This rank's chip as the plan places it; errors name the rank (only it can see them)."""
    chip_name, where = plan.rank_chip(rank), rank_place(plan, rank)
    started_as = os.environ.get(CHIP_ENV)
    if started_as and started_as != chip_name:
        raise RankConfigError(f"rank {rank} was started as chip '{started_as}' but the plan puts "
                              f"{where} (chip '{chip_name}') there; launch the components "
                              "in the plan's rank order")
    try:
        return get_accelerator(plan.chips[chip_name].device, local_rank)
    except ConfigError as exc:
        raise RankConfigError(f"{where} (chip '{chip_name}'): {exc}") from None


def default_backend(plan: HeteroPlan) -> str:
    """Backend of the job-wide group: the chip's own when every stage uses one device type,
    else gloo (CPU tensors), the one transport every vendor shares."""
    devices = {chip.device for chip in plan.chips.values()}
    return ACCELERATORS[devices.pop()].dist_backend if len(devices) == 1 else "gloo"


def _check_group_place(kind: str, group: dist.ProcessGroup | None, rank: int,
                       size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid {kind} rank {rank} of size {size}")
    if size > 1 and group is None:
        raise ValueError(f"the {kind} group of size {size} needs an explicit process group")


@dataclass(frozen=True)
class TPContext:
    """The tensor-parallel group this rank belongs to.

    ``rank`` and ``size`` are the rank within, and the size of, ``group``. With
    ``sequence_parallel`` the activations outside the TP regions (norms, residuals, dropout) are
    split along the sequence dimension across the group.
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        _check_group_place("TP", self.group, self.rank, self.size)

    @staticmethod
    def single() -> TPContext:
        """No tensor parallelism: one rank, no communication at all."""
        return TPContext(group=None, rank=0, size=1)

    @staticmethod
    def from_group(group: dist.ProcessGroup, sequence_parallel: bool = False) -> TPContext:
        """The context of the calling rank in an initialised process group."""
        return TPContext(group=group, rank=dist.get_rank(group),
                         size=dist.get_world_size(group), sequence_parallel=sequence_parallel)


@dataclass(frozen=True)
class EPContext:
    """The expert-parallel group this rank belongs to: ``size`` ranks that each hold
    ``1 / size`` of every MoE layer's experts and exchange tokens all-to-all; ``rank`` is this
    rank's place in ``group`` (None where the group has one rank)."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

    def __post_init__(self) -> None:
        _check_group_place("EP", self.group, self.rank, self.size)

    @staticmethod
    def single() -> EPContext:
        """No expert parallelism: every expert on this rank."""
        return EPContext(group=None, rank=0, size=1)

    def local_experts(self, num_experts: int) -> range:
        """The global indices of the experts this rank holds (a contiguous ``1 / size``)."""
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)


def expert_coordinates(stage: StageSpec, offset: int) -> tuple[int, int, int]:
    """``(expert-TP rank, EP rank, expert-DP rank)`` of the rank ``offset`` ranks into its
    stage (Megatron-Core's order: ETP fastest, then EP, then expert DP)."""
    etp, ep = stage.expert_tp, stage.expert_model_parallel_size
    return offset % etp, (offset // etp) % ep, offset // (etp * ep)


@dataclass
class Topology:
    """This rank's place in the plan and its process groups (None where a group has one rank).

    ``plan`` is this rank's pipeline (the whole plan where it has one pipeline), ``job_plan``
    the whole plan (None: ``plan``) and ``pipeline`` the index of this rank's pipeline.
    """

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
    # With virtual stages: the groups of the wrap-around boundary (last stage -> first stage,
    # every rank of both), the chip backend's and gloo (the same group when the backend is gloo).
    # A boundary of its own keeps its messages apart from the 0 -> 1 boundary's when PP = 2.
    wrap_group: dist.ProcessGroup | None = None
    wrap_cpu_group: dist.ProcessGroup | None = None
    job_plan: HeteroPlan | None = None
    pipeline: int = 0
    pipelines_group: dist.ProcessGroup | None = None  # gloo over the job, with pipelines
    # expert parallelism (MoE layers): EP group (tokens all-to-all), ETP group (the experts'
    # TP: the TP group where ETP = TP) and expert-DP group (expert gradients)
    ep_group: dist.ProcessGroup | None = None
    ep_ranks: list[int] = field(default_factory=list)
    etp_group: dist.ProcessGroup | None = None
    etp_ranks: list[int] = field(default_factory=list)
    edp_group: dist.ProcessGroup | None = None
    edp_ranks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.job_plan is None:
            self.job_plan = self.plan

    @property
    def num_pipelines(self) -> int:
        """Data-parallel pipelines of the job (1 without pipelines)."""
        assert self.job_plan is not None
        return self.job_plan.num_pipelines

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
        """DP degree of this rank's stage (its replicas split the step's micro-batches)."""
        return self.plan.stage_dp(self.stage)

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
        """This stage's global layers ``(start, stop)`` (one model chunk only)."""
        r = self.plan.layer_ranges()[self.stage]
        return r.start, r.stop

    @property
    def chunk_ranges(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of the global layers of each of this stage's model chunks."""
        return [(r.start, r.stop) for r in self.plan.chunk_layer_ranges()[self.stage]]

    @property
    def virtual_pipeline_size(self) -> int:
        """Model chunks per stage (V)."""
        return self.plan.virtual_pipeline_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def peer_ranks(self, stage: int, replica: int | None = None) -> list[int]:
        """Ranks of DP replica ``replica`` (default: this rank's) of ``stage`` (its TP group
        there), in tp order."""
        return replica_ranks(self.plan, stage, self.dp_rank if replica is None else replica)

    def tp_context(self, sequence_parallel: bool = False) -> TPContext:
        """This rank's tensor-parallel context; sequence parallelism only where TP > 1."""
        return TPContext(group=self.tp_group, rank=self.tp_rank, size=self.tp_size,
                         sequence_parallel=sequence_parallel and self.tp_size > 1)

    @property
    def ep_size(self) -> int:
        """Expert-parallel degree of this rank's stage."""
        return self.stage_spec.expert_model_parallel_size

    @property
    def edp_size(self) -> int:
        """Expert-data-parallel degree: the stage's ranks / (ETP x EP)."""
        return self.tp_size * self.dp_size // (self.stage_spec.expert_tp * self.ep_size)

    @property
    def expert_ranks(self) -> tuple[int, int, int]:
        """``(expert-TP rank, EP rank, expert-DP rank)`` of this rank."""
        offset = self.rank - self.plan.stage_ranks(self.stage).start
        return expert_coordinates(self.stage_spec, offset)

    def etp_context(self) -> TPContext:
        """The experts' tensor-parallel context: the TP group's (without sequence parallelism)
        where ETP = TP, else the expert-TP group's."""
        etp = self.stage_spec.expert_tp
        if etp == self.tp_size:
            return TPContext(group=self.tp_group, rank=self.tp_rank, size=self.tp_size)
        return TPContext(group=self.etp_group, rank=self.expert_ranks[0], size=etp)

    def ep_context(self) -> EPContext:
        """This rank's expert-parallel context."""
        return EPContext(group=self.ep_group, rank=self.expert_ranks[1], size=self.ep_size)

    def describe(self) -> str:
        layers = ", ".join(f"{a}-{b - 1}" for a, b in self.chunk_ranges)
        pipeline = (f"pipeline {self.pipeline}/{self.num_pipelines} "
                    if self.num_pipelines > 1 else "")
        return (f"rank {self.rank}/{self.world_size}: {pipeline}stage {self.stage}/{self.pp_size} "
                f"(layers {layers}), tp {self.tp_rank}/{self.tp_size}, dp {self.dp_rank}/"
                f"{self.dp_size}")


def build_topology(plan: HeteroPlan, rank: int, world_size: int) -> Topology:
    """Create every TP and DP group of every pipeline, each on its stage's chip backend, and a
    gloo group over all ranks for job-wide reductions (all ranks must call this in the same
    order). ``plan`` is the whole plan; the topology's ``plan`` is this rank's pipeline."""
    pipeline = plan.pipeline_of_rank(rank)
    mine = plan.pipeline_plans[pipeline]
    stage, dp_rank, tp_rank = mine.rank_coordinates(rank)
    topo = Topology(plan=mine, rank=rank, world_size=world_size, stage=stage, dp_rank=dp_rank,
                    tp_rank=tp_rank, job_plan=plan, pipeline=pipeline)
    if world_size == 1:
        topo.tp_ranks, topo.dp_ranks = [0], [0]
        topo.ep_ranks, topo.etp_ranks, topo.edp_ranks = [0], [0], [0]
        return topo
    if dist.get_backend() != "gloo":
        topo.cpu_group = dist.new_group(list(range(world_size)), backend="gloo")
    for pipe in plan.pipeline_plans:
        _build_stage_groups(topo, pipe)
    for pipe in plan.pipeline_plans:
        if pipe.virtual_pipeline_size > 1:
            _build_wrap_groups(topo, pipe)
    if plan.num_pipelines > 1:
        topo.pipelines_group = dist.new_group(list(range(world_size)), backend="gloo")
    return topo


def _build_stage_groups(topo: Topology, plan: HeteroPlan) -> None:
    """The TP and DP groups of every stage of one pipeline (every rank creates them all)."""
    rank = topo.rank
    for s, spec in enumerate(plan.stages):
        start, tp = plan.stage_ranks(s).start, spec.tensor_parallel_size
        backend = ACCELERATORS[plan.chips[spec.chip].device].dist_backend
        dp = plan.stage_dp(s)
        for d in range(dp):  # TP groups
            ranks = list(range(start + d * tp, start + (d + 1) * tp))
            group = dist.new_group(ranks, backend=backend) if tp > 1 else None
            if rank in ranks:
                topo.tp_group, topo.tp_ranks = group, ranks
        for t in range(tp):  # DP groups
            ranks = [start + d * tp + t for d in range(dp)]
            group = dist.new_group(ranks, backend=backend) if dp > 1 else None
            if rank in ranks:
                topo.dp_group, topo.dp_ranks = group, ranks
        _build_expert_groups(topo, plan, s, backend)


def _build_expert_groups(topo: Topology, plan: HeteroPlan, s: int, backend: str) -> None:
    """Stage ``s``'s ETP, EP and expert-DP groups (reusing the TP / DP groups where they have
    the same ranks, so dense stages create nothing new)."""
    spec, stage = plan.stages[s], plan.stage_ranks(s)
    tp, etp, ep = spec.tensor_parallel_size, spec.expert_tp, spec.expert_model_parallel_size
    coords = {r: expert_coordinates(spec, r - stage.start) for r in stage}
    mine = coords.get(topo.rank)

    def groups(key, same_as):  # key: the coordinates a group shares; same_as: reuse check
        members: dict[tuple, list[int]] = {}
        for r, c in coords.items():
            members.setdefault(key(c), []).append(r)
        for shared, ranks in members.items():
            if same_as:
                group = None  # filled in from the TP / DP group below
            else:
                group = dist.new_group(ranks, backend=backend) if len(ranks) > 1 else None
            if mine is not None and key(mine) == shared:
                yield group, ranks

    for group, ranks in groups(lambda c: (c[1], c[2]), etp == tp):
        topo.etp_group, topo.etp_ranks = (topo.tp_group if etp == tp else group), ranks
    for group, ranks in groups(lambda c: (c[0], c[2]), False) if ep > 1 else ():
        topo.ep_group, topo.ep_ranks = group, ranks
    if ep == 1 and mine is not None:
        topo.ep_ranks = [topo.rank]
    for group, ranks in groups(lambda c: (c[0], c[1]), ep == 1 and etp == tp):
        same = ep == 1 and etp == tp
        topo.edp_group, topo.edp_ranks = (topo.dp_group if same else group), ranks


def _build_wrap_groups(topo: Topology, plan: HeteroPlan) -> None:
    """Groups of one pipeline's wrap-around boundary: every rank of its last and its first
    stage, whose replicas exchange by micro-batch (collective, like the others)."""
    last = plan.pipeline_parallel_size - 1
    ends = (plan.stages[0], plan.stages[last])
    devices = {plan.chips[spec.chip].device for spec in ends}
    backend = ACCELERATORS[devices.pop()].dist_backend if len(devices) == 1 else "gloo"
    ranks = sorted({*plan.stage_ranks(0), *plan.stage_ranks(last)})
    cpu = dist.new_group(ranks, backend="gloo")
    chip = cpu if backend == "gloo" else dist.new_group(ranks, backend=backend)
    if topo.rank in ranks:
        topo.wrap_group, topo.wrap_cpu_group = chip, cpu


def init_process_group(backend: str, env: LaunchEnv,
                       timeout_minutes: float) -> dist.Store | None:
    """Join the job's default process group (env:// rendezvous set up by torchrun / srun).

    Returns the job's rendezvous store under a ``megatron_h2/`` prefix, for
    :class:`~megatron_h2.distributed.failures.JobFailures` (None when there is one process or the
    group already exists).
    """
    if env.world_size == 1 or dist.is_initialized():
        return None
    timeout = timedelta(minutes=timeout_minutes)
    # The rendezvous torch's init_process_group would do itself, done here to keep the store.
    store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
    store.set_timeout(timeout)
    dist.init_process_group(backend=backend, store=dist.PrefixStore("default_pg", store),
                            rank=env.rank, world_size=env.world_size, timeout=timeout)
    return dist.PrefixStore("megatron_h2", store)
