#!/usr/bin/env bash
# Multi-node training under SLURM: one srun task per node, each starting torchrun, all joining
# one c10d rendezvous on the first node.
#
#   sbatch --nodes 4 --gpus-per-node 8 scripts/slurm_pretrain.sh \
#       --tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 ... (pretrain_gpt flags)
#
# World size = nodes x processes per node; DP = world / (TP x PP). Settings (environment):
#   NPROC_PER_NODE  processes per node (default: SLURM_GPUS_ON_NODE, else 8)
#   MASTER_PORT     rendezvous port on the first node (default 29500)
#   PYTHON          interpreter with megatron_h2's requirements (default: python3)
#   SETUP           optional file sourced on every node first (modules, venv, NCCL settings)
# A failing rank ends its torchrun, srun --kill-on-bad-exit ends the other nodes. torchrun runs
# as megatron_h2.commands.torchrun: on SIGTERM (scancel, the time limit) with
# --exit-signal-handler it exits 0 once every worker of its node saved and stopped.
#SBATCH --job-name=megatron_h2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
MASTER_PORT=${MASTER_PORT:-29500}
PYTHON=${PYTHON:-python3}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
echo "megatron_h2: ${SLURM_NNODES} node(s) x ${NPROC_PER_NODE} processes, rendezvous ${MASTER_ADDR}:${MASTER_PORT}"
srun --kill-on-bad-exit=1 bash -c "
  set -e
  if [ -n \"${SETUP:-}\" ]; then source \"${SETUP:-}\"; fi
  exec ${PYTHON} -m megatron_h2.commands.torchrun \
    --nnodes ${SLURM_NNODES} --nproc-per-node ${NPROC_PER_NODE} \
    --rdzv-backend c10d --rdzv-endpoint ${MASTER_ADDR}:${MASTER_PORT} \
    --rdzv-id ${SLURM_JOB_ID} \
    pretrain_gpt.py \"\$@\"
" megatron_h2 "$@"
