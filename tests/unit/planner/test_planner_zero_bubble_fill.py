"""Zero-bubble's fill with the deferred weight-gradient share of the pipelines below a node
(:mod:`megatron_h2.planner.zero_bubble_fill`): with one micro-batch per replica ``b = 0`` on
every pipeline of two stages or more, and below ``p`` stages ``b <= b(p)``; every option's bound
and each root bound stay below the exact split of every structure below them (few
micro-batches per replica, where the share is below 2), and the share raises the bounds."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_h2.planner import option_columns, suffixes
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.search_options import SearchOptions
from megatron_h2.planner.zero_bubble_fill import _tables, fill_shares, share_rise
from tests.unit.planner.test_planner_bounds import exact_below, search_module, small_case
from tests.unit.planner.test_planner_stage_links import four_types


def check_few_micro_batches(seed: int, batch: int, dp: int | None) -> tuple[int, int]:
    """Every option's bound and the root bounds of zero-bubble shapes of micro-batch size 1
    with ``batch`` micro-batches against the exact splits below them: (bounds checked, options
    whose fill rose)."""
    cost = small_case(seed)
    run = search_module._Search(cost, SearchOptions(batch, top_k=10**6))
    shape = BatchShape(cost, batch, 1, "zero-bubble", 1, dp)
    if not shape.kinds:
        return 0, 0
    shape.build_grid(shape.w_max, 64)
    checked = [0]
    least = exact_below(run, shape, suffixes.root_node(shape), checked)
    assert shape.root_bound() <= least * (1 + 1e-9)
    risen = sum(int(share_rise(shape, p).max() > 0) for p in range(shape.positions + 1))
    return checked[0], risen


@pytest.mark.parametrize("dp", [1, 2, None])
@pytest.mark.parametrize("batch", [2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_zero_bubble_bounds_with_few_micro_batches_never_exceed_the_exact_split(
    seed: int, batch: int, dp: int | None
) -> None:
    checked, _ = check_few_micro_batches(seed, batch, dp)
    assert checked > 0 or dp is None  # some pipelines fit (own DP may leave none)


@pytest.mark.parametrize("make", [small_case, four_types])
def test_the_fewest_stages_never_exceed_those_that_hold_the_layers(make) -> None:
    """Per probe, the fewest stages that :func:`share_rise` takes for every pipeline are at
    most the fewest whose warm-ups ``0 .. p - 1`` hold the layers at the most any kind holds at
    each (one DP degree): under zero-bubble the last stage, warm-up 0, holds two deferred
    inputs and may hold less than the stage in front of it."""
    checked = 0
    for seed in (*range(6), 35, 36):  # four_types 35 and 36 (8 micro-batches of 4): warm-up 0
        cost = make(seed)  # holds less than warm-up 1
        for batch, mbs in ((4, 1), (8, 2), (8, 4), (32, 4)):
            shape = BatchShape(cost, batch, mbs, "zero-bubble", 1, 1)
            if not shape.kinds:
                continue
            shape.build_grid(shape.w_max, 64)
            per_layer, least = _tables(shape)
            if per_layer is None:
                continue
            held = np.diff(shape.prefix, axis=2).max(axis=0).cumsum(axis=1)  # probe x stages
            fits = held >= shape.layers - 1e-9
            fewest = np.where(fits.any(axis=1), fits.argmax(axis=1) + 1, shape.positions)
            assert (least <= np.minimum(fewest, shape.positions)).all(), (seed, batch, mbs)
            checked += 1
    assert checked > 0


def test_one_micro_batch_fills_with_one_share_of_the_weight_gradients() -> None:
    """DP 2 of 2 micro-batches: one per replica, so ``b = 0`` on two stages or more and the
    fill per layer is ``W - G``, not ``W - 2 G``; with more micro-batches it is ``W - 2 G``."""
    cost = small_case(0)
    one = BatchShape(cost, 2, 1, "zero-bubble", 1, 2)
    many = BatchShape(cost, 8, 1, "zero-bubble", 1, 2)
    for shape, share in ((one, 1.0), (many, 2.0)):
        assert fill_shares(shape.schedule, [k.micro_batches for k in shape.kinds]).tolist() == [
            share
        ] * len(shape.kinds)
        for kind, k in enumerate(shape.kinds):
            expected = k.costs.layer_time(0) - share * k.costs.layer_weight_grad
            assert shape.fill_unit[kind] == pytest.approx(expected)
    assert fill_shares("1f1b", [1, 4]).tolist() == [0.0, 0.0]


def test_the_share_falls_with_the_stages_below_a_node() -> None:
    """Two micro-batches per replica: ``b(p) = 1 / (p - 1)``, so pipelines of at least three
    stages fill at least ``(1 - b(p)) G`` more per layer; none under 1F1B."""
    cost = small_case(0)
    shape = BatchShape(cost, 4, 1, "zero-bubble", 1, 2)
    assert shape.positions >= 4  # pipelines of 3 and 4 stages
    shape.build_grid(shape.w_max, 64)
    weight = min(k.costs.layer_weight_grad for k in shape.kinds)
    rises = share_rise(shape, np.arange(shape.positions + 1))
    assert rises.shape == (len(shape.grid), shape.positions + 1)
    for p in range(3, shape.positions + 1):  # at least p stages, more where the caps say so
        assert rises[:, p].min() >= shape.layers * (1 - 1 / (p - 1)) * weight * (1 - 1e-12) > 0
    assert (np.diff(rises, axis=1) >= 0).all()  # more stages, a larger rise
    assert rises[:, :3].min() >= 0
    flat = BatchShape(cost, 4, 1, "1f1b", 1, 2)
    flat.build_grid(flat.w_max, 64)
    assert not share_rise(flat, np.arange(4)).any()
    one = BatchShape(cost, 2, 1, "zero-bubble", 1, 2)  # one micro-batch: b = 0, s = 1
    one.build_grid(one.w_max, 64)
    assert not share_rise(one, np.arange(one.positions + 1)).any()


def test_the_rise_reaches_the_option_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Some option of a two-micro-batch zero-bubble shape is bounded higher with the rise than
    without it (each seed's options, the rise replaced by zeros)."""
    raised = 0
    for seed in range(4):
        cost = small_case(seed)
        shape = BatchShape(cost, 4, 1, "zero-bubble", 1, 2)
        if not shape.kinds:
            continue
        shape.build_grid(shape.w_max, 64)
        run = search_module._Search(cost, SearchOptions(4, top_k=10**6))
        node = suffixes.root_node(shape)
        for _ in range(2):  # two blocks deep along the best options
            kind, count = next((k, c) for _, k, c in run._options(shape, node) if k >= 0)
            node = node.child(shape, kind, count, run._block_links(shape, node, kind, count))
        with_rise = {(k, c): b for b, k, c in run._options(shape, node)}
        with monkeypatch.context() as patch:
            patch.setattr(option_columns, "share_rise",
                          lambda s, p: np.zeros((len(s.grid), np.size(p))))
            patch.delitem(shape.__dict__, "_chip_columns")  # the columns built anew
            without = {(k, c): b for b, k, c in run._options(shape, node)}
        assert all(with_rise[key] >= without[key] for key in without)
        raised += sum(with_rise[key] > without[key] * (1 + 1e-9) for key in without)
    assert raised > 0
