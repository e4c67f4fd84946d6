"""The range split's scan (``partition_ranges.solve_range_split``) against brute force: on small
random mixed dense / MoE models and pipelines, its optimum must be the least step time over every
split into contiguous non-empty ranges (each costed by the same range table), and it must answer
None exactly when no split beats the cutoff."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from megatron_h2.planner import CostModel
from megatron_h2.planner.cluster import Cluster
from megatron_h2.planner.cost_model import CostConfig
from megatron_h2.planner.held_activations import held_states
from megatron_h2.planner.partition_ranges import RangeSlot, RangeTable, solve_range_split
from tests.unit.planner.test_planner_moe import chip, moe_model

CLUSTER = Cluster((chip("big", memory_mib=64.0, tflops=0.2), chip("fast", memory_mib=24.0),
                   chip("mid", memory_mib=40.0, tflops=0.5, intra=4.0)), 1.0)


def _instance(seed: int) -> tuple[list[RangeSlot], tuple[bool, ...], list[int], str]:
    rng = random.Random(seed)
    layers = rng.randint(5, 9)
    pattern = [rng.random() < 0.6 for _ in range(layers)]
    pattern[rng.randrange(layers)] = False  # both kinds present
    pattern[rng.randrange(layers)] = True
    model = moe_model(layers=layers, freq=[int(x) for x in pattern], experts=4,
                      topk=rng.choice([2, 3]), shared=rng.choice([None, 48]))
    cost = CostModel(CLUSTER, model, CostConfig(use_distributed_optimizer=rng.random() < 0.5))
    schedule = rng.choice(["1f1b", "zero-bubble"])
    p = rng.randint(2, min(5, layers))
    m = rng.choice([2, 4, 8])
    slots = []
    for i in range(p):
        name, tp, dp = rng.choice(["big", "fast", "mid"]), rng.choice([1, 2]), rng.choice([1, 2])
        ep = rng.choice([1, dp])
        slots.append(RangeSlot(cost.stage_costs(name, tp, 1, dp, ep, False),
                               cost.stage_costs(name, tp, 1, dp, ep, True), i == 0, i == p - 1,
                               held_states(schedule, p, m, 1, i)))
    return slots, cost.layer_is_moe, [m] * p, schedule


def _brute_force(table: RangeTable, p: int, links: float) -> float:
    best = float("inf")
    layers = table.num_layers
    for cuts in itertools.combinations(range(1, layers), p - 1):
        split = np.diff((0, *cuts, layers)).tolist()
        best = min(best, table.step_time(split, links))
    return best


@pytest.mark.parametrize("seed", range(120))
def test_range_split_is_the_least_of_every_split(seed):
    slots, pattern, counts, schedule = _instance(seed)
    links = 1e-3 * (seed % 3)
    table = RangeTable(slots, pattern, counts, schedule)
    best = _brute_force(table, len(slots), links)
    found = solve_range_split(slots, pattern, counts, links, schedule)
    if not np.isfinite(best):
        assert found is None
        return
    assert found is not None
    assert found.step_time_s == pytest.approx(best, rel=1e-12)
    assert table.step_time(list(found.layers), links) == pytest.approx(best, rel=1e-12)
    # a cutoff just above the optimum keeps it; one at it answers None
    above = solve_range_split(slots, pattern, counts, links, schedule, best * (1 + 1e-9))
    assert above is not None and above.step_time_s == pytest.approx(best, rel=1e-12)
    assert solve_range_split(slots, pattern, counts, links, schedule, best) is None
