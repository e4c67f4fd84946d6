#!/usr/bin/env bash
# The whole path on the embedded default, on one machine (no download, no flags):
#   1. measure this machine (tools/profile_chip.py; cached, so only the first run measures),
#   2. plan a CPU-emulated two-chip-type cluster for a small model with that profile
#      (tools/plan.py): the predicted step time is this machine's, under emulation,
#   3. train the plan with pretrain_gpt.py --hetero-plan under torchrun, on the embedded corpus
#      (Python standard library sources), stage boundaries through the cross-vendor bridge,
#   4. show the predicted and the measured timelines and step times.
# Settings (environment): PYTHON (default .venv/bin/python if present, else python3),
# OUT (default runs/demo), ITERS (default 20), CLUSTER, MODEL, PROFILE_FLAGS (extra flags for
# tools/profile_chip.py), REPLAN_MARGIN (default 0.05: the re-plan loop below keeps the plan
# it measured as unless another is predicted faster by more than this fraction);
# MEGATRON_H2_CACHE (default ~/.cache/megatron_h2) holds the corpus and the measurements.
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
# The model as trained: pretrain_gpt.py's embedded demo trains without dropout unless the flags
# say otherwise, and drawing the masks takes time, so the profile, the plan and the comparison
# use the model file with the run's dropout (the file's own, else 0).
"$PYTHON" - "$MODEL" "$OUT/model.yaml" <<'EOF_MODEL'
import sys, yaml
data = yaml.safe_load(open(sys.argv[1]))
for key in ("hidden_dropout", "attention_dropout"):
    data.setdefault(key, 0.0)
with open(sys.argv[2], "w") as out:
    out.write(f"# {sys.argv[1]} with the demo run's dropout\n" + yaml.safe_dump(data, sort_keys=False))
EOF_MODEL
MODEL="$OUT/model.yaml"

# Every emulated chip is a single-threaded process of this machine, and the job's processes
# share its cores: the profile is measured the same way (--emulate: one process per rank of a
# plan, all at once). Which chips compute at once depends on the plan, so plan first with the
# chips measured alone, then measure as that plan's processes and plan again, until the plan
# runs the processes it was measured with, or the planner's new best is not predicted faster
# than the plan measured by more than REPLAN_MARGIN (then that plan is kept). That measurement also gives the cores the processes
# get together (host_cores in the calibrated cluster: a step takes at least their CPU work over
# those cores) and the share of a core each pass got (cpu_fraction in the profile), both under
# whatever else runs on the machine then, as the run meets it: measured afresh each time, at
# once (not cached, not waiting for other processes to leave the cores). PROFILE_FLAGS go to
# every tools/profile_chip.py.
echo "== 1/4 measuring this machine (cached in ${MEGATRON_H2_CACHE:-~/.cache/megatron_h2}/profiles)"
"$PYTHON" tools/profile_chip.py --model "$MODEL" --cluster "$CLUSTER" \
  --calibrated-cluster "$OUT/cluster.yaml" --cache --output "$OUT/profile_alone.yaml" \
  ${PROFILE_FLAGS:-}
"$PYTHON" tools/plan.py --cluster "$OUT/cluster.yaml" --model "$MODEL" \
  --profile "$OUT/profile_alone.yaml" --output "$OUT/plan_alone.yaml" > "$OUT/plan_alone.txt"
cp "$OUT/plan_alone.yaml" "$OUT/measured_as.yaml"
# the processes of a plan: the emulated slowdown of every rank's chip
MIX='import sys; from megatron_h2.plan.schema import HeteroPlan as H; p = H.from_yaml(sys.argv[1]);
print(sorted(p.chips[p.rank_chip(r)].emulate_slowdown for r in range(p.world_size)))'
for round in 1 2 3; do
  echo "-- measuring as the processes of: $(grep '^# stages:' "$OUT/measured_as.yaml" | cut -c11-)"
  "$PYTHON" tools/profile_chip.py --model "$MODEL" --cluster "$CLUSTER" \
    --emulate "$OUT/measured_as.yaml" --micro-batch-sizes 1,2 --max-wait 0 \
    --calibrated-cluster "$OUT/cluster.yaml" --output "$OUT/profile.yaml" ${PROFILE_FLAGS:-}
  "$PYTHON" tools/plan.py --cluster "$OUT/cluster.yaml" --model "$MODEL" \
    --profile "$OUT/profile.yaml" --output "$OUT/plan.yaml" \
    --timeline "$OUT/predicted_timeline.png" --top 3 > "$OUT/plan.txt"
  if [ "$("$PYTHON" -c "$MIX" "$OUT/plan.yaml")" = "$("$PYTHON" -c "$MIX" "$OUT/measured_as.yaml")" ]
  then break; fi
  # Another mix: keep the one measured unless the new one is predicted faster by more than the
  # measurement's noise (REPLAN_MARGIN): where the step is bound by the ranks' CPU work over the
  # cores, plans of five and six processes tie, and following every tie alternates between them.
  "$PYTHON" -m megatron_h2.commands.keep_plan --current "$OUT/measured_as.yaml" \
    --new "$OUT/plan.yaml" --cluster "$OUT/cluster.yaml" --model "$MODEL" \
    --profile "$OUT/profile.yaml" --margin "${REPLAN_MARGIN:-0.05}" --output "$OUT/plan.yaml" \
    --timeline "$OUT/predicted_timeline.png" >> "$OUT/plan.txt"
  if [ "$("$PYTHON" -c "$MIX" "$OUT/plan.yaml")" = "$("$PYTHON" -c "$MIX" "$OUT/measured_as.yaml")" ]
  then break; fi
  cp "$OUT/plan.yaml" "$OUT/measured_as.yaml"
done

echo "== 2/4 planning $CLUSTER for $MODEL with this machine's profile"
cat "$OUT/plan.txt"

WORLD=$("$PYTHON" -c "from megatron_h2.plan.schema import HeteroPlan; \
print(HeteroPlan.from_yaml('$OUT/plan.yaml').world_size)")
MODEL_FLAGS=$("$PYTHON" -c "from megatron_h2.planner.model_input import model_flags, model_from_yaml; \
print(' '.join(model_flags(model_from_yaml('$MODEL'), vocab=False)))")

echo "== 3/4 training the plan on $WORLD processes ($ITERS iterations)"
rm -f "$OUT/metrics.jsonl"
OMP_NUM_THREADS=1 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$WORLD" \
  pretrain_gpt.py --hetero-plan "$OUT/plan.yaml" $MODEL_FLAGS --force-bridge \
  --train-iters "$ITERS" --lr-warmup-iters $WARMUP --log-interval 1 --eval-interval "$ITERS" \
  --eval-iters 2 --save "$OUT/checkpoints" --tensorboard-dir "$OUT/tensorboard" \
  --log-jsonl "$OUT/metrics.jsonl" --timeline-trace "$OUT/timeline.json"

echo "== 4/4 timelines and step time"
"$PYTHON" tools/show_timeline.py "$OUT/timeline.json" --output "$OUT/measured_timeline.png"
echo "predicted timeline: $OUT/predicted_timeline.png (the planner's simulation of its schedule)"
echo "measured trace:     $OUT/timeline.json (open in ui.perfetto.dev or chrome://tracing)"
echo "plan: $OUT/plan.yaml | checkpoint: $OUT/checkpoints | TensorBoard: $OUT/tensorboard"
"$PYTHON" tools/step_time.py --plan "$OUT/plan.yaml" --cluster "$OUT/cluster.yaml" \
  --model "$MODEL" --profile "$OUT/profile.yaml" --metrics "$OUT/metrics.jsonl" --skip "$WARMUP"
