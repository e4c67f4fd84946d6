"""The plan: what the planner writes and the runtime reads, in plain Python (no torch).

- :mod:`.schema`: :class:`HeteroPlan`, the plan file (chips, stages with their chip type, TP,
  DP, layers and recompute, the schedule, the bridge's transports; or several data-parallel
  pipelines, each with its stages and its share of the global batch), its validation and its
  rank arithmetic (which ranks form each pipeline, stage, TP group and DP group).
- :mod:`.specs`: the parts of a plan: chip type, stage, transport.
- :mod:`.plan_file`: the plan's YAML form, read and written.
- :mod:`.orders`: the pipeline schedules as data: each stage's (and each DP replica's) order of
  forwards and backwards under 1F1B, interleaved 1F1B and zero-bubble, and the replay that
  proves an order cannot hang.
- :mod:`.yaml_io`: reading the YAML files users write (plans, clusters, models, profiles) with
  one-line errors.
"""

from megatron_h2.plan.orders import (
    SCHEDULES,
    Action,
    check_orders,
    replica_order,
    routed_orders,
    schedule_order,
)
from megatron_h2.plan.schema import TRANSPORTS, ChipSpec, HeteroPlan, LinkSpec, StageSpec

__all__ = ["SCHEDULES", "TRANSPORTS", "Action", "ChipSpec", "HeteroPlan", "LinkSpec",
           "StageSpec", "check_orders", "replica_order", "routed_orders", "schedule_order"]
