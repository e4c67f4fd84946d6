# shellcheck shell=bash
# Environment of the Huawei Ascend (NPU) component of a heterogeneous megatron_h2 job.
#
# scripts/slurm_hetero.sh sources this file in every task of the component, on the compute
# node, before Python starts:   --setup A910B=examples/hetero/env_npu.sh
# It is sourced, so it must not `exit`; keep it quiet on stdout. Adapt paths and network
# interfaces to your site; every setting below can be overridden from the job's environment.

# --- CANN toolkit: its set_env.sh puts the runtime, HCCL and the op libraries on the paths ----
ASCEND_ROOT=${MEGATRON_H2_ASCEND_ROOT:-/usr/local/Ascend}
if [ -f /etc/Ascend/ascend_cann_install.info ]; then        # where the installer recorded it
  ASCEND_ROOT=$(sed -n 's/^Install_Path=//p' /etc/Ascend/ascend_cann_install.info | head -n 1)
  ASCEND_ROOT=${ASCEND_ROOT:-/usr/local/Ascend}
fi
if [ -f "$ASCEND_ROOT/ascend-toolkit/set_env.sh" ]; then
  # shellcheck disable=SC1091
  source "$ASCEND_ROOT/ascend-toolkit/set_env.sh"         # full toolkit
elif [ -f "$ASCEND_ROOT/nnae/set_env.sh" ]; then
  # shellcheck disable=SC1091
  source "$ASCEND_ROOT/nnae/set_env.sh"                   # runtime-only package
else
  echo "env_npu.sh: no CANN set_env.sh under $ASCEND_ROOT (set MEGATRON_H2_ASCEND_ROOT)" >&2
fi
if [ -f "$ASCEND_ROOT/nnal/atb/set_env.sh" ]; then          # transformer acceleration library
  # shellcheck disable=SC1091
  source "$ASCEND_ROOT/nnal/atb/set_env.sh"                 # (newer CANN releases; optional)
fi

# --- Python environment with torch and the matching torch_npu --------------------------------
NPU_VENV=${MEGATRON_H2_NPU_VENV:-$HOME/venvs/megatron_h2-npu}
if [ -f "$NPU_VENV/bin/activate" ]; then
  # shellcheck disable=SC1091
  source "$NPU_VENV/bin/activate"
else
  echo "env_npu.sh: no virtualenv at $NPU_VENV (set MEGATRON_H2_NPU_VENV)" >&2
fi

# --- torch_npu runtime -----------------------------------------------------------------------
export TASK_QUEUE_ENABLE=${TASK_QUEUE_ENABLE:-2}            # operator dispatch queue, level 2
# allocator: growable segments instead of fixed blocks, less memory fragmentation
export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}
export CPU_AFFINITY_CONF=${CPU_AFFINITY_CONF:-1}            # bind each process to its NPU's cores
export ASCEND_GLOBAL_LOG_LEVEL=${ASCEND_GLOBAL_LOG_LEVEL:-3}  # 0 debug .. 3 error
export ASCEND_SLOG_PRINT_TO_STDOUT=${ASCEND_SLOG_PRINT_TO_STDOUT:-0}  # logs to files, not stdout
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # read by Megatron-style code
# Every task sees all NPUs of its node and picks npu:$LOCAL_RANK: do not narrow
# ASCEND_RT_VISIBLE_DEVICES here.

# --- HCCL: TP and DP groups of the NPU stages (inside this component) -------------------------
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1200}   # s to build links (default 120)
export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-1800}         # s a collective may wait for peers
export HCCL_BUFFSIZE=${HCCL_BUFFSIZE:-200}                  # MB per communicator buffer
if [ -n "${MEGATRON_H2_IFNAME:-}" ]; then                   # host NIC for HCCL's bootstrap
  export HCCL_SOCKET_IFNAME=${HCCL_SOCKET_IFNAME:-$MEGATRON_H2_IFNAME}
fi

# --- gloo: pipeline traffic between vendors goes through a job-wide gloo (TCP) group ----------
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-${MEGATRON_H2_IFNAME:-}}
[ -n "$GLOO_SOCKET_IFNAME" ] || unset GLOO_SOCKET_IFNAME     # empty: let gloo pick

# --- CPU side --------------------------------------------------------------------------------
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-4}}
