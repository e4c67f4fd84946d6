"""scripts/slurm_hetero.sh under stand-in srun / scontrol that emulate a SLURM heterogeneous job.

The srun shim splits its command line at ``:`` into components, starts each component's
command once per task with the SLURM variables a het step gives (``SLURM_PROCID`` global over
the components in order, ``SLURM_NTASKS`` the total, ``SLURM_LOCALID`` per node), and runs all
tasks at once. The entry script (``MEGATRON_H2_ENTRY``) dumps what each task received.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.e2e  # every test here starts processes

SCRIPT = ROOT / "scripts" / "slurm_hetero.sh"

SRUN = """#!{python}
import os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["SRUN_LOG"], "a") as log:
    log.write(repr(args) + "\\n")
blocks, block = [], []
for arg in args + [":"]:
    if arg == ":":
        blocks.append(block)
        block = []
    else:
        block.append(arg)
components = []
for index, block in enumerate(blocks):
    group = index
    while block and block[0].startswith("-"):
        option = block.pop(0)
        if option.startswith("--het-group="):
            group = int(option.split("=", 1)[1])
    size = os.environ.get("SLURM_HET_SIZE")
    var = f"SLURM_NTASKS_HET_GROUP_{{group}}" if size else "SLURM_NTASKS"
    components.append((group, int(os.environ[var]), block))
total = sum(n for _, n, _ in components)
procs, rank = [], 0
for node, (group, ntasks, command) in enumerate(components):
    for local in range(ntasks):  # each component on its own node
        env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_TASKID=str(rank),
                   SLURM_NTASKS=str(total), SLURM_NPROCS=str(total), SLURM_LOCALID=str(local),
                   SLURM_NODEID=str(node), SLURM_STEP_ID="0")
        procs.append(subprocess.Popen(command, env=env))
        rank += 1
sys.exit(max([p.wait() for p in procs] or [0]))
"""

SCONTROL = """#!{python}
import sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\\n".join(sys.argv[3].split(",")))
"""

ENTRY = """
import json, os, sys
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGATRON_H2_CHIP",
        "MEGATRON_H2_COMPONENT", "TEST_SETUP", "SETUP_ARGC", "SETUP_SAW_RANK"]
report = {k: os.environ.get(k) for k in keys}
report["argv"] = sys.argv[1:]
report["cwd"] = os.getcwd()
if os.environ.get("TEST_RENDEZVOUS"):
    import torch.distributed as dist
    dist.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (dist.get_rank(), os.environ["MEGATRON_H2_CHIP"]))
    report["group"] = everyone
    dist.destroy_process_group()
out = os.path.join(os.environ["TEST_OUT"], f"task{os.environ['SLURM_PROCID']}.json")
with open(out, "w") as fh:
    json.dump(report, fh)
"""

PLAN = """data_parallel_size: 1
micro_batch_size: 1
global_batch_size: 4
chips:
  gpu: {device: cuda}
  npu: {device: npu}
stages:
  - {chip: gpu, tensor_parallel_size: 2, num_layers: 3}
  - {chip: npu, tensor_parallel_size: 1, num_layers: 1}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def job(tmp_path):
    """A fake two-component het job: gpu x 2 tasks on 127.0.0.1/127.0.0.2, npu x 1 on localhost."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    (tmp_path / "entry.py").write_text(ENTRY)
    (tmp_path / "plan.yaml").write_text(PLAN)
    for chip in ("gpu", "npu"):  # a setup records that it ran, without positional arguments
        (tmp_path / f"env_{chip}.sh").write_text(
            f"export TEST_SETUP={chip} SETUP_ARGC=$# SETUP_SAW_RANK=${{RANK:-none}}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", PYTHON=sys.executable, OMP_NUM_THREADS="1",
               MEGATRON_H2_ENTRY=str(tmp_path / "entry.py"), TEST_OUT=str(out),
               SRUN_LOG=str(tmp_path / "srun.log"), MASTER_PORT=str(free_port()),
               SLURM_JOB_ID="42", SLURM_SUBMIT_DIR=str(tmp_path), SLURM_HET_SIZE="2",
               SLURM_NTASKS_HET_GROUP_0="2", SLURM_NTASKS_HET_GROUP_1="1",
               SLURM_JOB_NODELIST_HET_GROUP_0="127.0.0.1,127.0.0.2",
               SLURM_JOB_NODELIST_HET_GROUP_1="localhost",
               SLURM_JOB_NODELIST="localhost,127.0.0.1,127.0.0.2")  # SLURM sorts this one
    return tmp_path, env


def launch(tmp_path: Path, env: dict, *options: str, flags: tuple[str, ...] = ("--lr", "1e-3"),
           timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = ["bash", str(SCRIPT), *options, "--", *flags]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


SETUPS = ("--setup", "gpu=env_gpu.sh", "--setup", "npu=env_npu.sh")


def tasks(tmp_path: Path) -> list[dict]:
    files = sorted((tmp_path / "out").glob("task*.json"))
    return [json.loads(f.read_text()) for f in files]


def test_each_task_gets_its_rank_chip_and_setup(job):
    tmp_path, env = job
    proc = launch(tmp_path, env, "--plan", "plan.yaml", "--chips", "gpu,npu", *SETUPS,
                  flags=("--lr", "1e-3", "--hetero-plan", "plan.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert "2 component(s) [gpu x 2 + npu x 1], rendezvous 127.0.0.1:" in proc.stdout
    got = tasks(tmp_path)
    assert [t["RANK"] for t in got] == ["0", "1", "2"]
    assert [t["LOCAL_RANK"] for t in got] == ["0", "1", "0"]
    assert [t["MEGATRON_H2_CHIP"] for t in got] == ["gpu", "gpu", "npu"]
    assert [t["MEGATRON_H2_COMPONENT"] for t in got] == ["0", "0", "1"]
    assert [t["TEST_SETUP"] for t in got] == ["gpu", "gpu", "npu"]  # its own component's file
    for t in got:
        assert t["WORLD_SIZE"] == "3" and t["MASTER_ADDR"] == "127.0.0.1"
        assert t["MASTER_PORT"] == env["MASTER_PORT"]
        assert t["SETUP_ARGC"] == "0" and t["SETUP_SAW_RANK"] == "none"
        assert t["argv"] == ["--hetero-plan", str(tmp_path / "plan.yaml"), "--lr", "1e-3"]
    srun = [eval(line) for line in (tmp_path / "srun.log").read_text().splitlines()]
    assert len(srun) == 1 and srun[0].count(":") == 1
    assert srun[0][:2] == ["--het-group=0", "--kill-on-bad-exit=1"]
    assert srun[0][srun[0].index(":") + 1] == "--het-group=1"


def test_tasks_join_one_rendezvous(job):
    tmp_path, env = job
    env["TEST_RENDEZVOUS"] = "1"
    proc = launch(tmp_path, env, "--plan", "plan.yaml", *SETUPS, timeout=120)  # chips from plan
    assert proc.returncode == 0, proc.stderr
    got = tasks(tmp_path)
    assert len(got) == 3
    for t in got:
        assert [tuple(x) for x in t["group"]] == [(0, "gpu"), (1, "gpu"), (2, "npu")]


def test_single_component_job(job):
    tmp_path, env = job
    for key in [k for k in env if "HET" in k]:
        del env[key]
    env.update(SLURM_NTASKS="2", SLURM_JOB_NODELIST="127.0.0.1")
    one_chip = PLAN.replace("npu, tensor_parallel_size: 1", "gpu, tensor_parallel_size: 1")
    (tmp_path / "plan.yaml").write_text(one_chip.replace("tensor_parallel_size: 2",
                                                         "tensor_parallel_size: 1"))
    proc = launch(tmp_path, env, "--plan", "plan.yaml", "--setup", "gpu=env_gpu.sh")
    assert proc.returncode == 0, proc.stderr
    got = tasks(tmp_path)
    assert [(t["RANK"], t["WORLD_SIZE"], t["MEGATRON_H2_CHIP"], t["TEST_SETUP"]) for t in got] \
        == [("0", "2", "gpu", "gpu"), ("1", "2", "gpu", "gpu")]
    srun = eval((tmp_path / "srun.log").read_text())
    assert ":" not in srun and not any(a.startswith("--het-group") for a in srun)


@pytest.mark.parametrize("options, env_extra, fragment", [
    (("--chips", "npu,gpu"), {},
     "list the hetjob components and --chips in the plan's stage order"),
    (("--chips", "gpu,npu"), {"SLURM_NTASKS_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "2"},
     "rank 1 would run on a 'npu' component but the plan puts stage 0 (chip 'gpu') there"),
    (("--chips", "gpu,npu"), {"SLURM_NTASKS_HET_GROUP_1": "3"},
     "the components have 2+3 = 5 tasks but the plan needs 3 ranks"),
    (("--chips", "gpu"), {}, "--chips names 1 component(s) (gpu) but the job has 2"),
    (("--setup", "gpo=env_gpu.sh"), {}, "--setup for chip 'gpo', which no component runs"),
    (("--setup", "gpu=missing.sh"), {}, "setup file 'missing.sh' for chip 'gpu' not found"),
    (("--bogus",), {}, "unknown option '--bogus'"),
])
def test_bad_job_is_one_line_before_srun(job, options, env_extra, fragment):
    tmp_path, env = job
    env.update(env_extra)
    proc = launch(tmp_path, env, "--plan", "plan.yaml", *options)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and fragment in err, err
    assert not (tmp_path / "srun.log").exists()


def test_missing_plan_and_conflicting_plans(job):
    tmp_path, env = job
    proc = launch(tmp_path, env)
    assert proc.returncode == 2 and "--plan FILE is required" in proc.stderr
    (tmp_path / "other.yaml").write_text(PLAN)
    proc = launch(tmp_path, env, "--plan", "plan.yaml", flags=("--hetero-plan", "other.yaml"))
    assert proc.returncode == 2 and "differs from --plan plan.yaml" in proc.stderr


def bash_words(line: str) -> list[str]:
    """The words bash reads from ``line`` (printf %q may use $'...' quoting, unlike shlex)."""
    script = 'eval "words=($1)"; printf "%s\\0" "${words[@]}"'
    out = subprocess.run(["bash", "-c", script, "_", line], capture_output=True, text=True,
                         check=True).stdout
    return out.split("\0")[:-1]


def test_dry_run_prints_the_srun_command(job):
    tmp_path, env = job
    env["SRUN_ARGS"] = "--cpu-bind=none --label"
    proc = launch(tmp_path, env, "--plan", "plan.yaml", "--chips", "gpu,npu", *SETUPS,
                  "--dry-run")
    assert proc.returncode == 0, proc.stderr
    words = bash_words(proc.stdout.splitlines()[-1])
    assert words[:5] == ["srun", "--het-group=0", "--kill-on-bad-exit=1", "--cpu-bind=none",
                         "--label"]
    second = words.index(":")
    assert words[second + 1:second + 4] == ["--het-group=1", "--cpu-bind=none", "--label"]
    assert words[second + 4:second + 6] == ["bash", "-c"]
    assert "export RANK=$SLURM_PROCID" in words[second + 6]  # the task body
    assert words[second + 7:second + 11] == ["megatron_h2[npu]", "1", "npu",
                                             str(tmp_path / "env_npu.sh")]
    assert not (tmp_path / "srun.log").exists()


def test_example_job_matches_its_plan(job):
    """examples/hetero: the sbatch file's components follow the plan, and the script accepts it."""
    tmp_path, env = job
    sbatch = (ROOT / "examples" / "hetero" / "h100_910b.sbatch").read_text()
    assert sbatch.count("#SBATCH hetjob") == 1
    env.update(SLURM_NTASKS_HET_GROUP_0="8", SLURM_NTASKS_HET_GROUP_1="8")
    command = sbatch.split("exec ", 1)[1].replace("\\\n", " ")
    words = shlex.split(command)
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", *words[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "2 component(s) [H100 x 8 + A910B x 8]" in proc.stdout
    assert "--timeline-trace" in proc.stdout


def test_invalid_plan_is_one_line(job):
    tmp_path, env = job
    (tmp_path / "plan.yaml").write_text(PLAN.replace("num_layers: 3", "num_layerz: 3"))
    proc = launch(tmp_path, env, "--plan", "plan.yaml")
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and "num_layerz" in err, err


def test_unreadable_plan_skips_the_check_only_with_chips(job):
    """Where the batch host's Python cannot import megatron_h2, --chips is needed and the
    runtime's per-rank check (MEGATRON_H2_CHIP) is what remains."""
    tmp_path, env = job
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\n[ "$1" = -c ] && {{ echo "no yaml" >&2; exit 1; }}\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    env["PYTHON"] = str(fake)
    proc = launch(tmp_path, env, "--plan", "plan.yaml", *SETUPS)
    assert proc.returncode == 2 and "pass --chips" in proc.stderr
    proc = launch(tmp_path, env, "--plan", "plan.yaml", "--chips", "gpu,npu", *SETUPS)
    assert proc.returncode == 0, proc.stderr
    assert "warning: plan not checked" in proc.stderr
    assert [t["MEGATRON_H2_CHIP"] for t in tasks(tmp_path)] == ["gpu", "gpu", "npu"]


def test_stage_with_its_own_dp_needs_its_tasks(job):
    """A stage's own data_parallel_size counts in its chip's tasks: npu x TP 1 x DP 2."""
    tmp_path, env = job
    (tmp_path / "plan.yaml").write_text(PLAN.replace(
        "tensor_parallel_size: 1, num_layers: 1",
        "tensor_parallel_size: 1, num_layers: 1, data_parallel_size: 2"))
    proc = launch(tmp_path, env, "--plan", "plan.yaml", "--chips", "gpu,npu")
    assert proc.returncode == 2
    assert "the components have 2+1 = 3 tasks but the plan needs 4 ranks" in proc.stderr
    env["SLURM_NTASKS_HET_GROUP_1"] = "2"
    proc = launch(tmp_path, env, "--plan", "plan.yaml", "--chips", "gpu,npu", "--dry-run")
    assert proc.returncode == 0, proc.stderr


PIPELINES = """micro_batch_size: 1
global_batch_size: 4
chips:
  gpu: {device: cuda}
  npu: {device: npu}
pipelines:
  - batch_share: 2
    stages:
      - {chip: gpu, tensor_parallel_size: 2, num_layers: 4}
  - batch_share: 2
    stages:
      - {chip: npu, tensor_parallel_size: 1, num_layers: 4}
"""


def test_data_parallel_pipelines_follow_the_rank_order(job):
    """Pipeline 0 on the gpu component (2 tasks), pipeline 1 on the npu one; components listed
    in another order get one line naming the pipeline's stage."""
    tmp_path, env = job
    (tmp_path / "plan.yaml").write_text(PIPELINES)
    proc = launch(tmp_path, env, "--plan", "plan.yaml", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "2 component(s) [gpu x 2 + npu x 1]" in proc.stdout
    env.update(SLURM_NTASKS_HET_GROUP_0="1", SLURM_NTASKS_HET_GROUP_1="2")
    proc = launch(tmp_path, env, "--plan", "plan.yaml", "--chips", "gpu,npu")
    assert proc.returncode == 2
    assert ("rank 1 would run on a 'npu' component but the plan puts pipeline 0 stage 0 "
            "(chip 'gpu') there") in proc.stderr
