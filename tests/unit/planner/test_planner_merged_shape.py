"""Stage kinds merged across their EP degrees (``megatron_h2/planner/merged_shape.py``): every
table of a merged kind bounds each of its EP degrees' from the optimistic side, its bounds are
at most theirs, and the search over merged kinds finds the plans of the search over every kind.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_h2.config import ModelConfig
from megatron_h2.planner import CostModel
from megatron_h2.planner.bounds import BatchShape
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.cost_model import CostConfig
from megatron_h2.planner.merged_shape import MergedShape
from megatron_h2.planner.search import SearchOptions, search

LLAMA = {"swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
         "add_bias_linear": False, "untie_embeddings_and_output_weights": True}


def moe_model(freq: int | list[int] = 1, experts: int = 8, topk: int = 2) -> ModelConfig:
    return ModelConfig(num_layers=6, hidden_size=64, ffn_hidden_size=128,
                       num_attention_heads=4, seq_length=64, vocab_size=256,
                       num_experts=experts, moe_router_topk=topk, moe_layer_freq=freq,
                       moe_ffn_hidden_size=96, **LLAMA)  # type: ignore[arg-type]


def chip(name: str, count: int, tflops: float, memory_mib: float) -> ChipType:
    return ChipType(name, "cpu", count, 2, tflops, memory_mib / 1024, 8.0, 1.0)


CLUSTER = Cluster((chip("big", 4, 0.3, 8.0), chip("fast", 8, 1.0, 2.0)), 1.0)
"""Memory tight enough that the best plans shard the experts of the fast chips (EP 2)."""


def _cost(freq: int | list[int] = 1) -> CostModel:
    return CostModel(CLUSTER, moe_model(freq), CostConfig(use_distributed_optimizer=True))


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
@pytest.mark.parametrize("dp", [4, None])
def test_merged_tables_relax_every_ep_degree(schedule, dp):
    shape = MergedShape(_cost(), 16, 1, schedule, 1, dp)
    exact = shape.exact
    assert len(shape.kinds) < len(exact.kinds)  # some (chip, TP, DP) has several EP degrees
    assert max(len(group) for group in shape.members) > 1
    for kind, group in enumerate(shape.members):
        for member in group:
            k, e = shape.kinds[kind], exact.kinds[member]
            assert (k.chip, k.tp, k.dp, k.max_stages) == (e.chip, e.tp, e.dp, e.max_stages)
            assert np.all(shape.unit[kind] <= exact.unit[member])
            assert np.all(shape.mem_caps[kind] >= exact.mem_caps[member])
            for name in ("fill_unit", "head_need", "embedding_need", "head_time",
                         "embedding_time", "sync_one", "head_tail"):
                assert getattr(shape, name)[kind] <= getattr(exact, name)[member], name
            assert shape.sync_inverse[kind] >= exact.sync_inverse[member]
            for stage in range(3):
                caps, own = shape.mode_caps(kind, 3, stage, 2 - stage), exact.mode_caps(
                    member, 3, stage, 2 - stage)
                assert all(a >= b for a, b in zip(caps, own))
    # the root bound of the merged kinds is at most the exact kinds' (a relaxation)
    plain = BatchShape(_cost(), 16, 1, schedule, 1, dp)
    assert shape.root_bound() <= plain.root_bound() * (1 + 1e-12)


def test_a_closed_merged_pipeline_expands_into_every_ep_choice():
    shape = MergedShape(_cost(), 16, 1, "1f1b", 1, 4)
    big = next(i for i, k in enumerate(shape.kinds) if k.name == "big" and k.tp == 1)
    fast = next(i for i, k in enumerate(shape.kinds) if k.name == "fast" and k.tp == 2)
    suffixes = shape.exact_suffixes(((big, 1), (fast, 1)))
    assert len(suffixes) == len(shape.members[big]) * len(shape.members[fast]) == 9  # EP 1, 2, 4
    eps = {tuple(shape.exact.kinds[k].ep for k, _ in suffix) for suffix in suffixes}
    assert eps == {(a, b) for a in (1, 2, 4) for b in (1, 2, 4)}
    assert all(count == 1 for suffix in suffixes for _, count in suffix)


@pytest.mark.parametrize("freq", [1, [0, 1, 1, 0, 1, 1]])
def test_merged_search_finds_the_plans_of_the_search_over_every_kind(freq):
    """Same top plans (step times and stages, EP included) with and without merging."""
    cost = _cost(freq)
    results = [
        search(cost, SearchOptions(global_batch_size=16, top_k=4, max_micro_batch_size=2,
                                   max_virtual_stages=2, merge_ep=merge))
        for merge in (True, False)
    ]
    assert all(r.stats.exhaustive for r in results)
    merged, plain = ([c.estimate.step_time_s for c in r.candidates] for r in results)
    assert merged == pytest.approx(plain, rel=1e-12)
    assert results[0].best.plan == results[1].best.plan
    assert any(s.expert_model_parallel_size > 1 for s in results[0].best.plan.stages)
