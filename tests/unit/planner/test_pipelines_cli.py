"""tools/plan.py with data-parallel pipelines: the faster of one pipeline for all and a plan of
pipelines is written, and the "why" lines and --compare-homogeneous say what each gave."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner import Cluster, CostConfig, CostModel
from megatron_h2.planner.cli import main
from megatron_h2.planner.model_input import model_from_yaml
from megatron_h2.planner.pipelines_cost import evaluate_plan
from tests.helpers.paths import ROOT

TINY = str(ROOT / "examples/models/tiny.yaml")


def cluster_file(tmp_path: Path, cross_gb_per_s: float) -> str:
    """Two chip types, two chips each, ``B`` 0.6 x as fast as ``A``, linked to each other at
    ``cross_gb_per_s``: one pipeline over both cannot balance its stages with whole layers."""
    chip = {"device": "cpu", "count": 2, "chips_per_node": 2, "tflops_bf16": 0.05,
            "memory_gib": 1.0, "intra_node_gb_per_s": 5, "inter_node_gb_per_s": 5}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"chips": {"A": chip, "B": dict(chip, tflops_bf16=0.03)},
                                    "cross_chip_gb_per_s": cross_gb_per_s}))
    return str(path)


def plan(tmp_path: Path, cross: float, capsys: pytest.CaptureFixture[str],
         *extra: str) -> tuple[str, HeteroPlan, CostModel]:
    cluster = cluster_file(tmp_path, cross)
    out = tmp_path / "plan.yaml"
    assert main(["--cluster", cluster, "--model", TINY, "--global-batch-size", "64",
                 "--micro-batch-size", "4", "--output", str(out), "--compare-homogeneous",
                 *extra]) == 0
    cost = CostModel(Cluster.from_yaml(cluster), model_from_yaml(TINY), CostConfig())
    return capsys.readouterr().out, HeteroPlan.from_yaml(out), cost


def test_unbalanced_types_give_a_plan_of_pipelines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, written, cost = plan(tmp_path, 1.0, capsys)
    assert written.num_pipelines == 2
    assert {s.chip for p in written.pipelines for s in p.stages} == {"A", "B"}
    step = evaluate_plan(cost, written).step_time_s
    assert f"data-parallel pipelines, step {step:.3f} s" in out
    assert "data-parallel pipelines [A] + [B], batch shares" in out
    assert "the gradient exchange across pipelines adds" in out
    assert "the plan written: data-parallel pipelines" in out
    script = (tmp_path / "plan.sh").read_text()
    assert f"--nproc-per-node={written.world_size}" in script


def test_slow_links_keep_one_pipeline_and_say_that_no_plan_of_pipelines_beats_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the gradient exchange crosses the slow link once per step with the whole model: every
    # split is cut off (a pipeline cannot beat one pipeline's step with the exchange's least)
    out, written, _ = plan(tmp_path, 0.01, capsys)
    assert written.num_pipelines == 1
    assert "data-parallel pipelines: none (none beats one pipeline for all" in out
    assert "15 batch splits (15 cut off" in out and "every split tried" in out
    assert "proven: no plan of data-parallel pipelines is faster" in out
    assert "the plan written: one pipeline" in out
    none_out, written, _ = plan(tmp_path, 1.0, capsys, "--data-parallel-pipelines", "none")
    assert written.num_pipelines == 1
    assert "data-parallel pipelines: not searched" in none_out


def test_elastic_re_planner_takes_the_plan_of_pipelines_when_faster(tmp_path: Path) -> None:
    from megatron_h2.config import RunConfig
    from megatron_h2.elastic.replan import best_plan

    cluster = Cluster.from_yaml(cluster_file(tmp_path, 1.0))
    planned = best_plan(cluster, RunConfig(model=model_from_yaml(TINY)), 64, 4, 10.0)
    assert planned.plan.num_pipelines == 2
    cost = CostModel(cluster, model_from_yaml(TINY), CostConfig())
    assert planned.tokens_per_s == pytest.approx(evaluate_plan(cost, planned.plan).tokens_per_s)
    assert "] + [" in planned.describe()


def test_local_search_walks_from_a_split_cut_off_to_one_that_beats_the_step(
        tmp_path: Path) -> None:
    """128 micro-batches (127 splits: the local search): the split in proportion to peak speed
    is cut off by the one-pipeline step, B proven too slow with its share; moving micro-batches
    from B to A reaches a split that beats that step."""
    from megatron_h2.planner.pipelines_search import (
        _peak_speeds,
        _Runner,
        proportional,
        split_units,
    )
    from megatron_h2.planner.search import SearchOptions, search

    data = yaml.safe_load(Path(cluster_file(tmp_path, 1.0)).read_text())
    data["chips"]["B"]["tflops_bf16"] = 0.02
    cost = CostModel(Cluster.from_dict(data), model_from_yaml(TINY), CostConfig())
    options = SearchOptions(512, 1, (4,))
    one = search(cost, options).best.estimate.step_time_s
    runner, grouping = _Runner(cost, options, float("inf"), one), (("A",), ("B",))
    unit = split_units(128, 2)[0]
    split = [unit * n for n in proportional(128 // unit, _peak_speeds(cost, grouping))]
    assert runner.evaluate(grouping, 4, split) is None and runner.cut == 1
    found = runner._walk(grouping, 4, split, unit)
    assert found is not None and found.estimate.step_time_s < one
    assert found.plan.pipelines[1].global_batch_size < 4 * split[1]
