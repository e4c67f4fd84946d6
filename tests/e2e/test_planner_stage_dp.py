"""A plan the planner writes with per-chip-type DP degrees (tests/unit/planner/
test_planner_stage_dp.py) trains on forked ranks with one process's losses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.dist_utils import assert_losses_close, losses, tiny_model_flags
from tests.helpers.fork_run import fork_run
from tests.unit.planner.test_planner_stage_dp import planned


@pytest.mark.e2e
def test_planned_per_type_dp_plan_trains_like_one_process(
    tmp_path: Path, corpus: str, tiny_reference: dict[int, float]
) -> None:
    path, plan, _ = planned(tmp_path)
    out = tmp_path / "log.jsonl"
    proc = fork_run(
        plan.world_size,
        [*tiny_model_flags(), "--data-path", corpus, "--hetero-plan", path,
         "--log-jsonl", str(out)],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_losses_close(losses(out), tiny_reference)
