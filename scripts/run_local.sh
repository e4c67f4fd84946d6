#!/usr/bin/env bash
# One node: NPROC processes with torchrun (default 2), flags passed to pretrain_gpt.py. SIGTERM
# with --exit-signal-handler: exit status 0 once every worker saved and stopped.
#   NPROC=4 scripts/run_local.sh --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
exec "$PYTHON" -m megatron_h2.commands.torchrun --standalone --nproc-per-node "${NPROC:-2}" \
  pretrain_gpt.py "$@"
