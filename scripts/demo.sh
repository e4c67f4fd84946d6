#!/usr/bin/env bash
# The whole path on the embedded default, on one machine (no download, no flags):
#   1. plan a CPU-emulated two-chip-type cluster for a small model (tools/plan.py),
#   2. train the plan with pretrain_gpt.py --hetero-plan under torchrun, on the embedded corpus
#      (Python standard library sources), stage boundaries through the cross-vendor bridge,
#   3. show the predicted and the measured timelines.
# Settings (environment): PYTHON (default .venv/bin/python if present, else python3),
# OUT (default runs/demo), ITERS (default 20), CLUSTER, MODEL.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT=${OUT:-runs/demo}
ITERS=${ITERS:-20}
WARMUP=$(( ITERS < 10 ? ITERS / 2 : 5 ))  # warm-up ends before the decay does (Megatron)
CLUSTER=${CLUSTER:-examples/clusters/cpu_2types.yaml}
MODEL=${MODEL:-examples/models/tiny.yaml}
mkdir -p "$OUT"

echo "== 1/3 planning $CLUSTER for $MODEL"
"$PYTHON" tools/plan.py --cluster "$CLUSTER" --model "$MODEL" --output "$OUT/plan.yaml" \
  --timeline "$OUT/predicted_timeline.png" --top 3

WORLD=$("$PYTHON" -c "from megatron_h2.hetero_plan import HeteroPlan; \
print(HeteroPlan.from_yaml('$OUT/plan.yaml').world_size)")
MODEL_FLAGS=$("$PYTHON" -c "from megatron_h2.planner.model import model_flags, model_from_yaml; \
print(' '.join(model_flags(model_from_yaml('$MODEL'), vocab=False)))")

echo "== 2/3 training the plan on $WORLD processes ($ITERS iterations)"
OMP_NUM_THREADS=1 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$WORLD" \
  pretrain_gpt.py --hetero-plan "$OUT/plan.yaml" $MODEL_FLAGS --force-bridge \
  --train-iters "$ITERS" --lr-warmup-iters $WARMUP --log-interval 5 --eval-interval "$ITERS" \
  --eval-iters 2 --save "$OUT/checkpoints" --tensorboard-dir "$OUT/tensorboard" \
  --log-jsonl "$OUT/metrics.jsonl" --timeline-trace "$OUT/timeline.json"

echo "== 3/3 timelines"
"$PYTHON" tools/show_timeline.py "$OUT/timeline.json" --output "$OUT/measured_timeline.png"
echo "predicted timeline: $OUT/predicted_timeline.png (the planner's 1F1B simulation)"
echo "measured trace:     $OUT/timeline.json (open in ui.perfetto.dev or chrome://tracing)"
echo "plan: $OUT/plan.yaml | checkpoint: $OUT/checkpoints | TensorBoard: $OUT/tensorboard"
