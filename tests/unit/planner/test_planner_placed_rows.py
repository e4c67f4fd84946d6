"""The placed stages' memory caps of the suffix floors (:mod:`megatron_h2.planner.placed_rows`)
against the exact caps of every place in every pipeline length, and the floors with them
(:func:`megatron_h2.planner.last_floor.node_floor`): never above the exact split below a suffix
(:mod:`tests.unit.planner.test_planner_last_floor` checks that on every suffix), and above the
floors without them on some suffix."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from megatron_h2.planner import last_floor, suffixes
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.placed_rows import PlacedRows, zero_bubble_caps
from megatron_h2.planner.search_options import SearchOptions
from tests.unit.planner.test_planner_bounds import small_case
from tests.unit.planner.test_planner_last_floor import _all_bounds

search_module = importlib.import_module("megatron_h2.planner.search")


@pytest.mark.parametrize("dp", [1, 2, None])
def test_zero_bubble_caps_are_the_exact_caps_of_every_place(dp: int | None) -> None:
    """Every kind, warm-up (own DP degrees: any, beyond the micro-batches too) and place of
    every pipeline length: the closed form is the exact cap of the schedule's held peaks."""
    checked = 0
    for seed in range(6):
        for mbs in (1, 2):
            shape = BatchShape(small_case(seed), 8, mbs, "zero-bubble", 1, dp)
            for kind in range(len(shape.kinds)):
                m = shape.kinds[kind].micro_batches
                table = zero_bubble_caps(shape, kind, m + 3)
                for stages in range(2, shape.positions + 1):
                    for position in range(1, stages):
                        # one DP degree: the warm-up is the place (the schedule's rule)
                        for warmup in range(m + 3) if dp is None else [position]:
                            exact = shape._placed_stage_caps(kind, warmup, position, stages)
                            got = table[min(warmup, m), stages - 1 - position]
                            assert got.tolist() == np.maximum(exact, 0).tolist()
                            checked += 1
    assert checked > 100


def test_placed_units_fall_with_the_pipeline_length() -> None:
    """A placed block holds no more in a longer pipeline, and less in some (the kinds whose
    memory binds somewhere)."""
    fell = 0
    for seed in range(6):
        shape = BatchShape(small_case(seed), 8, 1, "zero-bubble", 1, 1)
        if not shape.kinds or shape.positions < 3:
            continue
        probes = np.geomspace(float(shape.unit.min()), float(shape.w_max), 8)
        rows = PlacedRows(probes, np.full((len(shape.kinds), 8), np.inf))
        every = np.arange(8)
        for kind in range(len(shape.kinds)):
            warmups = np.array([1, 0])
            held = [rows.block_units(shape, kind, warmups, 0, np.full(8, length), every)
                    for length in range(2, shape.positions + 1)]
            if held[0] is None:  # its memory never binds before its time caps: the table's
                continue
            for shorter, longer in zip(held, held[1:]):
                assert (longer <= shorter).all()
                fell += bool((longer < shorter).any())
    assert fell > 0


def test_the_placed_caps_raise_some_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """On some small zero-bubble shape some option is higher with the placed stages' caps and
    the longer pipelines than with the table's caps alone, none lower."""
    monkeypatch.setattr(last_floor, "DEFER", 10**9)
    monkeypatch.setattr(last_floor, "TRIAL", 10**9)
    raised = 0
    for seed in range(8):
        for dp in (1, 2):
            shape = BatchShape(small_case(seed), 8, 1, "zero-bubble", 1, dp)
            if not shape.kinds or not shape.positions:
                continue
            run = search_module._Search(shape.cost, SearchOptions(8, top_k=10**6, cutoff_s=1e9))
            shape.build_grid(shape.w_max, 64)
            shape.tighten()
            last_floor.prepare_last_floors(shape, 1e9)
            after: dict = {}
            _all_bounds(run, shape, suffixes.root_node(shape), after)
            with monkeypatch.context() as patch:
                patch.setattr(PlacedRows, "block_units", lambda *args: None)
                patch.setattr(last_floor, "ROUNDS", 0)
                before: dict = {}
                _all_bounds(run, shape, suffixes.root_node(shape), before)
            assert before.keys() == after.keys()
            assert all(before[key] <= after[key] * (1 + 1e-12) for key in before)
            raised += any(after[key] > before[key] * (1 + 1e-6) for key in before)
    assert raised > 0
