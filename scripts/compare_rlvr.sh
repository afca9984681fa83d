#!/usr/bin/env bash
# PPO (critic), GRPO, Dr. GRPO, GSPO and DAPO on one budget (docs/rlvr.md "Five recipes, one
# budget"): each recipe of configs/rlvr/ on the chain sums of configs/rlvr.yaml, STEPS steps of
# 64 responses (8 problems x 8 samples), held-out accuracy on 64 problems every 5 steps (same
# key every time); wall time and peak RSS from /usr/bin/time. Then every trained actor against
# SmolLM2 on the held-out problems with three sampling seeds (scripts/compare_accuracy.py),
# docs/rlvr_recipes.png (scripts/plot_run.py) and a table (scripts/summarize_runs.py).
# Usage: scripts/compare_rlvr.sh [RECIPE ...]
#   [env: OUT=runs/rlvr_recipes STEPS=30 SEED=0 PLOT=docs/rlvr_recipes.png]
# (default: all five); a run whose OUT/NAME.time exists is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/rlvr_recipes}
STEPS=${STEPS:-30}
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
      --set "train.seed=$SEED" --set train.save_every=0 --set train.progress=false \
      --set "train.output_dir=$run"
  cat "$run.time"
  "$py" scripts/compare_accuracy.py "$run/actor_hf" --config "configs/rlvr/$name.yaml" \
    --seeds 0 1 2 --show 0 --json "$run.accuracy.json"
done
"$py" scripts/plot_run.py "${recipes[@]/#/$OUT/}" --names "${recipes[@]}" --metric eval/accuracy \
  --out "$PLOT" --title "SmolLM2-135M, chain sums, 64 responses per step"
"$py" scripts/summarize_runs.py "${recipes[@]/#/$OUT/}" --metric eval/accuracy
