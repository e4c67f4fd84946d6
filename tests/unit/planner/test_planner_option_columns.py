"""The option columns kept per (chip type, lead, positions left) and grid (``option_columns``),
their blocks taken as one group (``option_group``) and the tables kept per option leads
(``lead_cache``) give the option bounds bit for bit as when each is built anew, one kind at a
time, with every block alone (on small random clusters, with and without a cutoff)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_h2.planner import lead_cache, option_columns, suffixes
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.partition import INF
from megatron_h2.planner.search_options import SearchOptions
from tests.unit.planner.test_planner_bounds import search_module, small_case


def plain_bounds(shape: BatchShape, node, fixed, need, chip, cutoff: float,
                 terms: list[np.ndarray] | None = None) -> np.ndarray:
    """The option bounds of ``chip``'s columns built one kind at a time (each block its own
    tuple, the sync bound per kind, fresh writeable leads: nothing kept or grouped); with
    ``terms`` also the needs, edges, links and syncs (added to it)."""
    columns = chip.columns
    others = node.mask & ~(1 << shape.types.index(shape.kinds[columns[0][0]].chip))
    parts, needs, edges, links, syncs, leads = list(fixed), [], [], [], [], []
    width, lo = sum(len(c) for _, c in columns), 0
    for kind, count in columns:
        start = shape.start(kind, node.lead)
        caps = np.zeros((len(shape.grid), width))
        caps[:, lo : lo + len(count)] = shape.block(kind, start, start + count)
        stages = np.zeros(width)
        stages[lo : lo + len(count)] = count
        parts.append((float(shape.fill_unit[kind]), caps, stages))
        own = float(shape.unit[kind, 0])
        if not node.suffix:
            own = max(own, float(shape.head_need[kind]))
        needs.append(np.full(len(count), max(need, own)))
        last = node.suffix[-1][0] if node.suffix else kind
        edges.append(np.full(len(count), shape.head_time[last] + shape.embedding_min))
        name = shape.kinds[kind].name
        total = (count - 1) * shape.link(name, name)
        if node.suffix:
            total = total + shape.link(name, shape.kinds[node.suffix[0][0]].name)
        links.append(node.links + shape.link_factor * total)
        syncs.append(shape.sync_bound(node.suffix + ((kind, count),), others, last, kind))
        leads.append(shape.kinds[kind].dp * (start + count))
        lo += len(count)
    rates = shape.block_rates(node.suffix) + [shape.sync_inverse[k] for k, _ in columns]
    if terms is not None:
        terms += [np.concatenate(v) for v in (needs, edges, links, syncs)]
    fronts = search_module._fronts(shape, np.concatenate(
        [np.full(len(c), shape.embedding_tail[k]) for k, c in columns]), others)
    return shape.bound(parts, others, np.concatenate(leads), np.concatenate(links),
                       np.concatenate(edges) + chip.rise, np.concatenate(needs),
                       np.concatenate(syncs), rates, cutoff, fronts)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
@pytest.mark.parametrize("dp", [1, 2, None])
@pytest.mark.parametrize("seed", range(4))
def test_kept_and_grouped_columns_bound_bit_for_bit(seed: int, dp: int | None,
                                                    schedule: str) -> None:
    cost = small_case(seed)
    shape = BatchShape(cost, 4, 1, schedule, 1, dp)
    if not shape.kinds:
        pytest.skip("no kind fits")
    run = search_module._Search(cost, SearchOptions(4, top_k=10**6))
    compared = 0
    for top in (shape.w_max, (shape.w_floor + shape.w_max) / 2):  # a second grid: built anew
        shape.build_grid(top, 64)
        nodes, at = [suffixes.root_node(shape)], 0
        while at < min(len(nodes), 12):  # the root, its children and some of theirs
            node, at = nodes[at], at + 1
            for _, kind, count in run._options(shape, node):
                if kind >= 0:
                    links = run._block_links(shape, node, kind, count)
                    nodes.append(node.child(shape, kind, count, links))
        for node in nodes:
            room, need = shape.positions - node.position, search_module._need(shape, node)
            for t_index, chip_type in enumerate(shape.types):
                chip = option_columns.chip_columns(shape, chip_type, node.lead, room)
                if not node.mask >> t_index & 1 or chip is None:
                    continue
                fixed = run._fixed(shape, node)
                kept = np.array([b for b, _, _ in run._bounds(shape, node, fixed, need, chip)])
                assert np.array_equal(kept, plain_bounds(shape, node, fixed, need, chip, INF))
                cutoff = float(np.median(kept[np.isfinite(kept)])) if np.isfinite(kept).any() \
                    else INF  # some columns pruned: the coupled sync on the others only
                needs, edges, links, syncs = chip.terms(shape, node, need, chip_mask(
                    shape, node, chip))
                terms: list[np.ndarray] = []
                plain_bounds(shape, node, fixed, need, chip, INF, terms)
                for value, expected in zip((needs, edges, links, syncs), terms, strict=True):
                    assert np.array_equal(value, expected), (node.suffix, chip_type)
                grouped = shape.bound(list(fixed) + chip.parts, chip_mask(shape, node, chip),
                                      chip.leads, links, edges + chip.rise, needs, syncs,
                                      shape.block_rates(node.suffix) + chip.rates, cutoff,
                                      search_module._fronts(shape, chip.closing,
                                                            chip_mask(shape, node, chip)))
                plain = plain_bounds(shape, node, fixed, need, chip, cutoff)
                assert np.array_equal(grouped, plain), (node.suffix, chip_type)
                compared += len(kept)
    assert compared > 0


def chip_mask(shape: BatchShape, node, chip) -> int:
    """The types left unused in front of ``chip``'s blocks."""
    return node.mask & ~(1 << shape.types.index(shape.kinds[chip.columns[0][0]].chip))


def test_columns_are_kept_per_grid() -> None:
    """The same columns object for the same (type, lead, room) on one grid, new ones (with the
    new grid's blocks) once the grid changes."""
    cost = small_case(0)
    shape = BatchShape(cost, 4, 1, "1f1b", 1, 1)
    shape.build_grid(shape.w_max, 64)
    chip = shape.types[0]
    first = option_columns.chip_columns(shape, chip, 0, shape.positions)
    assert option_columns.chip_columns(shape, chip, 0, shape.positions) is first
    shape.build_grid((shape.w_floor + shape.w_max) / 2, 64)
    second = option_columns.chip_columns(shape, chip, 0, shape.positions)
    assert second is not first
    kind, count = second.columns[0]
    assert np.array_equal(second.parts[0][1][:, : len(count)], shape.block(kind, 0, count))


def test_lead_tables_are_kept_per_read_only_leads_and_grid() -> None:
    """A table gathered at read-only leads is built once per array and grid; other leads of
    the same length, writeable leads and a new grid build it again."""
    cost = small_case(0)
    shape = BatchShape(cost, 4, 1, "1f1b", 1, 1)
    shape.build_grid(shape.w_max, 64)
    built: list[int] = []

    def gather(leads: np.ndarray) -> np.ndarray:
        return lead_cache.at_leads(shape, leads, "test", lambda: built.append(1) or leads * 2)

    one, two = np.array([1, 2]), np.array([3, 4])
    one.setflags(write=False)
    two.setflags(write=False)
    assert np.array_equal(gather(one), [2, 4]) and np.array_equal(gather(one), [2, 4])
    assert np.array_equal(gather(two), [6, 8]) and len(built) == 2
    gather(np.array([1, 2]))
    gather(np.array([1, 2]))
    assert len(built) == 4  # writeable: not kept
    shape.build_grid((shape.w_floor + shape.w_max) / 2, 64)
    gather(one)
    assert len(built) == 5
