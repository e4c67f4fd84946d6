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
    cost: CostModel, options: SearchOptions, heterogeneous_tokens_per_s: float
) -> Comparison:
    """Plan each chip type of ``cost.cluster`` alone (same model, batch and cost settings)."""
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
    return Comparison(heterogeneous_tokens_per_s, tuple(results))


def _profile_for(cost: CostModel, chip: str) -> ProfileTable | None:
    """The profile table restricted to one chip type (so that it passes the name check)."""
    if cost.profile is None:
        return None
    kept = {name: value for name, value in cost.profile.chips.items() if name == chip}
    return replace(cost.profile, chips=kept)
