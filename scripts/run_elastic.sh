#!/usr/bin/env bash
# Elastic training on one node: when a rank dies or a chip is lost, re-plan for the chips that
# are left (same model, same global batch) and resume from the last good checkpoint.
#
#   scripts/run_elastic.sh --cluster CLUSTER.yaml [--plan PLAN.yaml] [--max-restarts N] \
#       -- <pretrain_gpt.py flags, with --save DIR>
#
# Under SLURM (one node per job):
#   sbatch --nodes 1 scripts/run_elastic.sh --cluster ... -- ...
# The job is requeueable (#SBATCH --requeue). The script requeues the job with `scontrol requeue`,
# at most MAX_REQUEUES times (SLURM_RESTART_COUNT counts them), when the launcher cannot finish on
# this node (exit 75: --max-restarts used up, no plan fits the chips left, or a signal stopped a
# worker that did not save) and when SLURM signalled the job (e.g. 120 s before its time limit)
# and every worker saved (the launcher exits 0; the script too, after requeueing). The requeued
# job probes the chips of the node it gets, plans for them and resumes from the checkpoint.
# Settings (environment): PYTHON (default python3), MAX_REQUEUES (default 3).
#SBATCH --job-name=megatron_h2_elastic
#SBATCH --nodes=1
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:TERM@120
set -uo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
PYTHON=${PYTHON:-python3}
MAX_REQUEUES=${MAX_REQUEUES:-3}

"$PYTHON" -m megatron_h2.elastic.launcher "$@" &
launcher=$!
# SLURM signals the batch shell: pass it on (with --exit-signal-handler the workers save and
# stop, and the launcher exits 0; 75 when a worker did not save)
signalled=0
trap 'signalled=1; kill -TERM "$launcher" 2>/dev/null' TERM INT
status=0
while true; do
  wait "$launcher"
  status=$?
  kill -0 "$launcher" 2>/dev/null || break  # wait returned because of a trapped signal
done

# stopped by the signal with everything saved: training is not over, the requeued job resumes it
stopped_saved=$(( status == 0 && signalled == 1 ))
if { [ "$status" -eq 75 ] || [ "$stopped_saved" -eq 1 ]; } && [ -n "${SLURM_JOB_ID:-}" ]; then
  restarts=${SLURM_RESTART_COUNT:-0}
  if [ "$restarts" -lt "$MAX_REQUEUES" ]; then
    echo "megatron_h2 elastic: requeueing SLURM job $SLURM_JOB_ID (requeue $((restarts + 1)) of $MAX_REQUEUES)"
    scontrol requeue "$SLURM_JOB_ID"
  else
    echo "megatron_h2 elastic: not requeueing SLURM job $SLURM_JOB_ID: MAX_REQUEUES=$MAX_REQUEUES reached"
  fi
fi
exit "$status"
