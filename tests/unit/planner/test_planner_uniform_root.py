"""The one-DP root bound with the fill and links joint over the chip types' kinds
(:mod:`megatron_h2.planner.uniform_root`): its knapsack against enumerating every choice, and
the root bound against the exact split of every pipeline of the shape on small random clusters
(every schedule, zero-bubble's micro-batch-1 shapes among them)."""

from __future__ import annotations

import importlib
import itertools

import numpy as np
import pytest

from megatron_h2.planner import own_root, suffixes, uniform_root
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.partition import INF
from megatron_h2.planner.search_options import SearchOptions
from tests.unit.planner.test_planner_bounds import exact_below, small_case

search_module = importlib.import_module("megatron_h2.planner.search")


def uniform_shapes(seeds: range, schedule: str) -> list[BatchShape]:
    """The one-DP shapes (DP 1 and 2, micro-batch size 1) of :func:`small_case` ``seeds`` with
    some stage kind."""
    chunks = 2 if schedule == "interleaved" else 1
    shapes = [BatchShape(small_case(seed), 8, 1, schedule, chunks, dp)
              for seed in seeds for dp in (1, 2)]
    return [shape for shape in shapes if shape.kinds and shape.positions]


def enumerated(shape: BatchShape, caps: np.ndarray, probe: int) -> float:
    """:func:`uniform_root.uniform_fill_links` at one probe by trying every kind (or none) per
    type, every stage count of its block and every layer count those stages hold."""
    best = INF
    options = [[None, *shape.kinds_of[chip]] for chip in shape.types]
    for choice in itertools.product(*options):
        kinds = [kind for kind in choice if kind is not None]
        blocks = []
        for kind in kinds:
            largest = sorted(caps[kind, probe], reverse=True)
            most = min(shape.kinds[kind].max_stages, shape.positions)
            blocks.append([(n, x) for n in range(1, most + 1)
                           for x in range(1, int(sum(largest[:n])) + 1)])
        for picks in itertools.product(*blocks):
            if sum(x for _, x in picks) != shape.layers:
                continue
            cost = sum(x * float(shape.fill_unit[k]) + n * shape.type_link[shape.kinds[k].chip]
                       for k, (n, x) in zip(kinds, picks))
            best = min(best, cost)
    edges = float(shape.head_time.min() + shape.embedding_time.min())
    return best - max(shape.type_link.values()) + edges


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_the_knapsack_is_the_least_over_every_choice(schedule: str) -> None:
    finite = 0
    for shape in uniform_shapes(range(4), schedule):
        probes = np.geomspace(max(shape.w_floor, 1e-12), shape.w_max, 4)
        caps = shape.capacity(probes)
        joint = uniform_root.uniform_fill_links(shape, caps)
        for probe in range(len(probes)):
            expected = enumerated(shape, caps, probe)
            assert joint[probe] == pytest.approx(expected, rel=1e-12) or joint[probe] == expected
            finite += expected < INF
    assert finite > 0


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble", "interleaved"])
def test_the_one_dp_root_bound_never_exceeds_the_exact_split_and_rises(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every one-DP root bound is at most the best exact split below the root (and every
    option's bound, which is at least it, at most the exact split of every pipeline below
    that option), and on some shape the joint terms raise it above the root bound without
    them."""
    checked, raised = 0, 0
    for shape in uniform_shapes(range(16), schedule):
        run = search_module._Search(shape.cost, SearchOptions(8, top_k=10**6))
        shape.build_grid(shape.w_max, 64)
        least = exact_below(run, shape, suffixes.root_node(shape), [0])
        if least < INF:
            assert shape.root_bound() <= least * (1 + 1e-9), (shape.root_bound(), least)
            checked += 1
        with monkeypatch.context() as patch:
            patch.setattr(own_root, "uniform_fill_links",
                          lambda s, caps: np.zeros(caps.shape[1]))
            loose = shape._coupled_root()
        raised += shape.root_coupled > loose * (1 + 1e-6)
    assert checked > 0 and raised > 0
