"""The search's lower bounds (``BatchShape`` with ``_Search._options``) against the exact split
of every pipeline structure below them, on small random clusters: every option's bound is at
most the step time of every closed pipeline it leads to, and the bounds see the stages that hold
the head (its steady term, and under zero-bubble its deferred weight gradients), the first
stage's sync with the embedding, the links of the stages still to come, at a shape's root
the fill of the cheapest memory capacity (and of the cheapest capacity at each probe), and the
end-of-step term coupled with the steady term (``least_sync``), and closing with an option's
block in front bounded apart from an unused type in front (``search._fronts``)."""

from __future__ import annotations

import importlib
import random
from typing import Any

import numpy as np
import pytest

from megatron_h2.planner import own_root, suffixes
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.cost_model import CostConfig, CostModel, zero_bubble_share
from megatron_h2.planner.model_input import model_from_dict
from megatron_h2.planner.partition import INF
from megatron_h2.planner.search_options import SearchOptions
from megatron_h2.planner.structure import solve_structure
from megatron_h2.planner.sync_coupling import least_sync
from tests.helpers.planner_models import LLAMA_KEYS, planner_model

search_module = importlib.import_module("megatron_h2.planner.search")


def small_case(seed: int, vocab: int = 1000) -> CostModel:
    """Two or three chip types, at most 12 chips, tight memory (deterministic per seed)."""
    rng = random.Random(seed)
    chips = tuple(
        ChipType(
            "ABC"[index], "cpu", rng.choice([2, 4]), rng.choice([1, 2]), rng.uniform(0.05, 0.5),
            rng.uniform(3, 12) / 1024, rng.uniform(1, 10), rng.uniform(0.2, 2),
        )
        for index in range(rng.choice([2, 3]))
    )  # fmt: skip
    model = planner_model(rng.choice([4, 5, 6]), 64, 176, 4, 128, vocab, 2)
    config = CostConfig(use_distributed_optimizer=rng.random() < 0.5)
    return CostModel(Cluster(chips, rng.uniform(0.1, 1)), model, config)


def exact_below(run, shape: BatchShape, node, checked: list[int]) -> float:
    """The least exact step time of the closed pipelines below ``node``, asserting on the way
    that no option's bound exceeds the exact step time of any pipeline it leads to."""
    best = INF
    for bound, kind, count in run._options(shape, node):
        if kind < 0:
            split = solve_structure(shape, node.suffix)
            value = split.step_time_s if split is not None else INF
        else:
            links = run._block_links(shape, node, kind, count)
            value = exact_below(run, shape, node.child(shape, kind, count, links), checked)
        if value < INF:
            assert bound <= value * (1 + 1e-9), (node.suffix, kind, count, bound, value)
            checked[0] += 1
        best = min(best, value)
    return best


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
@pytest.mark.parametrize("dp", [1, 2, None])  # one DP degree, and each type its own
@pytest.mark.parametrize("seed", range(3))
def test_bounds_never_exceed_the_exact_split(seed: int, dp: int | None, schedule: str) -> None:
    checked = check_every_structure(small_case(seed), dp, schedule)
    assert checked > 0 or dp is None  # some pipelines fit (own DP may leave none)


def check_every_structure(cost: CostModel, dp: int | None, schedule: str) -> int:
    """Check every bound and each shape's root bound of micro-batch sizes 1 and 2 against the
    exact splits below them; how many bounds were checked."""
    run = search_module._Search(cost, SearchOptions(8, top_k=10**6))
    checked = [0]
    for mbs in (1, 2):
        shape = BatchShape(cost, 8, mbs, schedule, 1, dp)
        if not shape.kinds:
            continue
        shape.build_grid(shape.w_max, 64)
        least = exact_below(run, shape, suffixes.root_node(shape), checked)
        assert shape.root_bound() <= least * (1 + 1e-9)
    return checked[0]


def test_a_one_stage_zero_bubble_pipeline_stays_above_its_bounds() -> None:
    """Under zero-bubble the one stage of a one-stage pipeline defers fewer weight-gradient
    inputs than the last stage of a longer one, so it may hold more layers: here (micro-batch 2,
    DP 2) one stage of a kind holds all 6 layers where the last of two stages holds at most 5,
    and the close-here bound of that one-stage suffix stays at most its exact step time."""
    cost = small_case(9)
    shape = BatchShape(cost, 8, 2, "zero-bubble", 1, 2)
    assert shape.closes(1)
    split = solve_structure(shape, ((0, 1),))
    assert split is not None and split.layers == (6,)  # the case this test is about
    assert check_every_structure(cost, 2, "zero-bubble") > 0


def test_the_head_stage_bounds_the_steady_term_and_the_tail() -> None:
    """A large vocabulary: the last stage's head weighs more than a layer. Below a suffix, the
    largest steady term is at least (m - 1) x (head + one layer) on its last stage's kind, and
    under zero-bubble the end-of-step term at least (1 + b) x the head's and one layer's weight
    gradients."""
    cost = small_case(1, vocab=16000)
    for schedule in ("1f1b", "zero-bubble"):
        shape = BatchShape(cost, 8, 1, schedule, 1, 1)
        shape.build_grid(shape.w_max, 64)
        for kind, k in enumerate(shape.kinds):
            costs, node = k.costs, suffixes.root_node(shape)
            head = costs.head_forward + costs.head_backward
            assert head > costs.layer_time(0)  # the case this test is about
            node = node.child(shape, kind, 1, 0.0)
            steady = (k.micro_batches - 1) * (head + costs.layer_time(0))
            assert search_module._need(shape, node) >= steady * (1 - 1e-12) > 0
            if schedule == "zero-bubble":
                share = 1 + zero_bubble_share(max(shape.positions, 2), k.micro_batches)
                grads = share * (costs.head_weight_grad + costs.layer_weight_grad)
                assert shape.sync_bound(node.suffix, 0, kind) >= grads * (1 - 1e-12)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
@pytest.mark.parametrize("dp", [2, None])
@pytest.mark.parametrize("seed", [0, 3])
def test_bounds_with_a_large_vocabulary_never_exceed_the_exact_split(
    seed: int, dp: int | None, schedule: str
) -> None:
    """With DP syncs and an embedding that weighs more than a layer, the first stage's sync
    (embedding and a layer), the links of new stages and the root bound's fill, links and
    end-of-step floor stay below every exact split."""
    cost = small_case(seed, vocab=3000)  # the embedding: three times a layer's parameters
    assert check_every_structure(cost, dp, schedule) > 0


def test_the_first_stage_bounds_the_sync_with_the_embedding() -> None:
    """The end-of-step term of a closed pipeline is at least its first stage's DP sync with the
    embedding and a layer, also where its last stage's (with the head) is smaller; with chip
    types still unused, at least the least of that over the front block's kind and every kind
    of those types."""
    cost = small_case(0, vocab=3000)
    shape = BatchShape(cost, 8, 1, "1f1b", 1, 2)
    pairs = 0
    for front, k in enumerate(shape.kinds):
        first = k.costs.dp_sync(1, True, False)
        assert first > k.costs.dp_sync(1, False, False) > 0  # the embedding weighs
        for last, other in enumerate(shape.kinds):
            if other.chip == k.chip or other.costs.dp_sync(1, False, True) >= first:
                continue
            pairs += 1
            blocks = ((front, 1), (last, 1))
            assert shape.sync_bound(blocks, 0, last, front) >= first * (1 - 1e-12)
        mask = (1 << len(shape.types)) - 1 & ~(1 << shape.types.index(k.chip))
        others = [o.costs.dp_sync(1, True, False) for o in shape.kinds if o.chip != k.chip]
        bound = shape.sync_bound(((front, 1),), mask, front, front)
        assert bound >= min([first, *others]) * (1 - 1e-12)
    assert pairs > 0  # the case this test is about


def test_new_stages_of_unused_types_count_their_links() -> None:
    """Layers that the placed blocks cannot hold need new stages, each sending over a link:
    some option's bound is higher with the links than with them free (and, by the tests above,
    never above the exact split)."""
    cost = small_case(0)
    run = search_module._Search(cost, SearchOptions(8, top_k=10**6))
    shape = BatchShape(cost, 8, 1, "1f1b", 1, 1)
    shape.build_grid(shape.w_max, 64)
    node = suffixes.root_node(shape)
    kind, count = next((k, c) for b, k, c in run._options(shape, node) if k >= 0)
    child = node.child(shape, kind, count, run._block_links(shape, node, kind, count))
    with_links = [bound for bound, k, _ in run._options(shape, child) if k >= 0]
    shape.type_link = dict.fromkeys(shape.type_link, 0.0)
    shape.build_grid(shape.w_max * 0.999, 64)  # a fresh grid: no cached tables
    shape.build_grid(shape.w_max, 64)
    free = [bound for bound, k, _ in run._options(shape, child) if k >= 0]
    assert max(a - b for a, b in zip(sorted(with_links), sorted(free))) > 0


def test_the_root_bound_counts_the_fill() -> None:
    """A shape's root bound counts the layers filled into the cheapest memory capacity (with the
    embedding's and head's fill) and the first and last stages' end-of-step terms: above the
    slowest stage's terms alone (and, by the tests above, never above the exact split)."""
    cost = small_case(0, vocab=3000)
    for schedule in ("1f1b", "zero-bubble"):
        shape = BatchShape(cost, 8, 1, schedule, 1, 2)
        w = max(shape.w_floor, float(shape.head_need.min()))
        alone = shape.steady * w + shape._own_work(w)
        assert shape.root_fill > shape.layers * float(shape.fill_unit.min()) > 0
        assert shape.root_bound() > alone + shape.root_links


def moe_case(seed: int, pattern: list[int]) -> CostModel:
    """:func:`small_case`'s clusters with a small model whose layers are dense (0) or MoE (1)
    by ``pattern`` (4 experts, top-2)."""
    cluster = small_case(seed).cluster
    data = {"num_layers": len(pattern), "hidden_size": 64, "ffn_hidden_size": 176,
            "num_attention_heads": 4, "seq_length": 128, "vocab_size": 1000, "num_experts": 4,
            "moe_router_topk": 2, "moe_ffn_hidden_size": 96, "moe_layer_freq": pattern,
            **LLAMA_KEYS}
    config = CostConfig(use_distributed_optimizer=random.Random(seed).random() < 0.5)
    return CostModel(cluster, model_from_dict(data), config)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
@pytest.mark.parametrize("dp", [1, None])
@pytest.mark.parametrize("pattern", [[0, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0], [0, 0, 1, 1, 1]])
@pytest.mark.parametrize("seed", [0])
def test_bounds_of_mixed_dense_and_moe_layers_never_exceed_the_exact_range_split(
    seed: int, pattern: list[int], dp: int | None, schedule: str
) -> None:
    """Dense and MoE layers mixed: the bound costs (``MoECosts.bound_costs``) and every bound
    built on them against the exact split over layer ranges of every structure below."""
    checked = check_every_structure(moe_case(seed, pattern), dp, schedule)
    assert checked > 0 or dp is None


def test_least_sync_is_the_least_sync_that_holds_the_layers() -> None:
    """``least_sync`` against bisection: the least ``Z`` with ``sum min(a_i, Z r_i) >= L``
    (groups without sync, ``r = inf``, hold their capacity at any ``Z``)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        groups = int(rng.integers(1, 6))
        caps = [rng.integers(0, 6, size=(2, 3)).astype(float) for _ in range(groups)]
        rates = [np.inf if rng.random() < 0.2 else rng.uniform(0.1, 5, size=3)
                 for _ in range(groups)]  # fmt: skip
        layers = float(rng.integers(1, 16))
        least = least_sync(caps, rates, layers)
        for i, j in np.ndindex(2, 3):
            groups_ij = [(c[i, j], r if np.isscalar(r) else r[j]) for c, r in zip(caps, rates)]
            if _held(groups_ij, 1e9) < layers:
                continue  # never fits: any value
            low, high = 0.0, 1e9
            for _ in range(200):
                middle = (low + high) / 2
                low, high = (low, middle) if _held(groups_ij, middle) >= layers else (middle, high)
            assert least[i, j] == pytest.approx(high, rel=1e-9, abs=1e-9)


def _held(groups: list[tuple[float, float]], z: float) -> float:
    """Layers that groups of (capacity, rate) hold with the largest end-of-step term ``z``."""
    return sum(cap if np.isinf(rate) else min(cap, z * rate) for cap, rate in groups)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_the_sync_coupled_with_the_steady_term_raises_the_bounds(schedule: str) -> None:
    """Where few layers fit per stage at a probe, the end-of-step term is at least what the
    stages that do hold them sync: some option's bound and the root bound are higher with the
    coupling than without it (and, by the tests above, never above the exact split)."""
    gains: list[float] = []
    for run, shape, child in first_children(small_case(0), schedule, 4):
        coupled = sorted(bound for bound, _, _ in run._options(shape, child))
        shape.coupled_sync = lambda *args: None  # the bound without the coupling
        apart = sorted(bound for bound, _, _ in run._options(shape, child))
        del shape.coupled_sync
        gains += [a - b for a, b in zip(coupled, apart) if a < INF]
    assert min(gains) >= 0 and max(gains) > 0
    uncoupled = shape._root_terms(
        max(shape.w_floor, float(shape.head_need.min())), shape.tail_floor, shape.root_links
    )
    assert shape.root_bound() > uncoupled


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
@pytest.mark.parametrize("dp", [2, None])
def test_the_root_bound_fills_the_layers_at_each_probe(schedule: str, dp: int | None) -> None:
    """Where the slowest steady term is at most a probe, every stage holds at most its
    capacity there (time caps too), so the summed fill is at least the layers filled into the
    cheapest capacity at that probe: the root bound is higher with that fill than with the
    memory-only fill at every probe (and, by the tests above, never above the exact split)."""
    shape = BatchShape(small_case(0), 8, 1, schedule, 1, dp)
    coupled = shape.root_bound()
    shape._segment_fill = lambda most: np.full(most.shape[1], shape.root_fill)
    memory_caps = shape.capacity(np.array([shape.w_max]))  # no time caps
    memory = shape._most_layers(memory_caps)
    joint, uniform = own_root.own_fill_links, own_root.uniform_fill_links  # their knapsacks on
    with pytest.MonkeyPatch.context() as patch:  # the memory caps alone too
        patch.setattr(own_root, "own_fill_links", lambda s, most, *rest: joint(
            s, np.repeat(memory, most.shape[1], axis=1)))
        patch.setattr(own_root, "uniform_fill_links", lambda s, caps, *rest: uniform(
            s, np.repeat(memory_caps, caps.shape[1], axis=1)))
        patch.setattr(own_root, "sync_levels", lambda s: None)
        memory_only = shape._coupled_root()
    terms = shape._root_terms(
        max(shape.w_floor, float(shape.head_need.min())), shape.tail_floor, shape.root_links
    )
    assert coupled > max(float(terms), memory_only) * (1 + 1e-6)


def test_an_option_bounds_closing_and_an_unused_type_in_front_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With chip types still unused, an option's bound is the lesser of closing with its block
    in front (that kind's first-stage end-of-step floor) and an unused type in front (theirs,
    and one more stage's link): some option below a first block is bounded higher than with
    the two mixed, none lower (and, by the tests above, never above the exact split)."""
    gains: list[float] = []
    for run, shape, node in first_children(small_case(0, vocab=3000), "1f1b", 2):
        apart = {(k, c): bound for bound, k, c in run._options(shape, node)}
        with monkeypatch.context() as patch:
            patch.setattr(search_module, "_fronts", lambda *args: None)
            mixed = {(k, c): bound for bound, k, c in run._options(shape, node)}
        gains += [apart[key] - mixed[key] for key in apart if apart[key] < INF]
    assert min(gains) >= -1e-12 and max(gains) > 0


def first_children(cost: CostModel, schedule: str, dp: int) -> list[tuple[Any, BatchShape, Any]]:
    """(search, shape, node) for every first block of the micro-batch-1 shape of ``dp``."""
    run = search_module._Search(cost, SearchOptions(8, top_k=10**6))
    shape = BatchShape(cost, 8, 1, schedule, 1, dp)
    shape.build_grid(shape.w_max, 64)
    root = suffixes.root_node(shape)
    return [
        (run, shape, root.child(shape, kind, count, run._block_links(shape, root, kind, count)))
        for _, kind, count in run._options(shape, root)
        if kind >= 0
    ]
