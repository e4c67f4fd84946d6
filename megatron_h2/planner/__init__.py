"""HeteroAuto: plan a model across a heterogeneous cluster (pure Python, numpy and PyYAML).

Typical use::

    from megatron_h2.planner import Cluster, CostConfig, CostModel, SearchOptions, search
    from megatron_h2.planner import model_from_yaml, simulate

    cluster = Cluster.from_yaml("examples/clusters/hetero_1024.yaml")
    model = model_from_yaml("examples/models/llama_100b.yaml")  # a config.ModelConfig
    cost = CostModel(cluster, model, CostConfig(use_distributed_optimizer=True))
    result = search(cost, SearchOptions(global_batch_size=2048, top_k=5))  # every schedule
    best = result.best                      # Candidate(plan: HeteroPlan, estimate: PlanEstimate)
    best.plan.to_yaml("plan.yaml")          # what pretrain_gpt.py --hetero-plan reads
    timeline = simulate(best.plan, cost)    # event-driven step under the plan's schedule
    pipes = search_pipelines(cost, SearchOptions(global_batch_size=2048))  # data-parallel
    estimate = evaluate_plan(cost, plan)    # any plan: one pipeline or several

The command line is ``tools/plan.py`` (:mod:`megatron_h2.planner.cli`); the cluster, model and
profile formats, the cost model and the search are documented in ``docs/planner.md``.
"""

from megatron_h2.plan.orders import check_schedule, stage_order
from megatron_h2.planner.cluster import ChipType, Cluster
from megatron_h2.planner.compare import Comparison, HomogeneousResult, compare_homogeneous
from megatron_h2.planner.cost_model import (
    CostConfig,
    CostModel,
    PlanEstimate,
    StageCosts,
    StageEstimate,
)
from megatron_h2.planner.held_activations import held_states
from megatron_h2.planner.model_input import model_from_dict, model_from_yaml
from megatron_h2.planner.partition import Split, StageSlot, solve_split
from megatron_h2.planner.pipelines_cost import (
    PipelinesEstimate,
    PipelinesSimulation,
    evaluate_plan,
    simulate_plan,
)
from megatron_h2.planner.pipelines_search import (
    PipelinesCandidate,
    PipelinesResult,
    search_pipelines,
)
from megatron_h2.planner.profile import ChipProfile, MeasuredTimes, ProfileTable
from megatron_h2.planner.search import Candidate, SearchOptions, SearchResult, SearchStats, search
from megatron_h2.planner.simulator import (
    Event,
    SimulationResult,
    chrome_trace,
    simulate,
    write_chrome_trace,
    write_timeline_png,
)

__all__ = [
    "Candidate",
    "ChipProfile",
    "ChipType",
    "Cluster",
    "Comparison",
    "CostConfig",
    "CostModel",
    "Event",
    "HomogeneousResult",
    "MeasuredTimes",
    "PipelinesCandidate",
    "PipelinesEstimate",
    "PipelinesResult",
    "PipelinesSimulation",
    "PlanEstimate",
    "ProfileTable",
    "SearchOptions",
    "SearchResult",
    "SearchStats",
    "SimulationResult",
    "Split",
    "StageCosts",
    "StageEstimate",
    "StageSlot",
    "check_schedule",
    "chrome_trace",
    "compare_homogeneous",
    "evaluate_plan",
    "held_states",
    "model_from_dict",
    "model_from_yaml",
    "search",
    "search_pipelines",
    "simulate",
    "simulate_plan",
    "solve_split",
    "stage_order",
    "write_chrome_trace",
    "write_timeline_png",
]
