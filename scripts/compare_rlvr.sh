#!/usr/bin/env bash
# PPO (critic), GRPO, Dr. GRPO, GSPO and DAPO on one wall-clock budget (docs/rlvr_results.md
# "Measured: two terms of 1 or 2 digits"): each recipe of configs/rlvr/ on the chain sums of configs/rlvr.yaml for
# MINUTES minutes of training (train.max_minutes: the step that crosses it is the last, and is
# evaluated) or STEPS steps, whichever comes first; 64 responses a step (8 problems x 8
# samples), held-out accuracy on 64 problems every 10 steps (same key every time); wall time
# and peak RSS from /usr/bin/time. Then every trained actor against SmolLM2 on the held-out
# problems with three sampling seeds (scripts/compare_accuracy.py: verifier, format rate,
# format-free and plain-instruction accuracy), a plot (scripts/plot_run.py) and a table
# (scripts/summarize_runs.py).
# Usage: scripts/compare_rlvr.sh [RECIPE ...]
#   [env: OUT=runs/rlvr_recipes MINUTES=45 STEPS=1000 SEED=0 PLOT=docs/rlvr_recipes.png
#    ARGS="--set key=value ..." (more overrides for train.py, after the ones above)]
# (default: all five); a run whose OUT/NAME.time exists is skipped. Run it alone on the
# machine: a second job shares the cores and the budget buys fewer steps.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/rlvr_recipes}
MINUTES=${MINUTES:-45}
STEPS=${STEPS:-1000}
SEED=${SEED:-0}
PLOT=${PLOT:-docs/rlvr_recipes.png}
py=.venv/bin/python
recipes=("$@")
[ ${#recipes[@]} -gt 0 ] || recipes=(ppo grpo dr_grpo gspo dapo)
mkdir -p "$OUT"
for name in "${recipes[@]}"; do
  run="$OUT/$name"
  if [ -s "$run.time" ]; then echo "== $name: done before"; continue; fi
  echo "== $name"
  /usr/bin/time -f "$name: %e s wall, peak RSS %M kB" -o "$run.time" \
    "$py" train.py --config "configs/rlvr/$name.yaml" --set "train.steps=$STEPS" \
      --set "train.max_minutes=$MINUTES" --set "train.seed=$SEED" --set train.save_every=0 --set train.progress=false \
      --set "train.output_dir=$run" ${ARGS:-}
  cat "$run.time"
  "$py" scripts/compare_accuracy.py "$run/actor_hf" --config "configs/rlvr/$name.yaml" \
    --seeds 0 1 2 --show 0 --json "$run.accuracy.json"
done
"$py" scripts/plot_run.py "${recipes[@]/#/$OUT/}" --names "${recipes[@]}" --metric eval/accuracy_format_free \
  --out "$PLOT" --title "SmolLM2-135M, chain sums, $MINUTES min each, 64 responses per step"
"$py" scripts/summarize_runs.py "${recipes[@]/#/$OUT/}" --metric eval/accuracy_format_free
