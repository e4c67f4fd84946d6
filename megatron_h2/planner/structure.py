"""What the search hands on from a closed pipeline structure: the exact layer split of its
stages (stage two, :func:`solve_structure`), the plan file object of a found plan
(:func:`to_plan`) and the error when nothing fits (:func:`nothing_fits`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec
from megatron_h2.planner.bounds import BatchShape, Kind
from megatron_h2.planner.cost_model import MODES, CostModel
from megatron_h2.planner.held_activations import held_states
from megatron_h2.planner.partition import INF, Split, StageSlot, solve_split
from megatron_h2.planner.partition_ranges import RangeSlot, solve_range_split

__all__ = ["Found", "Suffix", "mixed_layers", "nothing_fits", "solve_structure", "to_plan"]

Suffix = tuple[tuple[int, int], ...]
"""Blocks of a pipeline (kind index, stages), from the front."""


@dataclass(frozen=True)
class Found:
    """A plan the search found: its step time, batch shape, blocks (kind index, stages) in
    pipeline order, layer split and the kinds the indices refer to."""

    value: float
    micro_batch_size: int
    schedule: str
    chunks: int
    blocks: tuple[tuple[int, int], ...]  # (kind index, stages), pipeline order
    split: Split
    kinds: tuple[Kind, ...] = field(compare=False)


def mixed_layers(cost: CostModel) -> bool:
    """Whether the model has both dense and MoE layers (``--moe-layer-freq``): its splits are
    then solved over layer ranges (:mod:`.partition_ranges`), one model chunk per stage."""
    return len(set(cost.layer_is_moe)) > 1


def solve_structure(shape: BatchShape, suffix: Suffix, cutoff: float = INF) -> Split | None:
    """Stage two: the exact best split of a closed pipeline of ``shape`` whose blocks ``suffix``
    are (kind index, stages) in pipeline order; None if nothing fits or beats ``cutoff``."""
    if mixed_layers(shape.cost):
        return _solve_ranges(shape, suffix, cutoff)
    return _solve_counts(shape, suffix, cutoff)


def _solve_ranges(shape: BatchShape, suffix: Suffix, cutoff: float) -> Split | None:
    """Stage two for a model with dense and MoE layers (one chunk per stage)."""
    stages = [kind for kind, count in suffix for _ in range(count)]
    p, cost = len(stages), shape.cost
    warmups = shape.warmups(suffix)
    slots = []
    for i, (kind, warmup) in enumerate(zip(stages, warmups)):
        k = shape.kinds[kind]
        dense, moe = (cost.stage_costs(k.name, k.tp, shape.mbs, k.dp, k.ep, layer_kind)
                      for layer_kind in (False, True))
        states = held_states(shape.schedule, p, k.micro_batches, 1, i,
                             None if shape.uniform else warmup)
        slots.append(RangeSlot(dense, moe, i == 0, i == p - 1, states))
    names = [shape.kinds[k].name for k in stages]
    links = shape.link_factor * sum(shape.link(a, b) for a, b in zip(names, names[1:]))
    counts = [shape.kinds[k].micro_batches for k in stages]
    return solve_range_split(slots, cost.layer_is_moe, counts, links, shape.schedule, cutoff,
                             shape.range_rows)


def _solve_counts(shape: BatchShape, suffix: Suffix, cutoff: float) -> Split | None:
    """The count-based split (:func:`~megatron_h2.planner.partition.solve_split`) of the kinds'
    costs (exact when every layer is alike)."""
    stages = [kind for kind, count in suffix for _ in range(count)]
    p = len(stages)
    warmups = shape.warmups(suffix)
    slots, caps = [], []
    for i, (kind, warmup) in enumerate(zip(stages, warmups)):
        slots.append(StageSlot(shape.kinds[kind].costs, i == 0, i == p - 1))
        caps.append(shape.mode_caps(kind, p, i, warmup))
    names = [shape.kinds[k].name for k in stages]
    links = shape.link_factor * sum(shape.link(a, b) for a, b in zip(names, names[1:]))
    if shape.chunks > 1:
        links += 2.0 * (shape.chunks - 1) * shape.link(names[-1], names[0])
    layers = shape.cost.model.num_layers
    counts = [shape.kinds[k].micro_batches for k in stages]
    return solve_split(
        slots, layers, counts, links, caps, cutoff, schedule=shape.schedule, chunks=shape.chunks
    )


def to_plan(found: Found, cost: CostModel, global_batch_size: int) -> HeteroPlan:
    """Turn a search result into the plan file object (every stage names its DP degree when
    they differ)."""
    stages, index = [], 0
    chips: dict[str, ChipSpec] = {}
    v = found.chunks
    degrees = {found.kinds[kind].dp for kind, _ in found.blocks}
    for kind_index, count in found.blocks:
        kind = found.kinds[kind_index]
        chip = cost.cluster.chip(kind.name)
        chips[kind.name] = ChipSpec(chip.device, chip.emulate_slowdown)
        own = kind.dp if len(degrees) > 1 else None
        for _ in range(count):
            layers = found.split.layers[index]
            chunk_layers = (layers // v,) * v if v > 1 else ()
            mode = MODES[found.split.modes[index]]
            stages.append(StageSpec(kind.name, kind.tp, layers, mode, chunk_layers, own,
                                    expert_model_parallel_size=kind.ep))
            index += 1
    return HeteroPlan(
        found.kinds[found.blocks[0][0]].dp,
        found.micro_batch_size,
        global_batch_size,
        chips,
        stages,
        schedule=found.schedule,
    )


def nothing_fits(cost: CostModel) -> str:
    """The one-line error when no plan fits in memory at all."""
    model = cost.model
    need = model.layer_params_per_chip(1) * cost.config.bytes_per_param(1) / 2**30
    largest = max(cost.usable_bytes(chip) for chip in cost.cluster.chips) / 2**30
    return (
        f"no plan fits in memory: {model.num_layers} layers need about"
        f" {need * model.num_layers:.1f} GiB of weights and optimizer state (plus activations)"
        f" against at most {largest:.1f} GiB usable per chip; add chips, use"
        " --use-distributed-optimizer, or plan a smaller model"
    )
