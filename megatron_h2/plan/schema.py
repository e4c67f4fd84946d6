"""The heterogeneous parallel plan: the one file the planner writes and the runtime reads.

A :class:`HeteroPlan` says how one model is laid out over a cluster whose pipeline stages run on
different kinds of chips (HeteroPP). ``tools/plan.py`` writes it; ``pretrain_gpt.py --hetero-plan
FILE`` reads it with :meth:`HeteroPlan.from_yaml` and checks it against the model flags with
:meth:`HeteroPlan.validate` before any process group is created.

YAML schema (every key is required unless a default is given)::

    data_parallel_size: 1        # DP degree of every stage that does not set its own
    micro_batch_size: 1          # sequences per micro-batch, shared by every stage
    global_batch_size: 8         # multiple of micro_batch_size * every stage's DP
    chips:                       # chip name -> how the runtime drives that chip
      fast: {device: cpu}                          # device: torch device type (cuda, npu, cpu...)
      slow: {device: cpu, emulate_slowdown: 2.0}   # optional, default 1.0: CPU emulation only
    stages:                      # pipeline order: stage 0 holds the embedding, the last the head
      - {chip: fast, tensor_parallel_size: 2, num_layers: 3}
      - {chip: slow, tensor_parallel_size: 1, num_layers: 1, recompute: full}
    schedule: 1f1b               # optional: 1f1b | interleaved | zero-bubble (see below)
    transports:                  # optional: the bridge's transfer library per pair of chip types
      - {chips: [fast, slow], transport: nixl}     # gloo (default for unlisted pairs) or nixl

A boundary between stages on different chip types (or any boundary with ``--force-bridge``)
crosses the host-staged bridge; ``transports`` picks what carries the bridge's chunks between
two chip types: ``gloo`` (torch.distributed over TCP, the default) or ``nixl`` (NVIDIA's NIXL
transfer library over UCX; ``pip install 'megatron_h2[nixl]'``). See
:mod:`megatron_h2.distributed.transport`.

``recompute`` is ``none`` (default), ``selective`` (norms, core attention and the SwiGLU
activation are recomputed in backward) or ``full`` (whole layers are recomputed from their input).

Virtual pipeline stages (interleaving): a stage's ``num_layers`` may be a list, one layer count
per model chunk, e.g. ``num_layers: [2, 1]``; every stage then has the same number of chunks
``V`` (:attr:`HeteroPlan.virtual_pipeline_size`). Layers are assigned chunk-major, as Megatron's
interleaved schedule orders them: chunk 0 of stage 0, chunk 0 of stage 1, ..., chunk 0 of the
last stage, then chunk 1 of stage 0, ... (:meth:`HeteroPlan.chunk_layer_ranges`). Only chunk 0
of the first stage and the last chunk of the last stage (which hold the embedding and the head)
may be empty. ``schedule`` defaults to ``interleaved`` when ``V > 1`` and to ``1f1b`` otherwise.

Per-stage data parallelism: a stage may set its own ``data_parallel_size`` (``DP_s``), e.g.
``{chip: slow, tensor_parallel_size: 1, num_layers: 2, data_parallel_size: 2}``. The global batch
is cut into ``M = global_batch_size / micro_batch_size`` micro-batches numbered ``0 .. M-1``;
every stage processes all ``M``, its replica ``r`` the micro-batches ``j`` with
``j mod DP_s == r`` (:meth:`HeteroPlan.stage_micro_batches` of them per step).

Experts (MoE models): a stage may set ``expert_model_parallel_size`` (EP, default 1) and
``expert_tensor_parallel_size`` (ETP, default the stage's TP); ``EP x ETP`` must divide the
stage's ``TP x DP`` ranks and EP the experts (:meth:`StageSpec.check_experts`).

Rank layout (what the runtime must build its process groups from):

* Stage ``s`` owns ``tensor_parallel_size * DP_s`` consecutive global ranks, stages in pipeline
  order, so stage 0 starts at rank 0 (:meth:`HeteroPlan.stage_ranks`).
* Inside a stage, ``rank = first_rank + dp_rank * tensor_parallel_size + tp_rank``: a TP group is
  ``tensor_parallel_size`` consecutive ranks (kept inside one node), a DP group takes every
  ``tensor_parallel_size``-th rank of the stage (:meth:`HeteroPlan.rank_coordinates`).
* Micro-batch ``j`` runs on replica ``j mod DP_s`` of every stage: its pipeline point-to-point
  traffic goes from the TP group of replica ``j mod DP_s`` of stage ``s`` to that of replica
  ``j mod DP_{s+1}`` of stage ``s + 1`` (the same replica when both have the same DP degree),
  even where the two stages have different TP degrees
  (:mod:`megatron_h2.distributed.boundary`, :mod:`megatron_h2.plan.orders`).
* Layers are numbered globally; stage ``s`` runs ``layer_ranges()[s]`` (0-based, contiguous)
  when it has one chunk, and ``chunk_layer_ranges()[s]`` in general.

Data-parallel pipelines: a plan may list several pipelines instead of one stage list. Each is a
whole pipeline as above (its own chips, stages, TP, DP, layer split, recompute, schedule and
virtual stages) and computes the whole model on its share of the global batch; the gradients are
summed over every replica of every pipeline, so a step equals one process's over the global
batch::

    micro_batch_size: 1          # shared by every pipeline
    global_batch_size: 8         # the sum of the pipelines' batch shares
    chips:
      fast: {device: cpu}
      slow: {device: cpu, emulate_slowdown: 2.0}
    pipelines:
      - batch_share: 6           # sequences per step: whole micro-batches for every replica
        data_parallel_size: 1    # optional: the plan's data_parallel_size, else 1
        stages:
          - {chip: fast, tensor_parallel_size: 2, num_layers: 4}
      - batch_share: 2
        schedule: 1f1b           # optional, per pipeline (default as above)
        stages:
          - {chip: slow, tensor_parallel_size: 1, num_layers: 2}
          - {chip: slow, tensor_parallel_size: 1, num_layers: 2}
    transports: []               # optional, shared by every pipeline

A top-level ``data_parallel_size`` / ``schedule`` is the default of the pipelines that do not
set their own; ``stages`` and ``pipelines`` exclude each other. In Python the plan keeps each
pipeline in :attr:`HeteroPlan.pipelines` as a plan of one pipeline whose ``global_batch_size``
is its share and whose ``first_rank`` says where its ranks start (the top-level ``stages`` is
then empty, and what only one pipeline has, such as :meth:`HeteroPlan.stage_ranks` or
:meth:`HeteroPlan.layer_ranges`, is asked of a pipeline). :meth:`HeteroPlan.of_pipelines`
combines plans of one pipeline the same way.

* Pipeline ``k`` owns the ``world_size`` ranks after those of pipelines ``0 .. k-1``, laid out
  inside as above (:meth:`HeteroPlan.pipeline_of_rank`, :meth:`HeteroPlan.rank_chip`).
* Its micro-batches are the sequences ``pipeline_samples(k)`` of the global batch: pipeline 0
  takes the first ``batch_share`` sequences, pipeline 1 the next ones, and so on.
* Every pipeline holds every layer of the model exactly once; pipelines may shard a layer
  differently (other TP degree, other stage boundaries, other chip types).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from megatron_h2.errors import ConfigError
from megatron_h2.plan.orders import SCHEDULES
from megatron_h2.plan.specs import TRANSPORTS, ChipSpec, LinkSpec, StageSpec
from megatron_h2.plan.yaml_io import closest, load_yaml_mapping, positive_int

__all__ = ["TRANSPORTS", "ChipSpec", "HeteroPlan", "LinkSpec", "StageSpec"]


@dataclass(frozen=True)
class HeteroPlan:
    """A validated heterogeneous plan (see the module docstring for the schema and rank layout).

    Construction checks everything that does not need the model: positive sizes, the global batch
    being a multiple of ``micro_batch_size * data_parallel_size``, chip names, and that only the
    first and last stages (which hold the embedding and the head) may have no layer; with
    ``pipelines``, that the shares add up to the global batch and that every pipeline holds the
    same layers. Call :meth:`validate` with the model flags for the rest.

    ``pipelines`` (two or more plans of one pipeline, each with its share as
    ``global_batch_size``) makes a plan of data-parallel pipelines; ``stages`` is then empty and
    the pipelines are stored with this plan's chips and transports and their ``first_rank``.
    ``first_rank`` is where a pipeline's ranks start in the job (0 for a plan of its own).
    """

    data_parallel_size: int
    micro_batch_size: int
    global_batch_size: int
    chips: Mapping[str, ChipSpec]
    stages: Sequence[StageSpec]
    schedule: str | None = None  # None: "interleaved" with virtual stages, else "1f1b"
    transports: Sequence[LinkSpec] = ()
    pipelines: Sequence[HeteroPlan] = ()  # data-parallel pipelines (two or more), else empty
    first_rank: int = 0

    def __post_init__(self) -> None:
        positive_int(self.data_parallel_size, "data_parallel_size")
        positive_int(self.micro_batch_size, "micro_batch_size")
        positive_int(self.global_batch_size, "global_batch_size")
        positive_int(self.first_rank, "first_rank", minimum=0)
        if not isinstance(self.chips, Mapping) or not self.chips:
            raise ConfigError("chips must map at least one chip name to {device: ...}")
        for name, chip in self.chips.items():
            if not isinstance(chip, ChipSpec):
                raise ConfigError(f"chip '{name}' must be a ChipSpec, got {type(chip).__name__}")
        object.__setattr__(self, "chips", dict(self.chips))
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "transports", tuple(self.transports))
        object.__setattr__(self, "pipelines", tuple(self.pipelines))
        if self.pipelines:
            self._check_transports()
            self._init_pipelines()
            return
        if not self.stages:
            raise ConfigError("stages is empty; a plan needs at least one pipeline stage")
        self._check_batch()
        self._check_stages()
        self._check_chunks()
        if self.schedule is None:
            default = "interleaved" if self.virtual_pipeline_size > 1 else "1f1b"
            object.__setattr__(self, "schedule", default)
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got "
                              f"{self.schedule!r}{closest(str(self.schedule), SCHEDULES)}")
        if self.schedule == "interleaved" and self.virtual_pipeline_size == 1:
            raise ConfigError("the interleaved schedule needs virtual pipeline stages: give "
                              "every stage's num_layers as a list with one count per chunk")
        if self.schedule == "1f1b" and self.virtual_pipeline_size > 1:
            raise ConfigError("the stages have several model chunks, which the 1f1b schedule "
                              "cannot run; use schedule: interleaved")
        self._check_transports()

    def _init_pipelines(self) -> None:
        """Check the pipelines against each other and store them with this plan's chips and
        transports, each knowing where its ranks start."""
        if len(self.pipelines) < 2:
            raise ConfigError("pipelines lists one pipeline; a plan of one pipeline gives its "
                              "stages (and data_parallel_size) at the top level")
        if self.stages or self.first_rank:
            raise ConfigError("a plan of several pipelines keeps its stages in its pipelines; "
                              "leave stages empty (and first_rank 0)")
        stored, start = [], 0
        for index, pipe in enumerate(self.pipelines):
            if not isinstance(pipe, HeteroPlan) or pipe.pipelines:
                raise ConfigError(f"pipeline {index} must be a plan of one pipeline, got "
                                  f"{type(pipe).__name__}")
            self._check_pipeline(index, pipe)
            stored.append(replace(pipe, chips=self.chips, transports=self.transports,
                                  first_rank=start))
            start += pipe.world_size
        shares = [pipe.global_batch_size for pipe in self.pipelines]
        if sum(shares) != self.global_batch_size:
            raise ConfigError(f"the pipelines' batch shares {' + '.join(map(str, shares))} = "
                              f"{sum(shares)} do not add up to global_batch_size "
                              f"{self.global_batch_size}; change the shares or the global batch")
        layers = [pipe.num_layers for pipe in self.pipelines]
        for index, count in enumerate(layers):
            if count != layers[0]:
                raise ConfigError(f"pipeline {index} holds {count} layers but pipeline 0 holds "
                                  f"{layers[0]}; every pipeline holds every layer of the model "
                                  "exactly once")
        object.__setattr__(self, "pipelines", tuple(stored))

    def _check_pipeline(self, index: int, pipe: HeteroPlan) -> None:
        """Pipeline ``index`` shares this plan's micro-batch size, chips and transports."""
        if pipe.micro_batch_size != self.micro_batch_size:
            raise ConfigError(f"pipeline {index} has micro_batch_size {pipe.micro_batch_size} "
                              f"but the plan {self.micro_batch_size}; every pipeline uses the "
                              "plan's micro-batch size")
        for stage in pipe.stages:
            if stage.chip not in self.chips:
                raise ConfigError(f"pipeline {index} uses unknown chip '{stage.chip}'"
                                  f"{closest(stage.chip, list(self.chips))}; known chips: "
                                  f"{', '.join(self.chips)}")
            if pipe.chips[stage.chip] != self.chips[stage.chip]:
                raise ConfigError(f"pipeline {index} describes chip '{stage.chip}' otherwise "
                                  "than the plan; one chip name has one description")
        for link in pipe.transports:
            if self.transport_between(*link.chips) != link.transport:
                raise ConfigError(f"pipeline {index} carries {' / '.join(link.chips)} over "
                                  f"{link.transport} but the plan over "
                                  f"{self.transport_between(*link.chips)}; list it once")

    @classmethod
    def of_pipelines(cls, pipelines: Sequence[HeteroPlan]) -> HeteroPlan:
        """The plan of data-parallel ``pipelines`` (plans of one pipeline, each with its share
        of the global batch as ``global_batch_size``), their chips and transports merged; one
        pipeline is returned as it is."""
        pipes = list(pipelines)
        if not pipes:
            raise ConfigError("of_pipelines needs at least one pipeline")
        if len(pipes) == 1:
            return pipes[0]
        chips: dict[str, ChipSpec] = {}
        links: dict[frozenset[str], LinkSpec] = {}
        for pipe in pipes:
            for stage in pipe.stages:
                chips.setdefault(stage.chip, pipe.chips[stage.chip])
            for link in pipe.transports:
                links.setdefault(frozenset(link.chips), link)
        return cls(data_parallel_size=1, micro_batch_size=pipes[0].micro_batch_size,
                   global_batch_size=sum(p.global_batch_size for p in pipes), chips=chips,
                   stages=(), transports=tuple(links.values()), pipelines=pipes)

    def _check_transports(self) -> None:
        seen: set[frozenset[str]] = set()
        for link in self.transports:
            if not isinstance(link, LinkSpec):
                raise ConfigError(f"transports entries must be LinkSpec, got {type(link).__name__}")
            for chip in link.chips:
                if chip not in self.chips:
                    raise ConfigError(f"transports names unknown chip '{chip}'"
                                      f"{closest(chip, list(self.chips))}; known chips: "
                                      f"{', '.join(self.chips)}")
            pair = frozenset(link.chips)
            if pair in seen:
                raise ConfigError(f"transports lists the chip pair {' / '.join(link.chips)} "
                                  "twice; keep one entry")
            seen.add(pair)

    def transport_between(self, chip_a: str, chip_b: str) -> str:
        """The bridge's transport between two chip types (``gloo`` unless the plan says)."""
        for link in self.transports:
            if frozenset(link.chips) == frozenset((chip_a, chip_b)):
                return link.transport
        return "gloo"

    def _check_chunks(self) -> None:
        counts = {len(stage.chunks) for stage in self.stages}
        if len(counts) > 1:
            per_stage = ", ".join(str(len(stage.chunks)) for stage in self.stages)
            raise ConfigError(f"every stage needs the same number of model chunks, got {per_stage};"
                              " give each stage's num_layers as a list of the same length")
        v, last = counts.pop(), len(self.stages) - 1
        if v == 1:
            return
        for index, stage in enumerate(self.stages):
            for chunk, count in enumerate(stage.chunks):
                edge = (index, chunk) in ((0, 0), (last, v - 1))
                if count == 0 and not edge:
                    raise ConfigError(
                        f"chunk {chunk} of stage {index} has no layer; only the first chunk of "
                        "the first stage and the last chunk of the last stage may be empty")

    def _check_batch(self) -> None:
        """The global batch splits into whole micro-batches for every DP replica of every stage
        (replica ``r`` of a stage of DP ``d`` runs micro-batches ``j`` with ``j mod d == r``)."""
        for index, stage in enumerate(self.stages):
            if not isinstance(stage, StageSpec):
                continue  # reported by _check_stages
            dp = self.stage_dp(index)
            per_step = self.micro_batch_size * dp
            if self.global_batch_size % per_step:
                whose = (f"stage {index}'s data_parallel_size {dp}"
                         if stage.data_parallel_size is not None else "data_parallel_size")
                raise ConfigError(
                    f"global_batch_size {self.global_batch_size} is not divisible by "
                    f"micro_batch_size x {whose} = {per_step}; change one of them")

    def _check_stages(self) -> None:
        last = len(self.stages) - 1
        for index, stage in enumerate(self.stages):
            if not isinstance(stage, StageSpec):
                raise ConfigError(f"stage {index} must be a StageSpec, got {type(stage).__name__}")
            if stage.chip not in self.chips:
                raise ConfigError(
                    f"stage {index} uses unknown chip '{stage.chip}'"
                    f"{closest(stage.chip, list(self.chips))};"
                    f" known chips: {', '.join(self.chips)}"
                )
            try:
                stage.check_experts(self.stage_dp(index))
            except ConfigError as exc:
                raise ConfigError(f"stage {index}: {exc}") from None
            if stage.num_layers == 0 and 0 < index < last:
                raise ConfigError(
                    f"stage {index} has no layer and holds neither the embedding (first stage) nor"
                    " the head (last stage); give it at least one layer or remove it"
                )

    def __hash__(self) -> int:
        return hash((self.data_parallel_size, self.micro_batch_size, self.global_batch_size,
                     tuple(sorted(self.chips.items())), tuple(self.stages), self.schedule,
                     tuple(self.transports), tuple(self.pipelines), self.first_rank))

    def _one_pipeline(self, what: str) -> None:
        """Raise where ``what`` belongs to one pipeline and this plan has several."""
        if self.pipelines:
            raise ConfigError(f"{what} belongs to one pipeline and this plan has "
                              f"{len(self.pipelines)}; ask plan.pipelines[k]")

    # ------------------------------------------------------------------------------ pipelines
    @property
    def pipeline_plans(self) -> tuple[HeteroPlan, ...]:
        """Every data-parallel pipeline as a plan of one pipeline (this plan if it is one)."""
        return self.pipelines or (self,)

    @property
    def num_pipelines(self) -> int:
        """Number of data-parallel pipelines (1 for a plain plan)."""
        return len(self.pipeline_plans)

    def pipeline_of_rank(self, rank: int) -> int:
        """Index of the pipeline that owns global ``rank``."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank!r} is out of range 0..{self.world_size - 1}")
        for index, pipe in enumerate(self.pipeline_plans):
            if rank < pipe.first_rank + pipe.world_size:
                return index
        raise AssertionError("unreachable: rank inside world size but in no pipeline")

    def rank_chip(self, rank: int) -> str:
        """Name of the chip type that runs global ``rank``."""
        pipe = self.pipeline_plans[self.pipeline_of_rank(rank)]
        return pipe.stages[pipe.rank_coordinates(rank)[0]].chip

    def chips_in_use(self) -> dict[str, int]:
        """Chips of each type the plan runs on, over every pipeline (chips are never shared)."""
        used: dict[str, int] = {}
        for pipe in self.pipeline_plans:
            for index, stage in enumerate(pipe.stages):
                used[stage.chip] = used.get(stage.chip, 0) + len(pipe.stage_ranks(index))
        return used

    def check_fits(self, available: Mapping[str, int], where: str) -> None:
        """Raise a one-line ConfigError when the plan needs more chips of a type than
        ``available`` (chip name -> count) holds; ``where`` names the cluster. Pipelines never
        share chips, so their needs add up."""
        for chip, used in self.chips_in_use().items():
            have = available.get(chip, 0)
            if used <= have:
                continue
            split = ""
            if self.pipelines:
                each = [sum(len(p.stage_ranks(s)) for s, st in enumerate(p.stages)
                            if st.chip == chip) for p in self.pipelines]
                split = (" (" + ", ".join(f"pipeline {k}: {n}" for k, n in enumerate(each) if n)
                         + "; pipelines never share chips)")
            raise ConfigError(f"the plan needs {used} '{chip}' chips{split} but {where} has "
                              f"{have}; use fewer or give the cluster more")

    def pipeline_samples(self, pipeline: int) -> range:
        """Positions (sequences) of the global batch that ``pipeline`` runs: its share, after
        those of the pipelines before it."""
        plans = self.pipeline_plans
        if not 0 <= pipeline < len(plans):
            raise ConfigError(f"pipeline index {pipeline!r} is out of range 0..{len(plans) - 1}")
        start = sum(p.global_batch_size for p in plans[:pipeline])
        return range(start, start + plans[pipeline].global_batch_size)

    # ----------------------------------------------------------------------------- derived sizes
    @property
    def pipeline_parallel_size(self) -> int:
        """Number of pipeline stages."""
        self._one_pipeline("pipeline_parallel_size")
        return len(self.stages)

    def stage_dp(self, stage: int) -> int:
        """Data-parallel degree of ``stage`` (its own ``data_parallel_size``, else the plan's)."""
        self._one_pipeline("stage_dp")
        own = self.stages[stage].data_parallel_size
        return self.data_parallel_size if own is None else own

    @property
    def uniform_dp(self) -> bool:
        """Whether every stage has the plan's DP degree."""
        self._one_pipeline("uniform_dp")
        return all(self.stage_dp(s) == self.data_parallel_size for s in range(len(self.stages)))

    @property
    def total_micro_batches(self) -> int:
        """Micro-batches per step over the whole global batch: global batch / micro batch."""
        return self.global_batch_size // self.micro_batch_size

    def stage_micro_batches(self, stage: int) -> int:
        """Micro-batches per step that each DP replica of ``stage`` runs (replica ``r`` runs
        the micro-batches ``j`` with ``j mod DP_stage == r``)."""
        return self.total_micro_batches // self.stage_dp(stage)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step and DP replica: global batch / (micro batch x DP); with
        per-stage DP degrees see :meth:`stage_micro_batches`."""
        if not self.uniform_dp:
            raise ConfigError("the stages have different data_parallel_size: ask "
                              "stage_micro_batches(stage) for a stage's micro-batches")
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def num_layers(self) -> int:
        """Total transformer layers over all stages (of each pipeline: they hold the same)."""
        if self.pipelines:
            return self.pipelines[0].num_layers
        return sum(stage.num_layers for stage in self.stages)

    @property
    def virtual_pipeline_size(self) -> int:
        """Model chunks per stage (V; 1 without interleaving)."""
        self._one_pipeline("virtual_pipeline_size")
        return len(self.stages[0].chunks)

    @property
    def world_size(self) -> int:
        """Ranks the plan needs: sum over stages of TP x DP (each stage's own DP), over every
        pipeline."""
        if self.pipelines:
            return sum(pipe.world_size for pipe in self.pipelines)
        return sum(stage.tensor_parallel_size * self.stage_dp(index)
                   for index, stage in enumerate(self.stages))

    def stage_ranks(self, stage: int) -> range:
        """Global ranks of ``stage``: ``tensor_parallel_size x data_parallel_size`` in a row,
        from ``first_rank`` on."""
        self._one_pipeline("stage_ranks")
        if (
            isinstance(stage, bool)
            or not isinstance(stage, int)
            or not 0 <= stage < len(self.stages)
        ):
            raise ConfigError(f"stage index {stage!r} is out of range 0..{len(self.stages) - 1}")
        start = self.first_rank + sum(s.tensor_parallel_size * self.stage_dp(i)
                                      for i, s in enumerate(self.stages[:stage]))
        ranks = self.stages[stage].tensor_parallel_size * self.stage_dp(stage)
        return range(start, start + ranks)

    def rank_coordinates(self, rank: int) -> tuple[int, int, int]:
        """Return ``(stage, dp_rank, tp_rank)`` of a global rank (see the rank layout above)."""
        self._one_pipeline("rank_coordinates")
        first, last = self.first_rank, self.first_rank + self.world_size - 1
        if isinstance(rank, bool) or not isinstance(rank, int) or not first <= rank <= last:
            raise ConfigError(f"rank {rank!r} is out of range {first}..{last}")
        for index in range(len(self.stages)):
            ranks = self.stage_ranks(index)
            if rank in ranks:
                tp = self.stages[index].tensor_parallel_size
                offset = rank - ranks.start
                return index, offset // tp, offset % tp
        raise AssertionError("unreachable: rank inside world size but in no stage")

    def chunk_layer_ranges(self) -> list[list[range]]:
        """``[stage][chunk]``: the global layers of every model chunk, numbered chunk-major
        (chunk 0 of every stage in pipeline order, then chunk 1, ...)."""
        self._one_pipeline("chunk_layer_ranges")
        out: list[list[range]] = [[] for _ in self.stages]
        start = 0
        for chunk in range(self.virtual_pipeline_size):
            for index, stage in enumerate(self.stages):
                out[index].append(range(start, start + stage.chunks[chunk]))
                start += stage.chunks[chunk]
        return out

    def layer_ranges(self) -> list[range]:
        """Global (0-based) layer indices run by each stage, in pipeline order (one chunk per
        stage; see :meth:`chunk_layer_ranges` for interleaved plans)."""
        self._one_pipeline("layer_ranges")
        if self.virtual_pipeline_size > 1:
            raise ConfigError("an interleaved plan's stages hold several layer ranges; use "
                              "chunk_layer_ranges()")
        ranges, start = [], 0
        for stage in self.stages:
            ranges.append(range(start, start + stage.num_layers))
            start += stage.num_layers
        return ranges

    def validate(
        self,
        num_layers: int,
        num_attention_heads: int,
        num_query_groups: int | None = None,
        world_size: int | None = None,
        num_experts: int | None = None,
    ) -> None:
        """Check the plan against the model flags (and the launched world size if given).

        Raises ConfigError when the stage layers do not add up to ``num_layers``, when a stage's
        TP degree does not divide the attention heads or the query groups, when a stage's
        ``expert_model_parallel_size`` does not divide ``num_experts`` (MoE models; a dense
        model, ``None``, needs EP 1), or when ``world_size`` differs from :attr:`world_size`.
        ``num_query_groups`` defaults to the number of heads.
        """
        positive_int(num_layers, "num_layers")
        positive_int(num_attention_heads, "num_attention_heads")
        groups = num_attention_heads if num_query_groups is None else num_query_groups
        positive_int(groups, "num_query_groups")
        for index, pipe in enumerate(self.pipelines):
            try:
                pipe.validate(num_layers, num_attention_heads, groups, num_experts=num_experts)
            except ConfigError as exc:
                raise ConfigError(f"pipeline {index}: {exc}") from None
        if not self.pipelines:
            self._validate_stages(num_layers, num_attention_heads, groups, num_experts)
        if world_size is not None and world_size != self.world_size:
            raise ConfigError(
                f"the plan needs world size {self.world_size} (sum of TP x DP over stages"
                f"{' and pipelines' if self.pipelines else ''}) but {world_size} processes were "
                f"launched; launch {self.world_size}"
            )

    def _validate_stages(self, num_layers: int, num_attention_heads: int, groups: int,
                         num_experts: int | None) -> None:
        if self.num_layers != num_layers:
            split = "+".join(str(stage.num_layers) for stage in self.stages)
            raise ConfigError(
                f"plan stages hold {split} = {self.num_layers} layers but the model has"
                f" {num_layers}; make the stage num_layers add up to {num_layers}"
            )
        for index, stage in enumerate(self.stages):
            self._validate_experts(index, num_experts)
            tp = stage.tensor_parallel_size
            for count, name in ((num_attention_heads, "attention heads"), (groups, "query groups")):
                if count % tp:
                    raise ConfigError(
                        f"stage {index} tensor_parallel_size {tp} does not divide the"
                        f" {count} {name};"
                        " pick a TP degree that divides both heads and query groups"
                    )

    def _validate_experts(self, index: int, num_experts: int | None) -> None:
        try:
            self.stages[index].check_experts(self.stage_dp(index), num_experts, validate=True)
        except ConfigError as exc:
            raise ConfigError(f"stage {index}: {exc}") from None

    # ------------------------------------------------------------------------------- conversion
    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> HeteroPlan:
        """Build a plan from the YAML-shaped mapping; ``source`` names it in error messages."""
        from megatron_h2.plan.plan_file import plan_from_dict

        return plan_from_dict(data, source)

    @classmethod
    def from_yaml(cls, path: str | Path) -> HeteroPlan:
        """Read and check a plan file (see the module docstring for the schema)."""
        return cls.from_dict(load_yaml_mapping(path, "plan"), source=f"plan '{path}'")

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-ready mapping; ``emulate_slowdown`` is written only when it is not 1.0."""
        from megatron_h2.plan.plan_file import plan_to_dict

        return plan_to_dict(self)

    def to_yaml(self, path: str | Path, header: str | None = None) -> None:
        """Write the plan; ``header`` lines (e.g. the planner's prediction) become YAML comments."""
        from megatron_h2.plan.plan_file import write_plan

        write_plan(self, path, header)
