"""Superlinear analysis: the heterogeneous plan against each chip type planned on its own.

H2's claim is that a mixed cluster can train faster than the sum of what each of its chip types
achieves alone, because work goes where it suits (memory-hungry early stages on chips with much
memory, compute-heavy stages on fast chips, no chip type forced into recompute or a large TP
degree just to fit). :func:`compare_homogeneous` plans every chip type alone with the same model,
global batch and search options, and reports the heterogeneous throughput over the sum of the
homogeneous ones (> 1 is superlinear).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_h2.errors import ConfigError
from megatron_h2.planner.cost_model import CostModel
from megatron_h2.planner.profile import ProfileTable
from megatron_h2.planner.search import Candidate, SearchOptions, search


@dataclass(frozen=True)
class HomogeneousResult:
    """The best plan of one chip type alone, or why there is none."""

    chip: str
    candidate: Candidate | None
    reason: str = ""

    @property
    def tokens_per_s(self) -> float:
        """Predicted throughput (0 when the model does not fit on this chip type alone)."""
        return self.candidate.estimate.tokens_per_s if self.candidate else 0.0


@dataclass(frozen=True)
class Comparison:
    """Heterogeneous throughput against the sum of the homogeneous ones."""

    heterogeneous_tokens_per_s: float
    homogeneous: tuple[HomogeneousResult, ...]
    heterogeneous: Candidate | None = None
    """The heterogeneous plan (for :func:`type_roles`), when known."""

    @property
    def homogeneous_sum(self) -> float:
        """Sum of the chip types' throughputs when each trains the model on its own."""
        return sum(result.tokens_per_s for result in self.homogeneous)

    @property
    def ratio(self) -> float:
        """Heterogeneous / sum of homogeneous (inf if no chip type fits alone)."""
        total = self.homogeneous_sum
        return self.heterogeneous_tokens_per_s / total if total > 0 else float("inf")


def compare_homogeneous(
    cost: CostModel,
    options: SearchOptions,
    heterogeneous_tokens_per_s: float,
    heterogeneous: Candidate | None = None,
) -> Comparison:
    """Plan each chip type of ``cost.cluster`` alone (same model, batch and cost settings);
    ``heterogeneous``: the mixed plan, for the per-type analysis (:func:`type_roles`)."""
    results = []
    per_type = replace(options, top_k=1, time_limit_s=max(options.time_limit_s / 4, 1.0))
    for chip in cost.cluster.chips:
        alone = CostModel(
            cost.cluster.subset([chip.name]), cost.model, cost.config, _profile_for(cost, chip.name)
        )
        try:
            found = search(alone, per_type)
        except ConfigError as exc:
            results.append(HomogeneousResult(chip.name, None, str(exc)))
            continue
        results.append(HomogeneousResult(chip.name, found.best))
    return Comparison(heterogeneous_tokens_per_s, tuple(results), heterogeneous)


@dataclass(frozen=True)
class TypeRole:
    """What bounds one chip type alone and what the mixed plan makes of it.

    ``share`` is the fraction of the model's layers the type's stages run in the mixed plan; the
    type *contributes* ``share x`` the mixed throughput (every layer costs the same FLOPs, so this
    splits the mixed tokens/s by the work each type does; the contributions sum to it, which
    makes ``gain = contributed / alone`` a decomposition of the superlinear ratio).
    """

    chip: str
    bound_alone: str
    """``memory`` (recomputes, fills a stage's memory above 90%, or does not fit at all) or
    ``compute`` (neither)."""
    alone: str
    """What its plan alone does: recompute, TP, stages, bubble."""
    mixed: str
    """What the mixed plan gives it: layers, TP, DP, recompute (empty if unused)."""
    share: float
    contributed_tokens_per_s: float
    alone_tokens_per_s: float

    @property
    def gain(self) -> float:
        """Contributed / alone throughput (inf when the type does not fit alone)."""
        if self.alone_tokens_per_s <= 0:
            return float("inf") if self.contributed_tokens_per_s > 0 else 0.0
        return self.contributed_tokens_per_s / self.alone_tokens_per_s


def _stages(count: int) -> str:
    return f"{count} stage" + ("s" if count != 1 else "")


def _recompute_text(modes: list[str]) -> str:
    used = sorted({m for m in modes if m != "none"})
    if not used:
        return "no recompute"
    counts = ", ".join(f"{m} on {modes.count(m)} of {len(modes)} stages" for m in used)
    return f"recompute {counts}"


def type_roles(comparison: Comparison) -> list[TypeRole]:
    """Per chip type: memory- or compute-bound alone, and its share of the mixed plan."""
    mixed = comparison.heterogeneous
    if mixed is None:
        return []
    plan, total_layers = mixed.plan, sum(s.num_layers for s in mixed.plan.stages)
    roles = []
    for result in comparison.homogeneous:
        if result.candidate is None:
            bound, alone = "memory", "does not fit on this type alone"
        else:
            own, est = result.candidate.plan, result.candidate.estimate
            modes = [s.recompute for s in own.stages]
            full = any(s.memory_bytes > 0.9 * s.capacity_bytes for s in est.stages)
            bound = "compute" if set(modes) == {"none"} and not full else "memory"
            tps = sorted({s.tensor_parallel_size for s in own.stages})
            peak = max(s.memory_bytes / s.capacity_bytes for s in est.stages)
            alone = (
                f"{_recompute_text(modes)}, memory up to {100 * peak:.0f}%,"
                f" TP {'/'.join(map(str, tps))},"
                f" {_stages(own.pipeline_parallel_size)}, {100 * est.bubble_fraction:.0f}% bubble,"
                f" {own.world_size} chips"
            )
        stages = [i for i, s in enumerate(plan.stages) if s.chip == result.chip]
        layers = sum(plan.stages[i].num_layers for i in stages)
        if stages:
            tps = sorted({plan.stages[i].tensor_parallel_size for i in stages})
            dps = sorted({plan.stage_dp(i) for i in stages})
            eps = sorted({plan.stages[i].expert_model_parallel_size for i in stages})
            experts = f", EP {'/'.join(map(str, eps))}" if eps != [1] else ""
            chips = sum(plan.stages[i].tensor_parallel_size * plan.stage_dp(i) for i in stages)
            text = (
                f"{layers} of {total_layers} layers on {_stages(len(stages))},"
                f" {_recompute_text([plan.stages[i].recompute for i in stages])},"
                f" TP {'/'.join(map(str, tps))}, DP {'/'.join(map(str, dps))}{experts},"
                f" {chips} chips"
            )
        else:
            text = ""
        share = layers / total_layers
        roles.append(
            TypeRole(
                result.chip,
                bound,
                alone,
                text,
                share,
                share * comparison.heterogeneous_tokens_per_s,
                result.tokens_per_s,
            )
        )
    return roles


def _profile_for(cost: CostModel, chip: str) -> ProfileTable | None:
    """The profile table restricted to one chip type (so that it passes the name check)."""
    if cost.profile is None:
        return None
    kept = {name: value for name, value in cost.profile.chips.items() if name == chip}
    return replace(cost.profile, chips=kept)
