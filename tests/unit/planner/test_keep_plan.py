"""scripts/demo.sh's re-plan loop keeps the plan its profile was measured as unless the planner's
new best is predicted faster by more than the margin (megatron_h2.commands.keep_plan): plans
whose step is bound by the ranks' CPU work over the host's cores tie whatever their process
count, and following each tie made the loop alternate between five and six processes."""

from __future__ import annotations

import pytest
import yaml

from megatron_h2.commands.keep_plan import keep_current, main
from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import HeteroPlan, StageSpec
from megatron_h2.planner.cluster import Cluster
from megatron_h2.planner.cost_model import CostConfig, CostModel
from megatron_h2.planner.model_input import model_from_dict
from megatron_h2.planner.profile import ProfileTable
from tests.unit.planner.test_emulation_host import CHIPS, CLUSTER, SHAPE, TIMES

SHAPE8 = dict(SHAPE, num_layers=8)


def plan(*stages: tuple[str, int]) -> HeteroPlan:
    """A 1F1B plan of (chip, layers) stages, micro-batch 1, 8 micro-batches."""
    return HeteroPlan(1, 1, 8, CHIPS, [StageSpec(c, 1, n) for c, n in stages])


# the demo's two mixes: one slow process and four fast ones, or two and four
FIVE = plan(("slow", 1), ("fast", 2), ("fast", 2), ("fast", 2), ("fast", 1))
SIX = plan(("slow", 1), ("slow", 1), ("fast", 2), ("fast", 2), ("fast", 1), ("fast", 1))
SIX_UNEVEN = plan(("slow", 2), ("slow", 1), ("fast", 2), ("fast", 1), ("fast", 1), ("fast", 1))


# measured times, 90% of them CPU time, the same for both chip types (the slow one pads with sleep)
ENTRY = {"micro_batch_sizes": TIMES, "optimizer_ns_per_param": 1.0,
         "optimizer_cpu_ns_per_param": 0.9,
         "cpu_micro_batch_sizes": {size: {k: 0.9 * v for k, v in row.items()}
                                   for size, row in TIMES.items()}}
PROFILE = {"chips": {"fast": ENTRY, "slow": ENTRY}}


def cost(host_cores: float | None) -> CostModel:
    data = dict(CLUSTER, host_cores=host_cores) if host_cores else CLUSTER
    return CostModel(Cluster.from_dict(data), model_from_dict(SHAPE8), CostConfig(),
                     ProfileTable.from_dict(PROFILE))


def test_the_rule_keeps_ties_and_small_gains_and_takes_larger_ones():
    assert keep_current(2.0, 2.0, 0.05)  # a tie
    assert keep_current(2.0, 1.95, 0.05)  # 2.5% faster: within the noise
    assert keep_current(2.0, 2.4, 0.05)  # slower
    assert not keep_current(2.0, 1.8, 0.05)  # 10% faster
    assert not keep_current(2.0, 1.99, 0.0)  # no margin: any gain
    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="--margin"):
            keep_current(2.0, 1.0, bad)


def test_five_and_six_processes_tie_where_the_cores_bind():
    """The cause: the slow chip's padding is sleep, so both plans' ranks do the same CPU work;
    over few cores that bound decides the step, the same for both."""
    bound = cost(host_cores=0.5)
    five, six = bound.evaluate(FIVE), bound.evaluate(SIX)
    assert five.host_cpu_s == pytest.approx(six.host_cpu_s)
    assert five.pipeline_s != six.pipeline_s  # the pipelines differ ...
    assert five.step_time_s == pytest.approx(six.step_time_s)  # ... the bound does not
    assert five.step_time_s == pytest.approx(five.host_cpu_s / 0.5)


def write_inputs(tmp_path, host_cores: float | None) -> dict[str, str]:
    paths = {name: tmp_path / f"{name}.yaml" for name in ("cluster", "model", "profile",
                                                          "five", "six")}
    data = dict(CLUSTER, host_cores=host_cores) if host_cores else CLUSTER
    paths["cluster"].write_text(yaml.safe_dump(Cluster.from_dict(data).to_dict()))
    paths["model"].write_text(yaml.safe_dump(SHAPE8))
    paths["profile"].write_text(yaml.safe_dump(PROFILE))
    FIVE.to_yaml(paths["five"])
    SIX_UNEVEN.to_yaml(paths["six"])  # tied with FIVE under the cores' bound, slower without
    return {name: str(path) for name, path in paths.items()}


def run(paths: dict[str, str], current: str, new: str, out, *extra: str) -> int:
    return main(["--current", paths[current], "--new", paths[new], "--cluster",
                 paths["cluster"], "--model", paths["model"], "--profile", paths["profile"],
                 "--output", str(out), *extra])


@pytest.mark.parametrize("current,new", [("five", "six"), ("six", "five")])
def test_a_tie_keeps_the_plan_measured_whichever_it_is(tmp_path, capsys, current, new):
    paths = write_inputs(tmp_path, host_cores=0.5)
    out, picture = tmp_path / "plan.yaml", tmp_path / "timeline.png"
    assert run(paths, current, new, out, "--timeline", str(picture)) == 0
    kept = HeteroPlan.from_yaml(out)
    assert kept.world_size == HeteroPlan.from_yaml(paths[current]).world_size
    assert kept.stages == HeteroPlan.from_yaml(paths[current]).stages
    text = out.read_text()
    assert "# stages: " in text and "# predicted step " in text  # the demo reads the stages
    assert picture.stat().st_size > 0  # the kept plan's simulated step
    line = capsys.readouterr().out.strip()
    assert line.startswith("keeping the plan measured as") and "not faster by more than 5%" in line


def test_a_plan_faster_by_more_than_the_margin_is_taken(tmp_path, capsys):
    paths = write_inputs(tmp_path, host_cores=None)  # the pipelines decide: five is faster
    model = cost(host_cores=None)
    five, six = model.evaluate(FIVE).step_time_s, model.evaluate(SIX_UNEVEN).step_time_s
    assert five < 0.95 * six
    out = tmp_path / "plan.yaml"
    assert run(paths, "six", "five", out) == 0
    assert HeteroPlan.from_yaml(out).world_size == 5
    assert capsys.readouterr().out.startswith("taking the planner's best (5 processes")
    # a margin above the gain keeps the plan measured
    assert run(paths, "six", "five", out, "--margin", f"{1 - five / six + 0.01:.3f}") == 0
    assert HeteroPlan.from_yaml(out).world_size == 6


def test_bad_margin_is_one_line(tmp_path, capsys):
    paths = write_inputs(tmp_path, host_cores=None)
    assert run(paths, "six", "five", tmp_path / "plan.yaml", "--margin", "1.5") == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --margin must be in [0, 1), got 1.5"]


def test_a_plan_of_pipelines_is_kept_with_its_stages_and_slowest_pipeline(tmp_path, capsys):
    paths = write_inputs(tmp_path, host_cores=None)
    pipelines = HeteroPlan.of_pipelines([
        HeteroPlan(1, 1, 4, CHIPS, [StageSpec("fast", 1, 4), StageSpec("fast", 1, 4)]),
        HeteroPlan(1, 1, 4, CHIPS, [StageSpec("slow", 1, 4), StageSpec("slow", 1, 4)])])
    pipelines.to_yaml(tmp_path / "pipelines.yaml")
    paths["pipelines"] = str(tmp_path / "pipelines.yaml")
    out, picture = tmp_path / "plan.yaml", tmp_path / "timeline.png"
    # the new plan (1.64 s) is 10% faster than the pipelines (1.82 s): within a margin of 20%
    assert run(paths, "pipelines", "six", out, "--timeline", str(picture), "--margin",
               "0.2") == 0
    kept = HeteroPlan.from_yaml(out)
    assert kept.num_pipelines == 2 and kept.world_size == 4
    assert "# stages: [fast TP1 x2 [4x2]] + [slow TP1 x2 [4x2]]" in out.read_text()
    assert picture.stat().st_size > 0
    assert capsys.readouterr().out.startswith("keeping the plan measured as (4 processes")
