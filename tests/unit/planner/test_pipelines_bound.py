"""The lower bound over plans of data-parallel pipelines, the one time limit both searches share,
and what the planner prints of them (megatron_h2.planner.pipelines_search, pipelines_report)."""

from dataclasses import replace

import pytest

from megatron_h2.planner.cluster import Cluster
from megatron_h2.planner.cost_model import CostConfig, CostModel
from megatron_h2.planner.model_input import model_from_dict
from megatron_h2.planner.pipelines_report import Choice, bound_text, pipelines_why
from megatron_h2.planner.pipelines_search import lower_bound_s, search_pipelines
from megatron_h2.planner.profile import ProfileTable
from megatron_h2.planner.search import SearchOptions, search

CHIP = {"device": "cpu", "count": 2, "chips_per_node": 1, "tflops_bf16": 1, "memory_gib": 8,
        "intra_node_gb_per_s": 100, "inter_node_gb_per_s": 100}
MODEL = model_from_dict({"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128,
                         "num_attention_heads": 4, "seq_length": 32,
                         "max_position_embeddings": 32, "vocab_size": 256})
ROW = {"layer_forward_ms": 10.0, "layer_backward_ms": 20.0, "embedding_forward_ms": 1.0,
       "embedding_backward_ms": 2.0, "head_forward_ms": 5.0, "head_backward_ms": 10.0}


def cost(host_cores: float | None = None) -> CostModel:
    """A: 2 chips; B: 1 chip twice as slow (the same profile, emulate_slowdown 2)."""
    data = {"chips": {"A": dict(CHIP), "B": dict(CHIP, count=1, emulate_slowdown=2.0)},
            "cross_chip_gb_per_s": 100}
    if host_cores is not None:
        data["host_cores"] = host_cores
    profile = ProfileTable.from_dict({"chips": {n: {"micro_batch_sizes": {1: ROW}}
                                                for n in ("A", "B")}})
    return CostModel(Cluster.from_dict(data), MODEL, CostConfig(), profile)


def test_rate_bound_is_the_chips_summed_rate():
    whole = 4 * 0.030 + 0.003 + 0.015  # one micro-batch on one chip of A
    rate = 2 / whole + 1 / (2 * whole)
    options = SearchOptions(8, 1, (1,))
    assert lower_bound_s(cost(), options) == pytest.approx(8 / rate)
    # with host_cores: at least every pass's CPU time (no slowdown) over the cores
    assert lower_bound_s(cost(0.5), options) == pytest.approx(8 * whole / 0.5)
    # the least over the micro-batch sizes (2 is scaled linearly from 1: the same bound)
    assert lower_bound_s(cost(), SearchOptions(8, 1, (1, 2))) == pytest.approx(8 / rate)


def test_no_time_left_searches_nothing_and_says_so():
    options = SearchOptions(8, 1, (1,))
    result = search_pipelines(cost(), options, 0.0)
    assert result.best is None and not result.exhaustive and result.searches == 0
    assert "time limit was spent" in result.reason
    assert result.lower_bound_s == pytest.approx(lower_bound_s(cost(), options))
    choice = Choice(search(cost(), options), result)
    (line,) = pipelines_why(choice)
    assert "not searched" in line and "proven within" in line


def test_exhaustive_search_bounds_by_its_splits_and_the_report_says_what_is_proven():
    options = SearchOptions(8, 1, (1,))
    result = search_pipelines(cost(), options)
    assert result.exhaustive and result.best is not None
    rate = lower_bound_s(cost(), options)
    assert rate <= result.lower_bound_s <= result.best.estimate.step_time_s
    one = search(cost(), options)
    choice = Choice(one, result)
    text = bound_text(choice)
    chosen = min(one.best.estimate.step_time_s, result.best.estimate.step_time_s)
    if result.lower_bound_s >= chosen * (1 - 1e-9):
        assert text.startswith("proven: no plan of data-parallel pipelines is faster")
    else:
        gap = 100 * (chosen / result.lower_bound_s - 1)
        assert f"proven within {gap:.1f}%" in text
    assert any(text in line for line in pipelines_why(choice))


def test_search_with_a_cutoff_finds_the_best_below_it_or_proves_there_is_none():
    """The cutoff the pipelines search gives each pipeline's search (SearchOptions.cutoff_s)."""
    options = SearchOptions(8, 1, (1,))
    best = search(cost(), options).best.estimate.step_time_s
    above = search(cost(), replace(options, cutoff_s=1.01 * best))
    assert above.stats.exhaustive and above.best.estimate.step_time_s == pytest.approx(best)
    below = search(cost(), replace(options, cutoff_s=0.99 * best))
    assert below.candidates == () and below.stats.exhaustive
    assert below.stats.nodes <= above.stats.nodes  # pruned sooner, not searched further


def test_pipelines_search_with_a_step_to_beat_cuts_every_split_it_cannot_beat():
    options = SearchOptions(8, 1, (1,))
    free = search_pipelines(cost(), options)
    assert free.best is not None and free.splits_cut < free.splits_tried
    step = free.best.estimate.step_time_s
    beaten = search_pipelines(cost(), options, incumbent_s=0.99 * step)
    assert beaten.best is None and beaten.exhaustive
    assert beaten.splits_cut == beaten.splits_tried == free.splits_tried
    assert beaten.searches <= free.searches
    assert 0.99 * step * (1 - 1e-9) <= beaten.lower_bound_s <= step * (1 + 1e-9)
    assert "none beats one pipeline for all" in beaten.reason
