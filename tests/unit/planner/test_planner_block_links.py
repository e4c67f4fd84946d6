"""The link time of a chip type's block of stages (:func:`.head_block.block_links`): the
blocks' links, less the last one, against the exact links of every closed pipeline of
small random clusters' shapes (one DP degree and own DP degrees), and against the form it
replaced (every stage at its type's cheapest link to any type)."""

from __future__ import annotations

import itertools

from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.head_block import block_links, last_block_links
from tests.unit.planner.test_planner_bounds import small_case


def pipelines(shape: BatchShape) -> list[tuple[tuple[int, int], ...]]:
    """Every order of one kind (or none) per chip type with each block's stage counts (own DP:
    every chip of the type, its most stages), as (kind, stages) blocks in pipeline order."""
    out = []
    for order in itertools.permutations(shape.types):
        for size in range(1, len(order) + 1):
            for kinds in itertools.product(*(shape.kinds_of[t] for t in order[:size])):
                most = [shape.kinds[k].max_stages for k in kinds]
                counts = ([range(n, n + 1) for n in most] if not shape.uniform
                          else [range(1, n + 1) for n in most])
                out += [tuple(zip(kinds, stages)) for stages in itertools.product(*counts)]
    return out


def exact_links(shape: BatchShape, blocks: tuple[tuple[int, int], ...]) -> float:
    """The links of a pipeline as stage two costs them (interleaving's wrap-around aside)."""
    names = [shape.kinds[k].name for k, n in blocks for _ in range(n)]
    return shape.link_factor * sum(shape.link(a, b) for a, b in zip(names, names[1:]))


def test_block_links_never_exceed_the_exact_links_and_beat_the_cheapest_link_form() -> None:
    checked = higher = 0
    for seed in range(12):
        cost = small_case(seed)
        for dp in (1, 2, None):
            shape = BatchShape(cost, 8, 1, "1f1b", 1, dp)
            if not shape.kinds or not shape.positions:
                continue
            for blocks in pipelines(shape):
                chips = [shape.kinds[k].chip for k, _ in blocks]
                bound = sum(block_links(shape, c, n) for c, (_, n) in zip(chips, blocks))
                bound -= last_block_links(shape)
                cheapest = sum(n * shape.type_link[c] for c, (_, n) in zip(chips, blocks))
                cheapest -= max(shape.type_link.values())
                assert bound <= exact_links(shape, blocks) * (1 + 1e-12) + 1e-15, blocks
                assert bound >= cheapest - 1e-12 * abs(cheapest)
                checked += 1
                higher += bound > cheapest * (1 + 1e-9) + 1e-12
    assert checked > 100 and higher > 0
