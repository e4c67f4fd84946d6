# shellcheck shell=bash
# Environment of the NVIDIA (CUDA) component of a heterogeneous megatron_h2 job.
#
# scripts/slurm_hetero.sh sources this file in every task of the component, on the compute
# node, before Python starts:   --setup H100=examples/hetero/env_cuda.sh
# It is sourced, so it must not `exit`; keep it quiet on stdout. Adapt module names, paths and
# network interfaces to your site; every setting below can be overridden from the job's
# environment (sbatch exports the submitting shell's environment by default).

# --- software: site modules and the Python environment built for this chip type -------------
if command -v module >/dev/null 2>&1; then                  # Lmod / Environment Modules
  module load "${MEGATRON_H2_CUDA_MODULE:-cuda/12.4}" >/dev/null 2>&1 \
    || echo "env_cuda.sh: module ${MEGATRON_H2_CUDA_MODULE:-cuda/12.4} not loaded" >&2
fi
CUDA_VENV=${MEGATRON_H2_CUDA_VENV:-$HOME/venvs/megatron_h2-cuda}  # torch built for CUDA
if [ -f "$CUDA_VENV/bin/activate" ]; then
  # shellcheck disable=SC1091
  source "$CUDA_VENV/bin/activate"                         # `python3` is now the venv's
else
  echo "env_cuda.sh: no virtualenv at $CUDA_VENV (set MEGATRON_H2_CUDA_VENV)" >&2
fi

# --- CUDA ------------------------------------------------------------------------------------
# One hardware work queue per device, so tensor-parallel communication kernels are issued in
# program order with compute (Megatron's usual setting).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# Every task sees all GPUs of its node and picks cuda:$LOCAL_RANK: do not narrow
# CUDA_VISIBLE_DEVICES here (and do not use srun --gpus-per-task).

# --- NCCL: TP and DP groups of the CUDA stages (inside this component) -----------------------
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}                       # INFO to debug topology / transports
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}  # bootstrap NIC: anything but these
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}                # use InfiniBand / RoCE when present
# export NCCL_IB_HCA=mlx5                                   # pin the HCAs if the node has several
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # fail, don't hang

# --- gloo: pipeline traffic between vendors goes through a job-wide gloo (TCP) group ----------
# Name the interface that reaches the other vendor's nodes (the same network on both sides).
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-${MEGATRON_H2_IFNAME:-}}
[ -n "$GLOO_SOCKET_IFNAME" ] || unset GLOO_SOCKET_IFNAME     # empty: let gloo pick

# --- CPU side --------------------------------------------------------------------------------
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-4}}
