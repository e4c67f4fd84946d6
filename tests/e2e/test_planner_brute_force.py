"""The search against brute force: same plan space, same cost function, independent enumeration.

The enumerator below shares nothing with the search but the cost model: it lists every plan of
the planner's plan space (micro-batch size; per chip type: unused or a TP degree, its own DP
degree and a stage count, all its chips when the used types' DP degrees differ; every order
of the used types, every pipeline schedule the pipeline
can run -- 1f1b; zero-bubble from two stages; interleaved with V = 2..4 model chunks from two
stages when every used type has the same DP degree and the micro-batches are a multiple of the
stages -- every layer split with at least one layer per model chunk and equal chunks on each
stage, every stage's recompute mode) and asks ``CostModel.evaluate`` for its step time.
"""

from __future__ import annotations

import importlib
import itertools
import math
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from megatron_h2.config import RECOMPUTE_MODES
from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.cost_model import (
    CostConfig,
    CostModel,
    StageEstimate,
    replica_warmups,
    step_time_terms,
)
from megatron_h2.planner.held_activations import held_totals
from megatron_h2.planner.partition import StageSlot, solve_split
from megatron_h2.planner.report import search_summary
from megatron_h2.planner.search import SearchOptions, search
from tests.helpers.planner_models import planner_model

VARIANTS = [
    ("1f1b", 1),
    ("zero-bubble", 1),
    ("interleaved", 2),
    ("interleaved", 3),
    ("interleaved", 4),
]


def compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive integers, in order."""
    return [
        tuple(b - a for a, b in zip((0, *cuts), (*cuts, total)))
        for cuts in itertools.combinations(range(1, total), parts - 1)
    ]


def runnable(schedule: str, v: int, p: int, m: int, layers: int) -> bool:
    """Whether the schedule can run p stages and m micro-batches (written out independently)."""
    if schedule == "1f1b":
        return True
    if schedule == "zero-bubble":
        return p >= 2
    return p >= 2 and m % p == 0 and layers % v == 0 and layers >= p * v


def stage(name: str, tp: int, layers: int, v: int, mode: str, dp: int | None = None) -> StageSpec:
    return StageSpec(name, tp, layers, mode, (layers // v,) * v if v > 1 else (), dp)


class Enumerator:
    """Every plan of the plan space with its step time. A stage's estimate depends only on the
    stage and its position, so it is computed once per (schedule, pipeline, stage, layers,
    mode); the step time combines them with the cost model's step formula."""

    def __init__(self, cost: CostModel, options: SearchOptions) -> None:
        self.cost, self.options = cost, options
        self.stages: dict[tuple, StageEstimate] = {}
        self.specs = {c.name: ChipSpec(c.device, c.emulate_slowdown) for c in cost.cluster.chips}

    def estimate(self, key: tuple) -> StageEstimate:
        if key not in self.stages:
            schedule, v, p, m, mbs, dp, warmup, index, name, tp, layers, mode = key
            self.stages[key] = self.cost.stage_estimate(
                stage(name, tp, layers, v, mode), index, p, m, mbs, dp, schedule, warmup
            )
        return self.stages[key]

    def fastest_fitting(self, key: tuple) -> str | None:
        """The fastest recompute mode with which the stage fits in memory."""
        for mode in RECOMPUTE_MODES:
            if self.estimate((*key, mode)).fits:
                return mode
        return None

    def plans(self, all_modes: bool = False):  # type: ignore[no-untyped-def]
        """Yield (step time, structure key, plan factory) for every plan that fits."""
        cost, model = self.cost, self.cost.model
        sizes = {c.name: c.count for c in cost.cluster.chips}
        for mbs in self.options.micro_batch_candidates():
            total = self.options.global_batch_size // mbs
            choices = [
                [None]
                + [
                    (c.name, t, d, n)
                    for t in c.tensor_parallel_options(
                        model.num_attention_heads, model.num_query_groups
                    )
                    for d in range(1, c.count + 1)
                    if total % d == 0
                    for n in range(1, c.count // (t * d) + 1)
                ]
                for c in cost.cluster.chips
            ]
            for combo in itertools.product(*choices):
                used = [c for c in combo if c]
                degrees = {d for _, _, d, _ in used}
                if len(degrees) > 1 and any(t * d * n != sizes[name] for name, t, d, n in used):
                    continue  # types with their own DP degree use all their chips
                for order in itertools.permutations(used):
                    stages = [(name, t, d) for name, t, d, n in order for _ in range(n)]
                    for schedule, v in VARIANTS:
                        if schedule == "interleaved" and len(degrees) > 1:
                            continue  # interleaved orders need one DP degree
                        m = total // stages[0][2] if stages else 0
                        if stages and runnable(schedule, v, len(stages), m, model.num_layers):
                            yield from self._splits(stages, schedule, v, mbs, total, all_modes)

    def _splits(self, stages, schedule, v, mbs, total, all_modes):  # type: ignore[no-untyped-def]
        p, names = len(stages), [name for name, _, _ in stages]
        links = tuple(self.cost.link_s(a, b, mbs) for a, b in zip(names, names[1:]))
        wrap = self.cost.link_s(names[-1], names[0], mbs) if v > 1 else 0.0
        dps = [d for _, _, d in stages]
        uniform = len(set(dps)) == 1
        warmups = replica_warmups(schedule, dps, v, total)
        counts = [total // d for d in dps]
        for units in compositions(self.cost.model.num_layers // v, p):
            split = [u * v for u in units]
            keys = [
                (schedule, v, p, total // d, mbs, d, warmup, i, n, t, size)
                for i, ((n, t, d), size, warmup) in enumerate(zip(stages, split, warmups))
            ]
            if all_modes:
                mode_sets = itertools.product(RECOMPUTE_MODES, repeat=p)
            else:
                modes = [self.fastest_fitting(key) for key in keys]
                mode_sets = [] if None in modes else [modes]
            for modes in mode_sets:
                estimates = tuple(self.estimate((*k, r)) for k, r in zip(keys, modes))
                if not all(e.fits for e in estimates):
                    continue
                pipeline, link = step_time_terms(schedule, counts, v, estimates, links, wrap)
                step = pipeline + link + max(e.dp_sync_s for e in estimates)
                specs = [
                    stage(n, t, k, v, r, None if uniform else d)
                    for (n, t, d), k, r in zip(stages, split, modes)
                ]
                plan = (dps[0], mbs, self.options.global_batch_size, self.specs, specs, schedule)
                yield step, (mbs, schedule, v, tuple(stages)), plan


def blocks(stages: tuple) -> tuple:
    """(chip, TP, DP) of each chip type of a structure's stages (each type is one block)."""
    return tuple(sorted(set(stages)))


def derived(
    best: dict[tuple, tuple[float, tuple]], top_k: int, tp_options: dict[str, list[int]]
) -> dict[tuple, tuple]:
    """The structures of the re-split space: every one-DP structure, and the own-DP structures
    that re-split one of the ``top_k`` best one-DP structures of two or more chip types under
    1f1b or zero-bubble: the same micro-batch size, schedule and chip types, any order, each
    type any TP degree it can run (``tp_options``) and half, equal to or twice its number of
    stages there (so its DP degree ``d t f / t'`` for ``f`` in 1/2, 1, 2)."""
    uniform = {k: v for k, v in best.items() if len({d for _, _, d in k[3]}) == 1}
    seeds = set()
    for key in sorted(uniform, key=lambda k: uniform[k][0])[:top_k]:
        mbs, schedule, _, stages = key
        if len(blocks(stages)) > 1 and schedule != "interleaved":
            seeds.add((mbs, schedule, blocks(stages)))
    kept = dict(uniform)
    for key, item in best.items():
        mbs, schedule, _, stages = key
        if key in uniform:
            continue
        for seed_mbs, seed_schedule, types in seeds:
            near = {
                (name, other, d * t * f / other)
                for name, t, d in types
                for other in tp_options[name]
                for f in (0.5, 1, 2)
            }
            names = sorted(name for name, _, _ in types)
            if (
                (mbs, schedule) == (seed_mbs, seed_schedule)
                and sorted(name for name, _, _ in blocks(stages)) == names
                and set(blocks(stages)) <= near
            ):
                kept[key] = item
    return kept


def brute_force_best(
    cost: CostModel,
    options: SearchOptions,
    count: int,
    all_modes: bool = False,
    own_dp: str = "all",
) -> list[float]:
    """The ``count`` best step times over structures (each structure's best split) of the
    space ``own_dp`` names (``all``, ``derived`` or ``none``), checked against
    ``CostModel.evaluate`` of the plans themselves."""
    best: dict[tuple, tuple[float, tuple]] = {}
    for value, key, plan in Enumerator(cost, options).plans(all_modes):
        if key not in best or value < best[key][0]:
            best[key] = (value, plan)
    if own_dp == "derived":
        model = cost.model
        tp_options = {
            c.name: c.tensor_parallel_options(model.num_attention_heads, model.num_query_groups)
            for c in cost.cluster.chips
        }
        best = derived(best, options.top_k, tp_options)
    elif own_dp == "none":
        best = {k: v for k, v in best.items() if len({d for _, _, d in k[3]}) == 1}
    ranked = sorted(best.values(), key=lambda item: item[0])[:count]
    for value, args in ranked:
        dp, mbs, gbs, specs, stages, schedule = args
        plan = HeteroPlan(dp, mbs, gbs, specs, stages, schedule=schedule)
        assert cost.evaluate(plan).step_time_s == pytest.approx(value, rel=1e-12)
    return [value for value, _ in ranked]


def chip(
    name: str,
    count: int,
    per_node: int,
    tflops: float,
    memory_mib: float,
    intra: float = 4.0,
    inter: float = 1.0,
) -> ChipType:
    return ChipType(name, "cpu", count, per_node, tflops, memory_mib / 1024, intra, inter)


TINY = planner_model(
    num_layers=5,
    hidden_size=64,
    ffn_hidden_size=176,
    num_attention_heads=4,
    seq_length=128,
    vocab_size=1000,
    num_query_groups=2,
)

CASES = {
    # two types, memory tight on the fast one: recompute and TP both matter
    "two-types-memory-tight": (
        Cluster((chip("A", 4, 4, 0.4, 3.0), chip("B", 4, 2, 0.15, 9.0)), 0.5),
        TINY,
        8,
        False,
    ),
    # three types, 16 chips, slow cross-type links
    "three-types-16-chips": (
        Cluster(
            (
                chip("A", 4, 2, 0.3, 6.0),
                chip("B", 4, 4, 0.2, 4.0, 8.0, 2.0),
                chip("C", 8, 4, 0.1, 12.0),
            ),
            0.2,
        ),
        TINY,
        4,
        True,
    ),
    # distributed optimizer and a batch with three DP degrees
    "three-types-distopt": (
        Cluster(
            (chip("A", 2, 2, 0.5, 4.0), chip("B", 6, 2, 0.2, 5.0), chip("C", 4, 4, 0.15, 10.0)), 0.5
        ),
        planner_model(6, 64, 176, 4, 128, 1000, 2),
        12,
        True,
    ),
    # one type much faster, the other memory-rich; emulate_slowdown counts
    "fast-small-vs-slow-big": (
        Cluster(
            (chip("F", 8, 4, 0.5, 2.6), ChipType("S", "cpu", 8, 4, 0.5, 16 / 1024, 4.0, 1.0, 3.0)),
            1.0,
        ),
        planner_model(6, 64, 176, 4, 128, 1000, 4),
        8,
        False,
    ),
}


@pytest.mark.parametrize("own_dp", ["all", "derived"])
@pytest.mark.parametrize("name", list(CASES))
def test_search_finds_the_brute_force_optimum(name: str, own_dp: str) -> None:
    cluster, model, global_batch, distributed = CASES[name]
    cost = CostModel(cluster, model, CostConfig(use_distributed_optimizer=distributed))
    options = SearchOptions(
        global_batch_size=global_batch, top_k=3, max_micro_batch_size=4, own_dp=own_dp
    )
    expected = brute_force_best(cost, options, 3, own_dp=own_dp)
    result = search(cost, options)
    found = [c.estimate.step_time_s for c in result.candidates]
    assert result.stats.exhaustive
    assert found == pytest.approx(expected, rel=1e-9)
    assert len({c.plan for c in result.candidates}) == len(result.candidates)


def test_the_cases_exercise_recompute_tp_several_types_and_own_dp() -> None:
    seen_modes, seen_tp, mixed, own_dp = set(), set(), False, False
    for cluster, model, global_batch, distributed in CASES.values():
        cost = CostModel(cluster, model, CostConfig(use_distributed_optimizer=distributed))
        options = SearchOptions(global_batch, top_k=3, max_micro_batch_size=4, own_dp="all")
        result = search(cost, options)
        for cand in result.candidates:
            seen_modes |= {s.recompute for s in cand.plan.stages}
            seen_tp |= {s.tensor_parallel_size for s in cand.plan.stages}
            mixed |= len({s.chip for s in cand.plan.stages}) > 1
            own_dp |= not cand.plan.uniform_dp
    assert {"none", "selective"} <= seen_modes and len(seen_tp) > 1 and mixed and own_dp


def test_fastest_fitting_recompute_is_optimal_against_all_modes() -> None:
    cluster = Cluster((chip("A", 2, 2, 0.4, 2.4), chip("B", 2, 2, 0.2, 4.0)), 0.5)
    model = planner_model(3, 64, 176, 4, 128, 1000, 2)
    cost = CostModel(cluster, model)
    options = SearchOptions(global_batch_size=4, top_k=1, max_micro_batch_size=2, own_dp="all")
    brute = brute_force_best(cost, options, 1, all_modes=True)[0]
    assert search(cost, options).best.estimate.step_time_s == pytest.approx(brute, rel=1e-9)


@pytest.mark.parametrize(
    "schedule,v,dps",
    [
        ("1f1b", 1, (2, 2, 2, 2)),
        ("zero-bubble", 1, (2, 2, 2, 2)),
        ("interleaved", 3, (2, 2, 2, 2)),
        ("1f1b", 1, (1, 4, 2, 1)),
        ("zero-bubble", 1, (4, 1, 1, 2)),
    ],
)
def test_layer_split_is_exact_for_fixed_stages(schedule: str, v: int, dps: tuple[int, ...]) -> None:
    cluster = Cluster((chip("A", 8, 4, 0.4, 3.0), chip("B", 8, 4, 0.15, 8.0)), 0.5)
    model = planner_model(12 if v == 3 else 9, 64, 176, 4, 128, 1000, 2)
    cost = CostModel(cluster, model, CostConfig(use_distributed_optimizer=True))
    layout = [("B", 1), ("B", 2), ("A", 1), ("A", 2)]
    mbs, total = 1, 16
    uniform = len(set(dps)) == 1
    specs = {c.name: ChipSpec("cpu") for c in cluster.chips}
    p = len(layout)
    warmups = replica_warmups(schedule, dps, v, total)
    slots, caps = [], []
    for i, ((name, tp), dp, warmup) in enumerate(zip(layout, dps, warmups)):
        costs = cost.stage_costs(name, tp, mbs, dp)
        slots.append(StageSlot(costs, i == 0, i == p - 1))
        states = held_totals(schedule, p, total // dp, v, i, warmup)
        caps.append(tuple(costs.max_units(v, r, states, i == 0, i == p - 1) for r in range(3)))
    links = 2 * v * sum(cost.link_s(a, b, mbs) for (a, _), (b, _) in zip(layout, layout[1:]))
    links += 2 * (v - 1) * cost.link_s(layout[-1][0], layout[0][0], mbs)
    counts = [total // dp for dp in dps]
    split = solve_split(slots, model.num_layers, counts, links, caps, schedule=schedule, chunks=v)
    brute, enumerator = math.inf, Enumerator(cost, SearchOptions(total * mbs))
    for units in compositions(model.num_layers // v, p):
        layers = [u * v for u in units]
        keys = [
            (schedule, v, p, total // dp, mbs, dp, warmup, i, n, t, size)
            for i, ((n, t), dp, warmup, size) in enumerate(zip(layout, dps, warmups, layers))
        ]
        modes = [enumerator.fastest_fitting(key) for key in keys]
        if None not in modes:
            stages = [
                stage(n, t, k, v, r, None if uniform else dp)
                for (n, t), k, r, dp in zip(layout, layers, modes, dps)
            ]
            plan = HeteroPlan(dps[0], mbs, total * mbs, specs, stages, schedule=schedule)
            brute = min(brute, cost.evaluate(plan).step_time_s)
    assert split is not None and split.step_time_s == pytest.approx(brute, rel=1e-9)


def random_case(seed: int) -> tuple[CostModel, SearchOptions]:
    """A random 2-3 type cluster of at most 16 chips with tight memory (deterministic per seed)."""
    rng = random.Random(seed)
    types = rng.choice([2, 3])
    remaining, chips = 16, []
    for index in range(types):
        count = rng.choice([c for c in (2, 4, 6, 8) if c <= remaining - 2 * (types - index - 1)])
        remaining -= count
        chips.append(
            ChipType(
                "ABC"[index],
                "cpu",
                count,
                rng.choice([1, 2, 4]),
                rng.uniform(0.05, 0.5),
                rng.uniform(2, 12) / 1024,
                rng.uniform(1, 10),
                rng.uniform(0.2, 2),
            )
        )
    model = planner_model(rng.choice([4, 5, 6, 7, 8]), 64, 176, 4, 128, 1000, 2)
    config = CostConfig(use_distributed_optimizer=rng.random() < 0.5)
    options = SearchOptions(
        global_batch_size=rng.choice([4, 6, 8, 12]),
        top_k=2,
        max_micro_batch_size=4,
        own_dp=("all", "derived")[seed % 2],
    )
    return CostModel(Cluster(tuple(chips), rng.uniform(0.1, 1)), model, config), options


@pytest.mark.parametrize("seed", range(4))  # seeds 4-15: tests/e2e/test_planner_optimality.py
def test_search_matches_brute_force_on_random_clusters(seed: int) -> None:
    cost, options = random_case(seed)
    expected = brute_force_best(cost, options, 2, own_dp=options.own_dp)
    found = [c.estimate.step_time_s for c in search(cost, options).candidates]
    assert found == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("seed", [31])  # seeds 9 and 35: tests/e2e/test_planner_optimality.py
def test_derived_space_reaches_own_dp_plans(seed: int) -> None:
    """Random clusters where re-splits of the best one-DP plans give own-DP plans among the
    best: the search finds the brute-force best of that space, own-DP plans included."""
    cost, options = random_case(seed)
    options = replace(options, own_dp="derived")
    expected = brute_force_best(cost, options, 2, own_dp="derived")
    candidates = search(cost, options).candidates
    assert [c.estimate.step_time_s for c in candidates] == pytest.approx(expected, rel=1e-9)
    assert any(not c.plan.uniform_dp for c in candidates)


@pytest.mark.parametrize("pause", [0.5, 0.75])  # before its roots are bounded; best first
def test_one_dp_search_pauses_for_the_re_splits_and_goes_on(monkeypatch, pause: float) -> None:
    """A one-DP search still running when all but ``own_dp_share`` of the time limit is used
    pauses, the re-splits run, and the one-DP search then goes on to its end: with a clock that
    counts its readings, it pauses at ``pause`` of them and still proves the one-DP optimum
    (brute force)."""
    cost, options = random_case(31)
    readings = itertools.count()
    clock = SimpleNamespace(monotonic=lambda: next(readings))
    monkeypatch.setattr(importlib.import_module("megatron_h2.planner.search"), "time", clock)
    search(cost, replace(options, own_dp="none", time_limit_s=1e9))
    at = int(next(readings) * pause)  # readings of the whole one-DP search, then the pause
    readings = itertools.count()
    options = replace(options, own_dp="derived", time_limit_s=10 * at, own_dp_share=0.9)
    result = search(cost, options)
    stats = result.stats
    assert stats.one_dp_resumed and stats.exhaustive
    assert "paused" in search_summary(result)
    best_one_dp = brute_force_best(cost, replace(options, own_dp="none"), 1, own_dp="none")[0]
    assert result.best.estimate.step_time_s <= best_one_dp * (1 + 1e-9)
