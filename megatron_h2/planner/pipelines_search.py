"""Search over plans of several data-parallel pipelines: how to group the chip types into
pipelines and how to split the global batch among them.

A plan of pipelines (:mod:`megatron_h2.plan.schema`) gives each group of chip types its own
pipeline (its own stages, TP, DP, layer split, recompute and schedule) and its own share of the
global batch in whole micro-batches of the one micro-batch size they share; the step is the
slowest pipeline's plus the cross-pipeline gradient exchange (:mod:`.pipelines_cost`).

What is searched, for each micro-batch size ``b`` of the options (``M = global batch / b``
micro-batches):

* groupings: every partition of the chip types into two or more groups when there are at most
  :data:`ALL_GROUPINGS_UP_TO` types (one pipeline per type, mixes); beyond that, one pipeline
  per type and each type apart from all the others (``n + 1`` groupings). One pipeline for all
  is the one-pipeline search (:func:`~megatron_h2.planner.search.search`), which the caller
  compares with;
* batch splits: each pipeline gets ``n_k >= 1`` micro-batches, ``sum n_k = M``. When a
  grouping has at most :data:`EXHAUSTIVE_SPLITS` splits, every one is tried; otherwise, in
  units of ``u`` micro-batches (:func:`split_units`: powers of two, coarse to fine, so that the
  pipelines' DP degrees can divide their shares), the split proportional to each group's peak
  speed, then proportional to the throughput each pipeline reached, then one unit at a time
  moved from the slowest pipeline to the one that gives the best step while the step improves
  (a local search; a first split cut off by the step to beat walks away from the pipeline
  proven too slow, :meth:`_Runner._walk`);
* each pipeline's own plan for its share: the one-pipeline search on its chip types alone
  (cached per group and share), so whatever that search covers (schedules, own DP per type,
  recompute, for MoE models EP per stage) each pipeline gets;
* the step to beat (``incumbent_s``, the best one-pipeline step, or the best plan of pipelines
  found): each pipeline of a split is searched with the cutoff ``step to beat - the exchange's
  least`` (:func:`~megatron_h2.planner.pipelines_cost.exchange_floor_s`), the most loaded
  first; a pipeline proven unable to go under it cuts the split off (every plan of the split
  takes at least the step to beat), the other pipelines unsearched.

The result is proven optimal over this space only when every split was tried (or cut off) and
every pipeline's search was exhaustive (:attr:`PipelinesResult.exhaustive`). Otherwise
:func:`lower_bound_s` bounds every plan of the cluster, of one pipeline or several, from below
(:attr:`PipelinesResult.lower_bound_s`), so a plan can be proven within a gap of any of them
without trying every split.

The search runs within what is left of the one time limit (``time_limit_s``; the planner gives
it what the one-pipeline search left); with nothing left it searches nothing and says so.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner.cost_model import CostModel
from megatron_h2.planner.pipelines_cost import (
    PipelinesEstimate,
    evaluate_pipelines,
    exchange_floor_s,
)
from megatron_h2.planner.search import Candidate, SearchOptions, search

ALL_GROUPINGS_UP_TO = 4
"""Chip types up to which every partition into groups is searched (Bell(4) - 1 = 14)."""
EXHAUSTIVE_SPLITS = 64
"""A grouping with at most this many batch splits has every split tried."""

Grouping = tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class PipelinesCandidate:
    """A plan of several pipelines with its estimate and the chip types of each pipeline."""

    plan: HeteroPlan
    estimate: PipelinesEstimate
    groups: Grouping


@dataclass
class PipelinesResult:
    """The best plan of pipelines found (None when none fits) and how the search went."""

    best: PipelinesCandidate | None
    groupings: int = 0
    searches: int = 0
    """One-pipeline searches run (one per group, share and micro-batch size)."""
    splits_tried: int = 0
    splits_cut: int = 0
    """Splits tried and cut off: a pipeline's search (with the cutoff, cheap) proved that it
    cannot beat the target (the incumbent or the best plan of pipelines so far) once the
    exchange's least is added."""
    exhaustive: bool = True
    """Every batch split of every grouping tried and every pipeline's search exhaustive."""
    elapsed_s: float = 0.0
    reason: str = ""
    """Why there is no plan of pipelines (fewer than two chip types, nothing fits...)."""
    lower_bound_s: float = 0.0
    """No plan of pipelines takes less: :func:`lower_bound_s` (which covers one pipeline too),
    or, when the search was exhaustive, the least over the splits of their slowest pipeline's
    fastest step plus the exchange's least (:func:`exchange_floor_s`), a split cut off counting
    as the target it could not beat, where that is more."""
    bound_by_splits: bool = False
    """:attr:`lower_bound_s` is the exhaustive search's (else :func:`lower_bound_s`)."""


def groupings(names: Sequence[str]) -> list[Grouping]:
    """Ways to group the chip types ``names`` into two or more pipelines (see the module
    docstring for which)."""
    names = list(names)
    if len(names) < 2:
        return []
    if len(names) <= ALL_GROUPINGS_UP_TO:  # one pipeline per type first, then fewer
        return sorted((g for g in _partitions(names) if len(g) > 1), key=len, reverse=True)
    out: list[Grouping] = [tuple((n,) for n in names)]
    for name in names:
        out.append(((name,), tuple(n for n in names if n != name)))
    return out


def _partitions(names: list[str]) -> Iterator[Grouping]:
    """Every set partition of ``names`` (groups and their members in ``names`` order)."""
    if not names:
        yield ()
        return
    first, rest = names[0], names[1:]
    for sub in _partitions(rest):
        yield ((first,),) + sub
        for index in range(len(sub)):
            yield sub[:index] + ((first,) + sub[index],) + sub[index + 1:]


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive whole numbers, in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


class _Runner:
    """One pipelines search: the per-(group, share) one-pipeline searches are cached here."""

    def __init__(self, cost: CostModel, options: SearchOptions, deadline: float,
                 incumbent_s: float) -> None:
        self.cost, self.options, self.deadline = cost, options, deadline
        self.incumbent = incumbent_s
        self.result = PipelinesResult(None)
        self.plans: dict[tuple[tuple[str, ...], int, int], tuple[float, Candidate | None]] = {}
        """Per (group, micro-batch size, share): the cutoff searched under and the best plan
        below it (None: none below it, or none fits)."""
        self.costs: dict[tuple[str, ...], CostModel] = {}
        self.floors: dict[Grouping, float] = {}
        self.floor = float("inf")
        """The least over the splits evaluated or cut off of a lower bound on their step."""
        self.cut: int | None = None
        """The pipeline proven too slow in the split last cut off (None: not cut off)."""

    @property
    def target(self) -> float:
        """The step a plan of pipelines must beat: the incumbent's or the best found so far."""
        best = self.result.best
        return min(self.incumbent, best.estimate.step_time_s if best else float("inf"))

    def group_cost(self, group: tuple[str, ...]) -> CostModel:
        if group not in self.costs:
            profile = self.cost.profile
            if profile is not None:
                profile = replace(profile, chips={k: v for k, v in profile.chips.items()
                                                  if k in group})
            self.costs[group] = CostModel(self.cost.cluster.subset(group), self.cost.model,
                                          self.cost.config, profile)
        return self.costs[group]

    def exchange_floor(self, grouping: Grouping) -> float:
        if grouping not in self.floors:
            self.floors[grouping] = exchange_floor_s(self.cost, grouping)
        return self.floors[grouping]

    def pipeline(self, group: tuple[str, ...], mbs: int, micro_batches: int, cutoff: float
                 ) -> Candidate | None:
        """The best one-pipeline plan of ``group`` for ``micro_batches`` micro-batches if it is
        faster than ``cutoff``, else None (none is, or none fits; proven unless the search
        was stopped, which clears :attr:`PipelinesResult.exhaustive`)."""
        key = (group, mbs, micro_batches)
        searched, best = self.plans.get(key, (-1.0, None))
        if best is None and searched < cutoff:
            if self.out_of_time():  # not searched: the split is left out, nothing proven
                self.result.exhaustive = False
                return None
            left = max(self.deadline - time.monotonic(), 0.05)
            options = replace(self.options, global_batch_size=mbs * micro_batches, top_k=1,
                              micro_batch_sizes=(mbs,), cutoff_s=cutoff,
                              time_limit_s=min(self.options.time_limit_s, left))
            self.result.searches += 1
            try:
                found = search(self.group_cost(group), options)
            except ConfigError:  # nothing fits, or the time limit stopped it before a plan
                self.result.exhaustive &= not self.out_of_time()
                self.plans[key] = (float("inf"), None)
                return None
            # proven over its whole space (or that nothing there beats the cutoff)
            self.result.exhaustive &= found.stats.exhaustive and (
                not found.candidates or found.gap == 0.0)
            best = found.best if found.candidates else None
            self.plans[key] = (cutoff, best)
        if best is None or best.estimate.step_time_s >= cutoff * (1 - 1e-9):
            return None
        return best

    def evaluate(self, grouping: Grouping, mbs: int, split: Sequence[int],
                 target: float | None = None) -> PipelinesCandidate | None:
        """The split's plan of pipelines, or None when some pipeline cannot beat ``target``
        (default :attr:`target`) with the exchange's least (:func:`exchange_floor_s`) added
        (the split is then cut off, the most loaded pipeline searched first) or has no plan."""
        self.result.splits_tried += 1
        self.cut = None
        floor = self.exchange_floor(grouping)
        cutoff = (self.target if target is None else target) - floor
        speeds = _peak_speeds(self.cost, grouping)
        order = sorted(range(len(grouping)), key=lambda k: -split[k] / speeds[k])
        found: dict[int, Candidate] = {}
        for k in order:  # no step is under 0: the exchange's least alone cuts it off then
            pipe = self.pipeline(grouping[k], mbs, split[k], cutoff) if cutoff > 0 else None
            if pipe is None and self.out_of_time():  # left out: nothing proven
                return None
            if pipe is None:  # every plan of this split takes at least the target
                self.result.splits_cut += 1
                self.cut = k
                self.floor = min(self.floor, cutoff + floor)
                return None
            found[k] = pipe
        plan = HeteroPlan.of_pipelines([found[k].plan for k in range(len(grouping))])
        estimate = evaluate_pipelines(self.cost, plan)
        # every plan of this split takes at least its slowest pipeline's fastest step, and the
        # exchange's least on top
        self.floor = min(self.floor, max(e.step_time_s for e in estimate.pipelines) + floor)
        return PipelinesCandidate(plan, estimate, grouping)

    def offer(self, candidate: PipelinesCandidate | None) -> None:
        best = self.result.best
        if candidate is not None and (best is None or candidate.estimate.step_time_s
                                      < best.estimate.step_time_s):
            self.result.best = candidate

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def grouping(self, grouping: Grouping, mbs: int, total: int) -> None:
        """Search the batch splits of one grouping (see the module docstring)."""
        parts = len(grouping)
        if total < parts:
            return
        if math.comb(total - 1, parts - 1) <= EXHAUSTIVE_SPLITS:
            for split in compositions(total, parts):
                if self.out_of_time():
                    self.result.exhaustive = False
                    return
                self.offer(self.evaluate(grouping, mbs, split))
            return
        self.result.exhaustive = False
        speeds = _peak_speeds(self.cost, grouping)
        for unit in split_units(total, parts):
            current = None
            for start in range(2):  # proportional to peak speed, then to the speed reached
                split = [unit * n for n in proportional(total // unit, speeds)]
                found = self.evaluate(grouping, mbs, split)
                if found is None and start == 0:  # cut off: walk away from the slow pipeline
                    found = self._walk(grouping, mbs, split, unit)
                if found is None:
                    break
                speeds = [p.global_batch_size / e.step_time_s
                          for p, e in zip(found.plan.pipelines, found.estimate.pipelines)]
                if current is None or found.estimate.step_time_s < current.estimate.step_time_s:
                    current = found
            while current is not None and not self.out_of_time():
                self.offer(current)
                current = self._move_one(grouping, mbs, current, unit)

    def _walk(self, grouping: Grouping, mbs: int, split: list[int], unit: int
              ) -> PipelinesCandidate | None:
        """From a split cut off, move ``unit`` micro-batches at a time from the pipeline proven
        too slow to the least loaded other (micro-batches per unit of peak speed), until a split
        is not cut off (its plan) or a pipeline that received is proven too slow (None)."""
        speeds = _peak_speeds(self.cost, grouping)
        received: set[int] = set()
        while self.cut is not None and self.cut not in received and split[self.cut] > unit:
            slow = self.cut
            others = [k for k in range(len(split)) if k != slow]
            to = min(others, key=lambda k: split[k] / speeds[k])
            split = list(split)
            split[slow] -= unit
            split[to] += unit
            received.add(to)
            found = self.evaluate(grouping, mbs, split)
            if found is not None:
                return found
        return None

    def _move_one(self, grouping: Grouping, mbs: int, current: PipelinesCandidate, unit: int
                  ) -> PipelinesCandidate | None:
        """The best split with ``unit`` micro-batches moved away from the slowest pipeline to
        another, if it beats ``current`` (a move cut off by its step cannot)."""
        split = [p.global_batch_size // mbs for p in current.plan.pipelines]
        slow = current.estimate.slowest
        best = None
        for k in range(len(split)):
            if k == slow or split[slow] <= unit:
                continue
            moved = list(split)
            moved[slow] -= unit
            moved[k] += unit
            found = self.evaluate(grouping, mbs, moved, (best or current).estimate.step_time_s)
            if found is not None and found.estimate.step_time_s < (
                    (best or current).estimate.step_time_s):
                best = found
        return best


def _peak_speeds(cost: CostModel, grouping: Grouping) -> list[float]:
    """Each group's summed peak speed (its chips' TFLOPS over their emulation slowdown)."""
    chips = [[cost.cluster.chip(name) for name in group] for group in grouping]
    return [sum(c.count * c.tflops_bf16 / c.emulate_slowdown for c in group) for group in chips]


def split_units(total: int, parts: int) -> list[int]:
    """Micro-batches per unit of a split that is not tried exhaustively, coarse to fine: the
    largest power of two dividing ``total`` that leaves at least 8 units per pipeline, then a
    quarter and a sixteenth of it (a share of many units of a power of two leaves room for the
    pipelines' DP degrees, which must divide their micro-batches)."""
    unit = 1
    while total % (2 * unit) == 0 and total // (2 * unit) >= 8 * parts:
        unit *= 2
    return list(dict.fromkeys(max(1, unit // f) for f in (1, 4, 16)))


def proportional(total: int, weights: Sequence[float]) -> tuple[int, ...]:
    """``total`` whole units split in proportion to ``weights``, each part at least 1 (largest
    remainders get the units left)."""
    parts = len(weights)
    spare = total - parts
    scale = sum(weights)
    exact = [spare * w / scale for w in weights]
    split = [1 + int(x) for x in exact]
    order = sorted(range(parts), key=lambda k: exact[k] - int(exact[k]), reverse=True)
    for k in order[: total - sum(split)]:
        split[k] += 1
    return tuple(split)


def lower_bound_s(cost: CostModel, options: SearchOptions) -> float:
    """A step time that no plan of ``cost``'s cluster reaches, of one pipeline or several, for
    any grouping, batch split, TP, DP, layer split, recompute or schedule (a relaxation).

    For each micro-batch size, every one of the ``M`` micro-batches needs a forward and backward
    of every layer, the embedding and the head on some chip, and a chip computes at most a step
    long: with ``a[p][c]`` the seconds one chip of type ``c`` takes for part ``p`` at TP 1
    without recompute (TP divides a part's work among its chips and adds communication,
    recompute adds work, so neither takes fewer chip-seconds), and ``w[c]`` its seconds for a
    whole micro-batch, weak duality with weights ``1 / w[c]`` gives

        step >= M x sum_p n_p min_c (a[p][c] / w[c]) / sum_c (count_c / w[c])

    (``n_p`` parts of kind ``p`` per micro-batch): the chips' summed rate where every type is
    equally suited to every part. With ``host_cores`` (CPU emulation) the step also takes at
    least the passes' CPU time over those cores. The least over the micro-batch sizes."""
    cluster, model = cost.cluster, cost.model
    names = cluster.names
    best = float("inf")
    for mbs in options.micro_batch_candidates():
        total = options.global_batch_size // mbs
        kinds = {name: cost.stage_costs(name, 1, mbs, 1) for name in names}
        parts = [(model.num_layers, {n: k.layer_forward + k.layer_backward[0]
                                     for n, k in kinds.items()}),
                 (1, {n: k.embedding_forward + k.embedding_backward for n, k in kinds.items()}),
                 (1, {n: k.head_forward + k.head_backward for n, k in kinds.items()})]
        whole = {n: sum(count * seconds[n] for count, seconds in parts) for n in names}
        rate = sum(cluster.chip(n).count / whole[n] for n in names)
        need = sum(count * min(seconds[n] / whole[n] for n in names) for count, seconds in parts)
        bound = total * need / rate
        if cluster.host_cores is not None:  # every pass's CPU time, on the cores shared
            cpu = min(whole[n] / cluster.chip(n).emulate_slowdown for n in names)
            bound = max(bound, total * cpu / cluster.host_cores)
        best = min(best, bound)
    return best


def search_pipelines(cost: CostModel, options: SearchOptions,
                     time_limit_s: float | None = None,
                     incumbent_s: float | None = None) -> PipelinesResult:
    """The best plan of two or more data-parallel pipelines for ``cost``'s cluster and model
    (see the module docstring), within ``time_limit_s`` (default: the options' limit; at most
    0: nothing is searched). With ``incumbent_s`` (the best one-pipeline step) only plans
    faster than it are sought: splits where a pipeline cannot beat it are cut off, and the
    result may then have no plan (:attr:`PipelinesResult.reason` says so)."""
    started = time.monotonic()
    limit = options.time_limit_s if time_limit_s is None else time_limit_s
    incumbent = float("inf") if incumbent_s is None else incumbent_s
    runner = _Runner(cost, options, started + limit, incumbent)
    found = groupings(cost.cluster.names)
    runner.result.groupings = len(found)
    runner.result.lower_bound_s = lower_bound_s(cost, options)
    if not found:
        runner.result.reason = "one chip type: a plan of pipelines is a plan with DP"
    elif found and limit <= 0:
        runner.result.exhaustive = False
        runner.result.reason = "not searched: the time limit was spent on one pipeline for all"
        found = []
    for mbs in options.micro_batch_candidates():
        total = options.global_batch_size // mbs
        for grouping in found:
            if runner.out_of_time():
                runner.result.exhaustive = False
                break
            runner.grouping(grouping, mbs, total)
    result = runner.result
    if found and result.best is None:
        result.reason = _none_reason(result, incumbent)
    every_grouping = len(cost.cluster.names) <= ALL_GROUPINGS_UP_TO
    if result.exhaustive and found and every_grouping and runner.floor > result.lower_bound_s:
        result.lower_bound_s = runner.floor  # no plan of a split beats its slowest pipeline
        result.bound_by_splits = True
    result.elapsed_s = time.monotonic() - started
    return result


def _none_reason(result: PipelinesResult, incumbent: float) -> str:
    """Why a search found no plan of pipelines."""
    if result.splits_cut and incumbent < float("inf"):
        return f"none beats one pipeline for all ({incumbent:.3f} s) in the splits tried"
    return ("no grouping of the chip types into pipelines fits in memory"
            if result.exhaustive else "none found within the time limit")
