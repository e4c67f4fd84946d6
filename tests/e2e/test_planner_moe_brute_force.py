"""The search against brute force on mixture-of-experts models: same plan space, same cost
function, independent enumeration.

The enumerator lists every plan of the planner's space for small MoE models on two chip types:
micro-batch size; per chip type unused or a TP degree, a DP degree, a stage count and an EP
degree (dividing its DP degree and the experts), all its chips when the used types' DP degrees
differ; every order of the used types; 1f1b, zero-bubble and (one DP degree, every layer alike)
interleaved V = 2; every layer split with each stage's fastest recompute mode that fits (the
stage's own estimate, by the layers it holds), and asks ``CostModel.evaluate`` for the plan's
step time.
"""

from __future__ import annotations

import itertools

import pytest

from megatron_h2.config import RECOMPUTE_MODES, ModelConfig
from megatron_h2.plan.schema import ChipSpec, HeteroPlan, StageSpec
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.cost_model import CostConfig, CostModel, replica_warmups
from megatron_h2.planner.merged_shape import MergedShape
from megatron_h2.planner.search import SearchOptions, search

LLAMA = {"swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
         "add_bias_linear": False, "untie_embeddings_and_output_weights": True}


def model(freq: int | list[int], experts: int = 4) -> ModelConfig:
    return ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       seq_length=64, vocab_size=256, num_experts=experts, moe_router_topk=2,
                       moe_ffn_hidden_size=96, moe_layer_freq=freq, **LLAMA)  # type: ignore[arg-type]


def chip(name: str, count: int, tflops: float, memory_mib: float) -> ChipType:
    return ChipType(name, "cpu", count, 2, tflops, memory_mib / 1024, 8.0, 1.0)


def compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    return [tuple(b - a for a, b in zip((0, *cuts), (*cuts, total)))
            for cuts in itertools.combinations(range(1, total), parts - 1)]


def brute_force(cost: CostModel, gbs: int, sizes: list[int]) -> float:
    """The least step time over the space (module docstring)."""
    m_cfg, best = cost.model, float("inf")
    mixed = len(set(cost.layer_is_moe)) > 1
    specs = {c.name: ChipSpec(c.device) for c in cost.cluster.chips}
    for mbs in sizes:
        total = gbs // mbs
        choices = [[None] + [
            (c.name, t, d, n, e)
            for t in c.tensor_parallel_options(m_cfg.num_attention_heads, m_cfg.num_query_groups)
            for d in range(1, c.count + 1) if total % d == 0
            for n in range(1, c.count // (t * d) + 1)
            for e in range(1, d + 1) if d % e == 0 and m_cfg.num_experts % e == 0
        ] for c in cost.cluster.chips]
        for combo in itertools.product(*choices):
            used = [c for c in combo if c]
            degrees = {d for _, _, d, _, _ in used}
            if len(degrees) > 1 and any(t * d * n != cost.cluster.chip(name).count
                                        for name, t, d, n, _ in used):
                continue
            for order in itertools.permutations(used):
                stages = [(name, t, d, e) for name, t, d, n, e in order for _ in range(n)]
                if not stages or len(stages) > m_cfg.num_layers:
                    continue
                variants = [("1f1b", 1)] + ([("zero-bubble", 1)] if len(stages) > 1 else [])
                if (not mixed and len(degrees) == 1 and len(stages) > 1
                        and (total // stages[0][2]) % len(stages) == 0):
                    variants.append(("interleaved", 2))
                for schedule, v in variants:
                    best = min(best, _best_split(cost, stages, schedule, v, mbs, gbs, specs))
    return best


def _best_split(cost, stages, schedule, v, mbs, gbs, specs) -> float:  # type: ignore[no-untyped-def]
    p, layers = len(stages), cost.model.num_layers
    dps = [d for _, _, d, _ in stages]
    uniform = len(set(dps)) == 1
    total = gbs // mbs
    warmups = replica_warmups(schedule, dps, v, total)
    best = float("inf")
    if layers % v:
        return best
    for units in compositions(layers // v, p):
        split = [u * v for u in units]
        chosen = []
        for index, ((name, t, d, e), n) in enumerate(zip(stages, split)):
            chunk = (n // v,) * v if v > 1 else ()
            for mode in RECOMPUTE_MODES:  # the fastest that fits
                spec = StageSpec(name, t, n, mode, chunk, None if uniform else d,
                                 expert_model_parallel_size=e)
                trial = [*chosen, spec] + [StageSpec(nm, tt, k, "full", (k // v,) * v if v > 1
                                                     else (), None if uniform else dd,
                                                     expert_model_parallel_size=ee)
                                           for (nm, tt, dd, ee), k in
                                           zip(stages[index + 1:], split[index + 1:])]
                plan = HeteroPlan(dps[0], mbs, gbs, specs, trial, schedule=schedule)
                ranges = plan.chunk_layer_ranges()[index]
                est = cost.stage_estimate(spec, index, p, total // d, mbs, d, schedule,
                                          warmups[index], ranges)
                if est.fits:
                    chosen.append(spec)
                    break
            else:
                break
        if len(chosen) == p:
            plan = HeteroPlan(dps[0], mbs, gbs, specs, chosen, schedule=schedule)
            estimate = cost.evaluate(plan)
            assert estimate.fits
            best = min(best, estimate.step_time_s)
    return best


CLUSTER = Cluster((chip("fast", 4, 1.0, 2.0), chip("big", 2, 0.3, 8.0)), 0.5)


@pytest.mark.parametrize("freq", [1, [0, 1, 1, 1], [1, 0, 0, 1]])
@pytest.mark.parametrize("distributed", [False, True])
def test_search_finds_the_brute_force_optimum_of_a_moe_model(freq, distributed):
    cost = CostModel(CLUSTER, model(freq), CostConfig(use_distributed_optimizer=distributed))
    options = SearchOptions(global_batch_size=4, top_k=1, max_micro_batch_size=2,
                            max_virtual_stages=2)
    expected = brute_force(cost, 4, options.micro_batch_candidates())
    result = search(cost, options)
    assert result.stats.exhaustive
    assert result.best.estimate.step_time_s == pytest.approx(expected, rel=1e-9)


def test_the_cases_exercise_expert_parallelism_and_both_chip_types():
    """...and the search's merged kinds (several EP degrees per chip type, TP and DP), which
    the brute-force test above runs with (``SearchOptions.merge_ep`` is on by default)."""
    assert SearchOptions(global_batch_size=4).merge_ep
    merged = MergedShape(CostModel(CLUSTER, model(1)), 4, 1, "1f1b", 1, None)
    assert max(len(group) for group in merged.members) > 1
    seen_ep, mixed = set(), False
    for freq in (1, [0, 1, 1, 1]):
        cost = CostModel(CLUSTER, model(freq), CostConfig(use_distributed_optimizer=True))
        result = search(cost, SearchOptions(global_batch_size=4, top_k=5, max_micro_batch_size=2,
                                            max_virtual_stages=2))
        for cand in result.candidates:
            seen_ep |= {s.expert_model_parallel_size for s in cand.plan.stages}
            mixed |= len({s.chip for s in cand.plan.stages}) > 1
    assert len(seen_ep) > 1 and mixed
