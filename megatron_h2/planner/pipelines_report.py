"""One pipeline for all or several data-parallel pipelines: the choice and what the planner prints
about it (the table of pipelines, the "why" lines, the comparison with each chip type alone)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_h2.planner.compare import Comparison
from megatron_h2.planner.pipelines_cost import PipelinesSimulation
from megatron_h2.planner.pipelines_search import PipelinesCandidate, PipelinesResult
from megatron_h2.planner.report import _table, dp_label, micro_batch_label, stage_summary
from megatron_h2.planner.search import SearchResult
from megatron_h2.planner.simulator import schedule_label


@dataclass(frozen=True)
class Choice:
    """The one-pipeline search's result and the pipelines search's; the faster is chosen."""

    one: SearchResult
    pipelines: PipelinesResult | None

    @property
    def multi(self) -> PipelinesCandidate | None:
        """The plan of pipelines when it is faster than the best plan of one pipeline."""
        found = self.pipelines.best if self.pipelines else None
        if found is None or found.estimate.step_time_s >= self.one.best.estimate.step_time_s:
            return None
        return found

    @property
    def tokens_per_s(self) -> float:
        """Predicted throughput of the chosen plan."""
        multi = self.multi
        return multi.estimate.tokens_per_s if multi else self.one.best.estimate.tokens_per_s


def groups_label(candidate: PipelinesCandidate) -> str:
    """``[A] + [B, C]``: the chip types of each pipeline."""
    return " + ".join("[" + ", ".join(group) + "]" for group in candidate.groups)


def pipelines_table(candidate: PipelinesCandidate, simulation: PipelinesSimulation | None
                    ) -> str:
    """One row per pipeline: its share, shape, own step (formula and simulation), exchange."""
    est = candidate.estimate
    header = ["pipeline", "chips", "share", "DP", "m", "schedule", "step s", "sim s",
              "exchange s", "stages"]
    rows = []
    for k, (pipe, own) in enumerate(zip(candidate.plan.pipelines, est.pipelines)):
        sim = f"{simulation.pipelines[k].step_time_s:.3f}" if simulation else "-"
        rows.append([str(k), str(pipe.world_size), str(pipe.global_batch_size), dp_label(pipe),
                     micro_batch_label(pipe), schedule_label(pipe), f"{own.step_time_s:.3f}",
                     sim, f"{max(est.stage_exchange_s[k]):.3f}", stage_summary(pipe)])
    return _table(header, rows)


def pipelines_why(choice: Choice, simulation: PipelinesSimulation | None = None) -> list[str]:
    """The "why" lines about data-parallel pipelines: what was searched, what it gave against
    one pipeline for all, and for a chosen plan of pipelines what sets its step."""
    result = choice.pipelines
    if result is None:
        return ["data-parallel pipelines: not searched (--data-parallel-pipelines none)"]
    space = search_text(result) + f"; {bound_text(choice)}"
    if result.best is None:
        if not result.splits_tried:
            return [f"data-parallel pipelines: none ({result.reason}); {bound_text(choice)}"]
        return [f"data-parallel pipelines: none ({result.reason}); {space}"]
    found, one = result.best, choice.one.best.estimate.step_time_s
    step = found.estimate.step_time_s
    shares = "/".join(str(p.global_batch_size) for p in found.plan.pipelines)
    lines = []
    if choice.multi is None:
        lines.append(f"data-parallel pipelines: the best, {groups_label(found)} with batch "
                     f"shares {shares}, takes {step:.3f} s ({100 * (step / one - 1):+.1f}% vs "
                     f"one pipeline for all): not chosen; {space}")
        return lines
    est = found.estimate
    slow = est.slowest
    lines.append(f"data-parallel pipelines {groups_label(found)}, batch shares {shares} "
                 f"(sequences per step, whole micro-batches): {step:.3f} s against "
                 f"{one:.3f} s for one pipeline for all ({100 * (1 - step / one):.1f}% faster)")
    lines.append(f"slowest pipeline: {slow} ({est.pipelines[slow].step_time_s:.3f} s); the "
                 f"gradient exchange across pipelines adds {est.exchange_s:.3f} s (each rank's "
                 "fp32 gradient shard to and from every other pipeline, through the bridge "
                 "where chip types differ)")
    if simulation is not None:
        gap = 100 * (simulation.step_time_s / step - 1)
        lines.append(f"event simulation of every pipeline + exchange: "
                     f"{simulation.step_time_s:.3f} s ({gap:+.1f}% vs the formula)")
    lines.append(f"searched: {space}")
    return lines


def search_text(result: PipelinesResult) -> str:
    """What the pipelines search covered: groupings, splits (and those cut off), searches."""
    cut = (f" ({result.splits_cut} cut off: a pipeline proven too slow to beat the plan to "
           "beat, the exchange's least added)" if result.splits_cut else "")
    return (f"{result.groupings} groupings of the chip types, {result.splits_tried} batch "
            f"splits{cut}, {result.searches} pipeline searches in {result.elapsed_s:.1f} s; "
            + ("every split tried and every pipeline's search exhaustive (each pipeline gets "
               "its fastest plan alone; the exchange is then added)" if result.exhaustive else
               "splits searched locally or a time limit hit"))


def bound_text(choice: Choice) -> str:
    """What is proven of the chosen plan against every plan of data-parallel pipelines."""
    result = choice.pipelines
    assert result is not None
    bound = result.lower_bound_s
    chosen = choice.multi
    step = chosen.estimate.step_time_s if chosen else choice.one.best.estimate.step_time_s
    if bound >= step * (1 - 1e-9):
        return "proven: no plan of data-parallel pipelines is faster than the plan chosen"
    how = ("the least over every split of its slowest pipeline's step and the exchange's least"
           if result.bound_by_splits else "every micro-batch's passes at the chips' summed rate")
    return (f"no plan of data-parallel pipelines takes under {bound:.3f} s ({how}): the plan "
            f"chosen is proven within {100 * (step / bound - 1):.1f}% of every one")


def comparison_pipelines_line(comparison: Comparison, choice: Choice) -> str:
    """Under ``--compare-homogeneous``: the ratio of one pipeline for all and of the plan of
    pipelines, each over the sum of the chip types alone."""
    total = comparison.homogeneous_sum
    one = choice.one.best.estimate.tokens_per_s
    parts = [f"one pipeline for all {one:,.0f} tokens/s"
             + (f" (ratio {one / total:.3f})" if total > 0 else "")]
    found = choice.pipelines.best if choice.pipelines else None
    if found is not None:
        multi = found.estimate.tokens_per_s
        parts.append(f"data-parallel pipelines {groups_label(found)} {multi:,.0f} tokens/s"
                     + (f" (ratio {multi / total:.3f})" if total > 0 else ""))
    chosen = "data-parallel pipelines" if choice.multi else "one pipeline"
    return "; ".join(parts) + f"; the plan written: {chosen}"
