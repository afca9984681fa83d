#!/usr/bin/env bash
# Does the default run keep gaining on prompts it never trains on? (docs/training_results.md "What the default run
# does"; issue 12.) configs/default.yaml run for STEPS steps as is and with each variant below,
# held-out reward on 32 prompts of configs/prompts/quotes_eval.jsonl every 5 steps (eval.*, one
# fixed sampler key), then each final actor on 64 held-out prompts with three sampling seeds
# (scripts/compare_actors.py), a table (scripts/summarize_runs.py) and docs/default_runs.png.
# Usage: scripts/default_run_study.sh   [env: OUT=runs/study STEPS=40 PARALLEL=1
#   RUNS="default reviews_batch_8" (names of the settings below)]; a run whose
# OUT/NAME.time exists is skipped. PARALLEL=1 runs the variants at the same time (their
# times per step are then inflated by sharing the cores).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/study}
STEPS=${STEPS:-40}
py=.venv/bin/python
mkdir -p "$OUT"
common=(--config configs/default.yaml --set "train.steps=$STEPS" --set train.save_every=20
        --set train.progress=false)
run() {  # run NAME SETTINGS...
  local name=$1; shift
  if [ -s "$OUT/$name.time" ]; then echo "== $name: done before"; return; fi
  echo "== $name $*"
  /usr/bin/time -f "$name: %e s wall, peak RSS %M kB" -o "$OUT/$name.time" \
    "$py" train.py "${common[@]}" --set "train.output_dir=$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  cat "$OUT/$name.time"
}
# configs/default.yaml is batch 16 over configs/prompts/everyday.jsonl; reviews_batch_8 is the
# earlier default (batch 8 over the 160 prompts of reviews.jsonl)
reviews="--set data.prompts=configs/prompts/reviews.jsonl"
declare -A settings=([default]="" [kl_0.1]="--set ppo.kl_coef=0.1" [lr_1e-5]="--set optim.actor_lr=1e-5"
                  [batch_8]="--set ppo.batch_size=8"
                  [reviews_batch_8]="$reviews --set ppo.batch_size=8"
                  [reviews_batch_16]="$reviews --set ppo.batch_size=16"
                  [reviews_kl_0.1]="$reviews --set ppo.batch_size=8 --set ppo.kl_coef=0.1")
read -r -a names <<< "${RUNS:-default reviews_batch_8}"
for name in "${names[@]}"; do
  # shellcheck disable=SC2086
  if [ "${PARALLEL:-1}" = 1 ]; then run "$name" ${settings[$name]} & else run "$name" ${settings[$name]}; fi
done
wait
for name in "${names[@]}"; do
  [ -s "$OUT/heldout_$name.json" ] || "$py" scripts/compare_actors.py "$OUT/$name/actor_hf" \
    --base smollm2 --prompts configs/prompts/quotes_eval.jsonl --first 64 --seeds 0 1 2 \
    --json "$OUT/heldout_$name.json" > "$OUT/heldout_$name.log" 2>&1
  tail -n 4 "$OUT/heldout_$name.log"
done
runs=("${names[@]/#/$OUT/}")
"$py" scripts/plot_run.py "${runs[@]}" --names "${names[@]}" --out docs/default_runs.png \
  --title "configs/default.yaml for $STEPS steps: SmolLM2-135M, VADER"
"$py" scripts/summarize_runs.py "${runs[@]}"
