"""Text the planner prints: the table of best plans, the chosen plan in detail, and why."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner.alternatives import Alternative
from megatron_h2.planner.cluster import Cluster
from megatron_h2.planner.compare import Comparison, type_roles
from megatron_h2.planner.cost_model import PlanEstimate, zero_bubble_share
from megatron_h2.planner.search import Candidate, SearchResult
from megatron_h2.planner.simulator import SimulationResult, schedule_label

GIB = 2**30


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(header, widths))]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _runs(values: list[int]) -> str:
    """Compress layer counts: [6, 6, 6, 5] -> '6x3,5'."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        out.append(f"{values[i]}x{j - i + 1}" if j > i else str(values[i]))
        i = j + 1
    return ",".join(out)


def _blocks(plan: HeteroPlan) -> list[tuple[str, int, int, int, list[int], list[str]]]:
    """Runs of stages of one chip type, TP, DP and EP degree: (chip, TP, DP, EP, layers,
    recompute)."""
    blocks: list[tuple[str, int, int, int, list[int], list[str]]] = []
    for index, stage in enumerate(plan.stages):
        key = (stage.chip, stage.tensor_parallel_size, plan.stage_dp(index),
               stage.expert_model_parallel_size)
        if blocks and blocks[-1][:4] == key:
            blocks[-1][4].append(stage.num_layers)
            blocks[-1][5].append(stage.recompute)
        else:
            blocks.append((*key, [stage.num_layers], [stage.recompute]))
    return blocks


def stage_summary(plan: HeteroPlan) -> str:
    """Blocks of stages, e.g. ``H100 TP2 x8 [6x8] | MI250X TP4 x4 [4x4 sel]``; with per-stage
    DP degrees each block names its own, e.g. ``H100 TP2 DP32 x4 [...]``; expert parallelism
    above 1 shows as ``EP8``."""
    parts = []
    for chip, tp, dp, ep, layers, modes in _blocks(plan):
        used = sorted({m for m in modes if m != "none"})
        extra = (" " + "/".join(m[:3] for m in used)) if used else ""
        own = "" if plan.uniform_dp else f" DP{dp}"
        own += f" EP{ep}" if ep > 1 else ""
        parts.append(f"{chip} TP{tp}{own} x{len(layers)} [{_runs(layers)}{extra}]")
    return " | ".join(parts)


def dp_label(plan: HeteroPlan) -> str:
    """``16``, or with per-stage DP degrees each block's, front to back: ``32/16/8``."""
    if plan.uniform_dp:
        return str(plan.data_parallel_size)
    return "/".join(str(dp) for _, _, dp, _, _, _ in _blocks(plan))


def micro_batch_label(plan: HeteroPlan) -> str:
    """Micro-batches per DP replica: ``128``, or each block's: ``64/128/256``."""
    if plan.uniform_dp:
        return str(plan.num_micro_batches)
    return "/".join(str(plan.total_micro_batches // dp) for _, _, dp, _, _, _ in _blocks(plan))


def schedule_short(plan: HeteroPlan) -> str:
    """``1F1B``, ``ZB-H1`` or ``int V=2`` for tables."""
    if plan.schedule == "interleaved":
        return f"int V={plan.virtual_pipeline_size}"
    return "ZB-H1" if plan.schedule == "zero-bubble" else "1F1B"


def memory_use(estimate: PlanEstimate) -> str:
    """Peak memory over usable memory, worst stage per chip type, e.g. ``H100 91%``."""
    worst: dict[str, float] = {}
    for stage in estimate.stages:
        worst[stage.chip] = max(
            worst.get(stage.chip, 0.0), stage.memory_bytes / stage.capacity_bytes
        )
    return " ".join(f"{chip} {100 * share:.0f}%" for chip, share in worst.items())


def candidates_table(result: SearchResult) -> str:
    """The top plans, best first."""
    header = [
        "#",
        "step s",
        "tokens/s",
        "MFU",
        "DP",
        "mbs",
        "m",
        "PP",
        "schedule",
        "chips",
        "memory (peak/usable)",
        "stages",
    ]
    rows = []
    for rank, cand in enumerate(result.candidates, 1):
        plan, est = cand.plan, cand.estimate
        rows.append(
            [
                str(rank),
                f"{est.step_time_s:.3f}",
                f"{est.tokens_per_s:,.0f}",
                f"{100 * est.mfu:.1f}%",
                dp_label(plan),
                str(plan.micro_batch_size),
                micro_batch_label(plan),
                str(plan.pipeline_parallel_size),
                schedule_short(plan),
                str(plan.world_size),
                memory_use(est),
                stage_summary(plan),
            ]
        )
    return _table(header, rows)


def plan_detail(candidate: Candidate, simulation: SimulationResult | None) -> str:
    """One row per stage of a plan, with the simulated utilisation when given.

    ``layers`` lists the chunks (``3+3``) under interleaving; ``in flight`` counts the
    (chunk-)micro-batches whose activations the stage holds at its peak, ``W held`` (zero-bubble)
    those whose weight-gradient inputs it holds for deferred work.
    """
    plan, est = candidate.plan, candidate.estimate
    small = min(stage.capacity_bytes for stage in est.stages) < 4 * GIB
    unit, scale = ("MiB", 2**20) if small else ("GiB", GIB)
    split = plan.schedule == "zero-bubble"
    experts = any(s.expert_model_parallel_size > 1 for s in plan.stages)
    header = ["stage", "chip", "TP", "DP"] + (["EP"] if experts else [])
    header += ["ranks", "layers", "recompute", "in flight"]
    header += ["W held"] if split else []
    header += ["F+B ms", "sync ms", f"peak {unit}", f"usable {unit}", "busy"]
    rows = []
    for index, stage in enumerate(est.stages):
        ranks = plan.stage_ranks(index)
        busy = f"{100 * simulation.utilization[index]:.0f}%" if simulation else "-"
        row = [
            str(index),
            stage.chip,
            str(stage.tensor_parallel_size),
            str(plan.stage_dp(index)),
            *([str(plan.stages[index].expert_model_parallel_size)] if experts else []),
            f"{ranks.start}-{ranks.stop - 1}",
            "+".join(str(n) for n in plan.stages[index].chunks),
            stage.recompute,
            str(stage.in_flight),
        ]
        row += [str(stage.deferred)] if split else []
        row += [
            f"{1e3 * stage.work_s:.1f}",
            f"{1e3 * stage.dp_sync_s:.1f}",
            f"{stage.memory_bytes / scale:.1f}",
            f"{stage.capacity_bytes / scale:.1f}",
            busy,
        ]
        rows.append(row)
    return _table(header, rows)


def explain(
    candidate: Candidate,
    simulation: SimulationResult | None,
    cluster: Cluster,
    alternatives: Sequence[Alternative] = (),
) -> list[str]:
    """Plain-language reasons: the schedule and what it saves, what bounds the step time, what
    memory forced, what is unused, and the same stages under the other schedules."""
    plan, est = candidate.plan, candidate.estimate
    p, v = plan.pipeline_parallel_size, plan.virtual_pipeline_size
    k = est.bottleneck
    slow, m = est.stages[k], est.micro_batches(k)
    work = sum(s.work_s for s in est.stages)
    steady = (m - 1 / v) * slow.work_s if plan.schedule == "interleaved" else (m - 1) * slow.work_s
    replicas = "" if plan.uniform_dp else f" on each of its {plan.stage_dp(k)} DP replicas"
    lines = [
        f"schedule: {schedule_label(plan)}; slowest stage: {k} ({slow.chip},"
        f" TP{slow.tensor_parallel_size}, {slow.num_layers} layers) at"
        f" {1e3 * slow.work_s:.1f} ms per micro-batch; with {m} micro-batches{replicas} it sets"
        f" {steady:.2f} s of the {est.step_time_s:.2f} s step",
        _fill_line(plan, est, work)
        + f"; DP gradient sync: {est.dp_sync_s:.2f} s; point-to-point: {est.link_s:.3f} s",
    ]
    if simulation is not None:
        gap = 100 * (simulation.step_time_s / est.step_time_s - 1)
        lines.append(
            f"event simulation of {schedule_label(plan)}: {simulation.step_time_s:.3f} s"
            f" ({gap:+.1f}% vs the formula),"
            f" bubble {100 * simulation.bubble_fraction:.1f}% of stage time"
        )
    recomputed = [i for i, s in enumerate(est.stages) if s.recompute != "none"]
    tight = [i for i, s in enumerate(est.stages) if s.memory_bytes > 0.9 * s.capacity_bytes]
    if recomputed:
        lines.append(
            f"memory forces recompute on stages {_ranges(recomputed)} ({_held(plan, est)})"
        )
    if tight:
        lines.append(f"stages {_ranges(tight)} use over 90% of their usable memory")
    if not recomputed and not tight:
        lines.append("memory is not binding: no stage recomputes or is above 90% of its memory")
    crossings = sum(1 for a, b in zip(plan.stages, plan.stages[1:]) if a.chip != b.chip)
    if crossings:
        each = f" ({v} transfers each way per micro-batch)" if v > 1 else ""
        lines.append(
            f"{crossings} pipeline link(s) cross chip types at"
            f" {cluster.cross_chip_gb_per_s:g} GB/s{each}"
        )
    if v > 1:
        crosses = plan.stages[-1].chip != plan.stages[0].chip
        lines.append(
            f"the wrap-around link from stage {p - 1} to stage 0 carries {v - 1} transfer(s) each"
            f" way per micro-batch ({1e3 * est.wrap_link_s:.1f} ms each"
            f"{', across chip types' if crosses else ''})"
        )
    for chip in cluster.chips:
        used = est.chips_used.get(chip.name, 0)
        if used < chip.count:
            what = "unused" if used == 0 else f"{used} of {chip.count} used"
            lines.append(
                f"{chip.name}: {what} (using more would not make the step faster under this batch)"
            )
    if alternatives:
        lines.append("the same stages under each schedule: " + _alternatives(est, alternatives))
    return lines


def _fill_line(plan: HeteroPlan, est: PlanEstimate, work: float) -> str:
    """What the pipeline's fill and drain cost under the plan's schedule."""
    v, p = plan.virtual_pipeline_size, plan.pipeline_parallel_size
    if plan.schedule == "interleaved":
        return (
            f"pipeline fill and drain (sum of stage work / V): {work / v:.2f} s, 1/{v} of"
            f" 1F1B's {work:.2f} s"
        )
    if plan.schedule == "zero-bubble":
        shares = [1.0 + zero_bubble_share(p, est.micro_batches(s)) for s in range(p)]
        weight = sum(b * s.weight_grad_s for b, s in zip(shares, est.stages))
        share = f"{shares[0]:g} x" if len(set(shares)) == 1 else "(1 + b) x"
        return (
            f"pipeline fill and drain: {work - weight:.2f} s (1F1B's {work:.2f} s less"
            f" {share} the stages' weight-gradient work, which fills the bubble)"
        )
    return f"pipeline fill and drain (sum of stage work): {work:.2f} s"


def _held(plan: HeteroPlan, est: PlanEstimate) -> str:
    """What early (or all) stages keep in memory under the plan's schedule."""
    p, v = plan.pipeline_parallel_size, plan.virtual_pipeline_size
    if not plan.uniform_dp:
        most = max(range(p), key=lambda s: est.stages[s].in_flight)
        return (
            f"each DP replica runs ahead of the next stage by one micro-batch per replica of"
            f" that stage: stage {most} ({plan.stages[most].chip}, DP {plan.stage_dp(most)})"
            f" holds {est.stages[most].in_flight} micro-batches per replica"
        )
    m = plan.num_micro_batches
    if plan.schedule == "interleaved":
        first = est.stages[0].in_flight
        return (
            f"interleaving keeps more in flight: stage 0 holds {first} chunk-micro-batches,"
            f" {first / v:.1f} micro-batches' worth, against {min(p, m)} under 1F1B"
        )
    if plan.schedule == "zero-bubble":
        return (
            f"under zero-bubble every stage holds up to {min(p, m)} micro-batches: activations"
            " of p - s and the weight-gradient inputs of the deferred ones"
        )
    return f"early stages hold up to {min(p, m)} micro-batches of activations"


def _alternatives(est: PlanEstimate, alternatives: Sequence[Alternative]) -> str:
    """``1f1b 21.077 s (+6.9%); interleaved V=2-4: cannot run (...); zero-bubble ... (chosen)``:
    interleaved variants that fail for the same reason are given once."""
    parts: list[tuple[str, list[int], str]] = []  # (schedule, V values, text)
    for alt in alternatives:
        if alt.candidate is None:
            text = f"cannot run ({alt.reason})"
            if parts and parts[-1][0] == alt.schedule == "interleaved" and parts[-1][2] == text:
                parts[-1][1].append(alt.chunks)
                continue
        else:
            step = alt.candidate.estimate.step_time_s
            chosen = (alt.schedule, alt.chunks) == (est.schedule, est.virtual_pipeline_size)
            note = "chosen" if chosen else f"{100 * (step / est.step_time_s - 1):+.1f}%"
            text = f"{step:.3f} s ({note})"
        parts.append((alt.schedule, [alt.chunks], text))
    out = []
    for schedule, chunks, text in parts:
        if schedule == "interleaved":
            values = str(chunks[0]) if len(chunks) == 1 else f"{chunks[0]}-{chunks[-1]}"
            schedule = f"interleaved V={values}"
        out.append(f"{schedule}{':' if text.startswith('cannot') else ''} {text}")
    return "; ".join(out)


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start, prev = [], indices[0], indices[0]
    for cur in indices[1:] + [-2]:
        if cur == prev + 1:
            prev = cur
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cur
    return ", ".join(out)


def search_summary(result: SearchResult) -> str:
    """How much was searched, over which plan space, and whether the best plan is proven
    optimal there (else its proven gap there)."""
    s = result.stats
    line = (
        f"searched {s.batch_shapes} (micro-batch, DP, schedule) shapes"
        f" ({s.batch_shapes_pruned} pruned whole),"
        f" {s.nodes:,} pipeline prefixes ({s.nodes_pruned:,} options pruned by bound),"
        f" {s.splits_solved:,} layer splits in {s.elapsed_s:.1f} s"
    )
    if s.own_dp in ("derived", "all"):
        line += f"; own DP per type: re-splits of {s.own_dp_seeds} of the best one-DP plans"
        line += ", then every own-DP plan" if s.own_dp == "all" else ", the rest bounded"
        if s.one_dp_resumed:
            line += " (the one-DP search paused for them near the time limit and went on)"
    line += f"; space: {s.space}"
    if result.gap == 0.0:
        return line + "; the best plan is optimal for the cost model over this space"
    why = "time limit hit" if not s.exhaustive else "own-DP plans bounded, not searched"
    return (
        line + f"; {why}: the best plan is within {100 * result.gap:.1f}% of the optimum over"
        " this space (proven bound)"
    )


def comparison_text(comparison: Comparison) -> str:
    """The superlinear analysis as a small table and a verdict."""
    header = ["chip type", "alone: tokens/s", "plan alone"]
    rows = []
    for result in comparison.homogeneous:
        if result.candidate is None:
            rows.append([result.chip, "0", f"does not fit ({result.reason[:60]})"])
        else:
            cand = result.candidate
            rows.append(
                [
                    result.chip,
                    f"{result.tokens_per_s:,.0f}",
                    f"DP{dp_label(cand.plan)} mbs{cand.plan.micro_batch_size}"
                    f" {schedule_short(cand.plan)} {stage_summary(cand.plan)}",
                ]
            )
    rows.append(["sum", f"{comparison.homogeneous_sum:,.0f}", ""])
    rows.append(["heterogeneous", f"{comparison.heterogeneous_tokens_per_s:,.0f}", ""])
    verdict = "superlinear" if comparison.ratio > 1 else "not superlinear"
    text = (
        _table(header, rows)
        + f"\nratio heterogeneous / sum of homogeneous = {comparison.ratio:.3f} ({verdict})"
    )
    roles = type_roles(comparison)
    if roles:
        text += "\nwhy (each type's contribution = its share of the layers x the mixed tokens/s):"
        for role in roles:
            mixed = (
                f"mixed: {role.mixed}: contributes {role.contributed_tokens_per_s:,.0f} tokens/s,"
                f" {role.gain:.2f} x alone"
                if role.mixed
                else "mixed: unused"
            )
            text += f"\n  - {role.chip}: {role.bound_alone}-bound alone ({role.alone}); {mixed}"
    return text
