#!/usr/bin/env bash
# One training job over a SLURM heterogeneous job: one hetjob component per chip type, each
# with its own environment setup, all joining ONE torch.distributed rendezvous.
#
#   scripts/slurm_hetero.sh --plan PLAN.yaml [--chips CHIP0,CHIP1,...] \
#       [--setup CHIP=FILE]... [--dry-run] [--no-check] -- [pretrain_gpt.py flags]
#
# Run it from a batch script whose "#SBATCH hetjob" components are listed in the plan's stage
# order (component 0 = the chip of stage 0, ...; with data-parallel pipelines, pipeline after
# pipeline: the plan's rank order); see examples/hetero/README.md for a complete NVIDIA + Ascend
# job. Options:
#   --plan FILE        the heterogeneous plan (tools/plan.py writes it); passed on as --hetero-plan
#                      (a --hetero-plan FILE among the pretrain_gpt.py flags does the same)
#   --chips A,B,...    the plan chip that each hetjob component runs, in component order
#                      (default: the plan's chips in rank order, consecutive stages merged)
#   --setup CHIP=FILE  file sourced by every task of that chip's components before Python starts
#                      (modules, virtualenv, vendor variables: examples/hetero/env_*.sh)
#   --dry-run          print the srun command instead of running it
#   --no-check         skip the pre-flight check of the components against the plan
# Environment:
#   MASTER_PORT        rendezvous port on the first node of component 0 (default 29500)
#   MEGATRON_H2_MASTER_ADDR  rendezvous host (default: first host of component 0)
#   PYTHON             interpreter after the setup file ran (default python3)
#   MEGATRON_H2_ENTRY  script every task runs (default pretrain_gpt.py)
#   SRUN_ARGS          extra srun options given to every component (word-split)
#   MEGATRON_H2_ROOT   repository the tasks run in (default: this script's repository, else
#                      the submit directory)
#
# Why not torchrun: its c10d rendezvous numbers the nodes in arrival order, but the plan pins
# stage s to chip type c, so global ranks must follow the component order. srun starts one
# process per device and numbers them globally over the components in order, and each task
# sets torch.distributed's env:// variables from SLURM (see the Slurm heterogeneous-jobs guide):
#   RANK=$SLURM_PROCID (global task rank over all components of the step)
#   WORLD_SIZE=$SLURM_NTASKS (total tasks of all components)   LOCAL_RANK=$SLURM_LOCALID
#   MASTER_ADDR=first host of $SLURM_JOB_NODELIST_HET_GROUP_0   MEGATRON_H2_CHIP=<component chip>
# The runtime checks MEGATRON_H2_CHIP against the chip the plan puts on that rank. Every task
# sees all devices of its node and picks device LOCAL_RANK, so do not restrict tasks to one
# device (no --gpus-per-task). On one node use scripts/run_local.sh with the same plan.
#SBATCH --job-name=megatron_h2_hetero
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }

PLAN="" CHIPS="" DRY_RUN=0 CHECK=1
declare -A SETUP=()
while [ $# -gt 0 ]; do
  case "$1" in
    --plan) [ $# -ge 2 ] || die "--plan needs a file"; PLAN=$2; shift 2 ;;
    --plan=*) PLAN=${1#--plan=}; shift ;;
    --chips) [ $# -ge 2 ] || die "--chips needs a list such as H100,A910B"; CHIPS=$2; shift 2 ;;
    --chips=*) CHIPS=${1#--chips=}; shift ;;
    --setup|--setup=*)
      if [ "$1" = --setup ]; then [ $# -ge 2 ] || die "--setup needs CHIP=FILE"; spec=$2; shift 2
      else spec=${1#--setup=}; shift; fi
      [[ "$spec" == ?*=?* ]] || die "--setup takes CHIP=FILE, got '$spec'"
      SETUP[${spec%%=*}]=${spec#*=} ;;
    --dry-run) DRY_RUN=1; shift ;;
    --no-check) CHECK=0; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,/^#SBATCH/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1' (pretrain_gpt.py flags go after --; see --help)" ;;
  esac
done
# Paths are taken relative to where the script was started, then we move to the repository.
abspath() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }

FLAGS=()  # pretrain_gpt.py flags; a --hetero-plan among them stands for --plan
while [ $# -gt 0 ]; do
  given=""
  case "$1" in
    --hetero-plan) [ $# -ge 2 ] || die "--hetero-plan needs a file"; given=$2; shift 2 ;;
    --hetero-plan=*) given=${1#--hetero-plan=}; shift ;;
    :) die "a lone ':' separates hetjob components for srun; it cannot be a flag" ;;
    *) FLAGS+=("$1"); shift ;;
  esac
  if [ -n "$given" ] && [ -z "$PLAN" ]; then PLAN=$given
  elif [ -n "$given" ] && [ "$(abspath "$given")" != "$(abspath "$PLAN")" ]; then
    die "--hetero-plan $given differs from --plan $PLAN; give the plan once"
  fi
done
[ -n "$PLAN" ] || die "--plan FILE is required (the heterogeneous plan tools/plan.py writes)"
[ -f "$PLAN" ] || die "plan file '$PLAN' not found"
PLAN=$(abspath "$PLAN")
for chip in ${SETUP[@]+"${!SETUP[@]}"}; do
  [ -f "${SETUP[$chip]}" ] || die "setup file '${SETUP[$chip]}' for chip '$chip' not found"
  SETUP[$chip]=$(abspath "${SETUP[$chip]}")
done
ROOT=${MEGATRON_H2_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}
# sbatch runs a copy of the batch script from its spool directory: fall back to the submit dir
[ -f "$ROOT/pretrain_gpt.py" ] || ROOT=${SLURM_SUBMIT_DIR:-$PWD}
cd "$ROOT"
PYTHON=${PYTHON:-python3}
export MEGATRON_H2_ENTRY=${MEGATRON_H2_ENTRY:-pretrain_gpt.py}

# ---------------------------------------------------------------- components of the het job
NUM_COMPONENTS=${SLURM_HET_SIZE:-1}
COUNTS=()  # tasks per component as SLURM reports them ("?" when --ntasks was not given)
for ((i = 0; i < NUM_COMPONENTS; i++)); do
  if [ "$NUM_COMPONENTS" -gt 1 ]; then var=SLURM_NTASKS_HET_GROUP_$i; else var=SLURM_NTASKS; fi
  COUNTS+=("${!var:-?}")
done

check_chip_count() {  # one chip per hetjob component
  IFS=, read -r -a CHIP_LIST <<< "$CHIPS"
  [ "${#CHIP_LIST[@]}" -eq "$NUM_COMPONENTS" ] || die "--chips names ${#CHIP_LIST[@]}" \
    "component(s) ($CHIPS) but the job has $NUM_COMPONENTS (SLURM_HET_SIZE); give one chip per" \
    "hetjob component, in order"
}
[ -z "$CHIPS" ] || check_chip_count

# Pre-flight: components must follow the plan's stage order (rank r runs on the chip of the
# stage owning r). Runs where component 0's setup makes megatron_h2 importable; the runtime
# checks every rank again through MEGATRON_H2_CHIP.
read -r -d '' CHECK_PY <<'EOF' || true
import sys
try:
    from megatron_h2.errors import ConfigError
    from megatron_h2.plan.schema import HeteroPlan
except ImportError as exc:
    sys.exit(f"cannot import megatron_h2 ({exc})")
path, chips_arg, counts_arg = sys.argv[1:4]
try:
    plan = HeteroPlan.from_yaml(path)
except ConfigError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
# stage s owns TP_s x DP_s ranks (DP_s: the stage's own data_parallel_size, else the plan's);
# data-parallel pipelines own their ranks one after the other
per_rank = [plan.rank_chip(r) for r in range(plan.world_size)]
def place(rank):
    pipeline = plan.pipeline_of_rank(rank)
    stage = plan.pipeline_plans[pipeline].rank_coordinates(rank)[0]
    return f"pipeline {pipeline} stage {stage}" if plan.pipelines else f"stage {stage}"
merge = lambda xs: [x for i, x in enumerate(xs) if i == 0 or xs[i - 1] != x]
chips = chips_arg.split(",") if chips_arg else merge(per_rank)
def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)
if merge(chips) != merge(per_rank):
    fail(f"components run chips {','.join(chips)} but the plan's stages run "
         f"{','.join(merge(per_rank))} in that order; list the hetjob components and --chips "
         "in the plan's stage order (with pipelines, pipeline after pipeline)")
if "?" not in counts_arg.split(","):
    counts = [int(n) for n in counts_arg.split(",")]
    if len(counts) == len(chips):
        launched = [c for c, n in zip(chips, counts) for _ in range(n)]
        if len(launched) != len(per_rank):
            fail(f"the components have {'+'.join(map(str, counts))} = {len(launched)} tasks but "
                 f"the plan needs {len(per_rank)} ranks (sum of TP x DP over stages"
                 f"{' and pipelines' if plan.pipelines else ''})")
        for rank, (got, want) in enumerate(zip(launched, per_rank)):
            if got != want:
                fail(f"rank {rank} would run on a '{got}' component but the plan puts "
                     f"{place(rank)} (chip '{want}') there; change the components' task counts")
print(",".join(chips))
EOF
if [ "$CHECK" = 1 ]; then
  counts_csv=$(IFS=,; echo "${COUNTS[*]}")
  first_setup=""  # component 0's setup (known only with --chips)
  if [ -n "$CHIPS" ]; then first_setup=${SETUP[${CHIPS%%,*}]:-}; fi
  set +e
  checked=$(
    if [ -n "$first_setup" ]; then set +eu; set --; source "$first_setup" >/dev/null 2>&1; fi
    "${PYTHON:-python3}" -c "$CHECK_PY" "$PLAN" "$CHIPS" "$counts_csv"
  )
  status=$?
  set -e
  case $status in
    0) CHIPS=$checked ;;
    2) exit 2 ;;  # the one-line error is already printed
    *) [ -n "$CHIPS" ] || die "could not read the plan to find the chips; pass --chips"
       echo "warning: plan not checked against the components (see above); the runtime will" \
            "check each rank" >&2 ;;
  esac
fi
[ -n "$CHIPS" ] || die "--chips is required with --no-check"
check_chip_count
for chip in ${SETUP[@]+"${!SETUP[@]}"}; do
  [[ ",$CHIPS," == *",$chip,"* ]] \
    || die "--setup for chip '$chip', which no component runs ($CHIPS)"
done

# ------------------------------------------------------------------------------ rendezvous
if [ "$NUM_COMPONENTS" -gt 1 ]; then NODES=${SLURM_JOB_NODELIST_HET_GROUP_0:-}
else NODES=${SLURM_JOB_NODELIST:-}; fi
[ -n "$NODES" ] || die "no node list: run this inside a SLURM allocation (sbatch or salloc)"
if [ -n "${MEGATRON_H2_MASTER_ADDR:-}" ]; then MASTER_ADDR=$MEGATRON_H2_MASTER_ADDR
else  # no pipe into head: a SIGPIPE'd scontrol would fail the script under pipefail
  hosts=$(scontrol show hostnames "$NODES") || die "scontrol cannot expand the node list '$NODES'"
  MASTER_ADDR=${hosts%%$'\n'*}
fi
[ -n "$MASTER_ADDR" ] || die "no host in the node list '$NODES'"
export MASTER_ADDR MASTER_PORT=${MASTER_PORT:-29500} PYTHON

# What every task runs: source its component's setup, map SLURM's task ids to env://, start.
read -r -d '' TASK <<'EOF' || true
component=$1 chip=$2 setup=$3; shift 3
args=("$@"); set --
if [ -n "$setup" ]; then
  source "$setup" || { echo "error: [rank $SLURM_PROCID] setup '$setup' failed" >&2; exit 1; }
fi
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
export MEGATRON_H2_CHIP=$chip MEGATRON_H2_COMPONENT=$component
exec "${PYTHON:-python3}" "$MEGATRON_H2_ENTRY" "${args[@]}"
EOF

SRUN=(srun)
for ((i = 0; i < NUM_COMPONENTS; i++)); do
  [ "$i" -eq 0 ] || SRUN+=(":")
  [ "$NUM_COMPONENTS" -eq 1 ] || SRUN+=("--het-group=$i")
  [ "$i" -gt 0 ] || SRUN+=("--kill-on-bad-exit=1")
  # shellcheck disable=SC2206  # SRUN_ARGS is split into words on purpose
  SRUN+=(${SRUN_ARGS:-})
  chip=${CHIP_LIST[$i]}
  SRUN+=(bash -c "$TASK" "megatron_h2[$chip]" "$i" "$chip" "${SETUP[$chip]:-}"
         --hetero-plan "$PLAN" ${FLAGS[@]+"${FLAGS[@]}"})
done

summary=""
for ((i = 0; i < NUM_COMPONENTS; i++)); do
  summary+="${summary:+ + }${CHIP_LIST[$i]} x ${COUNTS[$i]}"
done
echo "megatron_h2: $NUM_COMPONENTS component(s) [$summary], rendezvous $MASTER_ADDR:$MASTER_PORT"
if [ "$DRY_RUN" = 1 ]; then
  printf '%q ' "${SRUN[@]}"
  echo
  exit 0
fi
exec "${SRUN[@]}"
