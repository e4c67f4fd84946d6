"""The planner's command line (tools/plan.py's main, in this process): outputs, launch scripts,
and one-line errors with exit status 2. (tools/plan.py run as a script:
tests/e2e/test_planner_cli.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner.cli import main
from megatron_h2.planner.model_input import model_from_yaml
from tests.helpers.paths import ROOT

CPU_CLUSTER = str(ROOT / "examples/clusters/cpu_2types.yaml")
TINY = str(ROOT / "examples/models/tiny.yaml")
GPU_CLUSTER = {
    "chips": {
        "big": {
            "device": "cuda",
            "count": 16,
            "chips_per_node": 8,
            "tflops_bf16": 400,
            "memory_gib": 0.25,
            "intra_node_gb_per_s": 300,
            "inter_node_gb_per_s": 25,
        },
        "fast": {
            "device": "npu",
            "count": 16,
            "chips_per_node": 8,
            "tflops_bf16": 900,
            "memory_gib": 0.06,
            "intra_node_gb_per_s": 200,
            "inter_node_gb_per_s": 25,
        },
    },
    "cross_chip_gb_per_s": 20,
}


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_plans_the_cpu_example_and_writes_everything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run" / "plan.yaml"
    status, text, err = run(
        [
            "--cluster",
            CPU_CLUSTER,
            "--model",
            TINY,
            "--output",
            str(out),
            "--top",
            "3",
            "--timeline",
            str(tmp_path / "t.png"),
            "--trace",
            str(tmp_path / "t.json"),
            "--compare-homogeneous",
        ],
        capsys,
    )
    assert status == 0, err
    assert "best 3 plans" in text and "tokens/s" in text and "MFU" in text
    assert (
        "optimal for the cost model" in text and "ratio heterogeneous / sum of homogeneous" in text
    )
    plan = HeteroPlan.from_yaml(out)
    model = model_from_yaml(TINY)
    plan.validate(
        model.num_layers,
        model.num_attention_heads,
        model.num_query_groups,
        world_size=plan.world_size,
    )
    assert {s.chip for s in plan.stages} == {
        "fast",
        "slow",
    }  # memory makes both chip types worth using
    if "slow" in plan.chips:
        assert plan.chips["slow"].emulate_slowdown == 2.0
    assert out.read_text().startswith("# Written by tools/plan.py")
    script = (tmp_path / "run" / "plan.sh").read_text()
    assert (
        f"torchrun --standalone --nproc-per-node={plan.world_size} pretrain_gpt.py"
        f" --hetero-plan {out}" in script
    )
    assert "--bf16" not in script  # CPU emulation
    assert "--num-layers 8" in script and "--global-batch-size 16" in script
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_slurm_heterogeneous_job_for_several_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = tmp_path / "gpu.yaml"
    cluster.write_text(yaml.safe_dump(GPU_CLUSTER))
    out = tmp_path / "plan.yaml"
    flags = [
        "--num-layers",
        "8",
        "--hidden-size",
        "256",
        "--ffn-hidden-size",
        "704",
        "--num-attention-heads",
        "8",
        "--group-query-attention",
        "--num-query-groups",
        "4",
        "--seq-length",
        "256",
        "--vocab-size",
        "4096",
        "--global-batch-size",
        "32",
    ]
    status, text, err = run(
        [
            "--cluster",
            str(cluster),
            *flags,
            "--output",
            str(out),
            "--use-distributed-optimizer",
            "--launch-script",
            str(tmp_path / "job.sh"),
        ],
        capsys,
    )
    assert status == 0, err
    plan = HeteroPlan.from_yaml(out)
    script = (tmp_path / "job.sh").read_text()
    assert "(slurm)" in text and script.startswith("#!/bin/bash")
    components = script.count("#SBATCH --partition=")
    assert components == 1 + sum(a.chip != b.chip for a, b in zip(plan.stages, plan.stages[1:]))
    assert script.count("#SBATCH hetjob") == components - 1
    chips = [
        a.chip for i, a in enumerate(plan.stages) if i == 0 or plan.stages[i - 1].chip != a.chip
    ]
    assert f"exec scripts/slurm_hetero.sh --plan {out} --chips {','.join(chips)} --" in script
    assert "--use-distributed-optimizer" in script and "--bf16" in script
    ntasks = sum(int(x.split("=")[1]) for x in script.split() if x.startswith("--ntasks="))
    assert ntasks == plan.world_size


def error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    status, _, err = run(argv, capsys)
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err
    return lines[0]


def test_unknown_key_in_the_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = yaml.safe_load(Path(CPU_CLUSTER).read_text())
    bad["chips"]["fast"]["memory_gb"] = bad["chips"]["fast"].pop("memory_gib")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(bad))
    line = error_line(
        [
            "--cluster",
            str(tmp_path / "c.yaml"),
            "--model",
            TINY,
            "--output",
            str(tmp_path / "p.yaml"),
        ],
        capsys,
    )
    assert "unknown key 'memory_gb'" in line and "did you mean 'memory_gib'" in line


def test_zero_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = yaml.safe_load(Path(CPU_CLUSTER).read_text())
    bad["chips"]["slow"]["count"] = 0
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(bad))
    line = error_line(
        [
            "--cluster",
            str(tmp_path / "c.yaml"),
            "--model",
            TINY,
            "--output",
            str(tmp_path / "p.yaml"),
        ],
        capsys,
    )
    assert "chip type 'slow': count must be positive, got 0" in line


def test_batch_not_divisible(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = error_line(
        [
            "--cluster",
            CPU_CLUSTER,
            "--model",
            TINY,
            "--micro-batch-size",
            "3",
            "--output",
            str(tmp_path / "p.yaml"),
        ],
        capsys,
    )
    assert "global batch size 16 is not divisible by micro batch size 3" in line


def test_model_that_fits_nowhere(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = error_line(
        [
            "--cluster",
            CPU_CLUSTER,
            "--model",
            TINY,
            "--hidden-size",
            "4096",
            "--ffn-hidden-size",
            "11008",
            "--num-attention-heads",
            "32",
            "--group-query-attention",
        "--num-query-groups",
            "8",
            "--output",
            str(tmp_path / "p.yaml"),
        ],
        capsys,
    )
    assert "no plan fits in memory" in line


def test_missing_flags_and_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "--hidden-size is missing" in error_line(
        ["--cluster", CPU_CLUSTER, "--num-layers", "4", "--output", str(tmp_path / "p.yaml")],
        capsys,
    )
    assert "unrecognized arguments: --layers" in error_line(
        ["--cluster", CPU_CLUSTER, "--model", TINY, "--layers", "4", "--output", "p.yaml"], capsys
    )
    assert "cannot read cluster file" in error_line(
        ["--cluster", str(tmp_path / "nope.yaml"), "--model", TINY, "--output", "p.yaml"], capsys
    )


def test_profile_table_changes_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.yaml"
    profile.write_text(
        yaml.safe_dump(
            {
                "chips": {
                    "slow": {
                        "micro_batch_sizes": {
                            1: {"layer_forward_ms": 400.0, "layer_backward_ms": 800.0}
                        }
                    },
                }
            }
        )
    )
    base = ["--cluster", CPU_CLUSTER, "--model", TINY, "--top", "1"]
    status, plain, _ = run([*base, "--output", str(tmp_path / "a.yaml")], capsys)
    assert status == 0
    status, measured, _ = run(
        [*base, "--profile", str(profile), "--output", str(tmp_path / "b.yaml")], capsys
    )
    assert status == 0
    slow_layers = [
        s.num_layers for s in HeteroPlan.from_yaml(tmp_path / "b.yaml").stages if s.chip == "slow"
    ]
    assert HeteroPlan.from_yaml(tmp_path / "a.yaml") != HeteroPlan.from_yaml(tmp_path / "b.yaml")
    assert sum(slow_layers) < sum(
        s.num_layers for s in HeteroPlan.from_yaml(tmp_path / "a.yaml").stages if s.chip == "slow"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"chips": {"slwo": {"efficiency": 0.3}}}))
    assert "did you mean 'slow'" in error_line(
        [*base, "--profile", str(bad), "--output", "x.yaml"], capsys
    )


def test_the_schedule_is_chosen_printed_and_explained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.yaml"
    base = ["--cluster", CPU_CLUSTER, "--model", TINY, "--output", str(out), "--top", "3"]
    status, text, err = run(base, capsys)
    assert status == 0, err
    plan = HeteroPlan.from_yaml(out)
    label = {"1f1b": "1F1B", "zero-bubble": "ZB-H1"}.get(
        str(plan.schedule), f"int V={plan.virtual_pipeline_size}"
    )
    first_row = text.split("\n1  ")[1].split("\n")[0]
    assert f" {label} " in first_row
    assert f"schedule: {plan.schedule}" in out.read_text().replace("(ZB-H1)", "")
    assert "the same stages under each schedule: 1f1b " in text and "(chosen)" in text
    # restricted to one schedule: every listed plan uses it, V at most the limit
    status, text, err = run([*base, "--schedules", "interleaved", "--max-virtual-stages", "2"],
                            capsys)  # fmt: skip
    assert status == 0, err
    plan = HeteroPlan.from_yaml(out)
    assert plan.schedule == "interleaved" and plan.virtual_pipeline_size == 2
    assert plan.num_micro_batches % plan.pipeline_parallel_size == 0
    assert all(len(set(s.chunks)) == 1 for s in plan.stages)  # equal chunks
    assert text.count(" int V=2 ") == 3
    status, text, err = run([*base, "--schedules", "1f1b"], capsys)
    assert status == 0 and HeteroPlan.from_yaml(out).schedule == "1f1b"
    assert "schedule" not in yaml.safe_load(out.read_text())  # the default is not written
    status, _, err = run([*base, "--schedules", "1f1b,zero-buble"], capsys)
    assert status == 2 and "unknown pipeline schedule 'zero-buble'" in err
    assert "did you mean 'zero-bubble'" in err and len(err.strip().splitlines()) == 1
