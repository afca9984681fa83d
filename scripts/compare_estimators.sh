#!/usr/bin/env bash
# PPO (GAE), GRPO, RLOO and REINFORCE++ on one budget (docs/training.md "Advantage estimators beside GAE"):
# configs/default.yaml (SmolLM2-135M-Instruct, VADER) on configs/prompts/reviews.jsonl, 8 sampled
# responses per step for each (PPO and REINFORCE++: 8 prompts x 1; GRPO and RLOO: 2 prompts x 4),
# STEPS steps, the held-out reward on 32 prompts of configs/prompts/quotes_eval.jsonl every 5 steps
# (same seed every time), wall time and peak RSS from /usr/bin/time; then docs/estimators.png
# (scripts/plot_run.py) and a table (scripts/summarize_runs.py).
# Usage: scripts/compare_estimators.sh   [env: OUT=runs/estimators STEPS=20]; a run whose
# OUT/NAME.time exists is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/estimators}
STEPS=${STEPS:-20}
py=.venv/bin/python
mkdir -p "$OUT"
common=(--config configs/default.yaml --set "train.steps=$STEPS" --set train.save_every=0
        --set train.export_hf=false --set train.progress=false
        --set eval.prompts=configs/prompts/quotes_eval.jsonl --set eval.num_prompts=32
        --set eval.every=5
        --set data.prompts=configs/prompts/reviews.jsonl --set ppo.batch_size=8)  # as measured
run() {  # run NAME SETTINGS...
  local name=$1; shift
  if [ -s "$OUT/$name.time" ]; then echo "== $name: done before"; return; fi
  echo "== $name"
  /usr/bin/time -f "$name: %e s wall, peak RSS %M kB" -o "$OUT/$name.time" \
    "$py" train.py "${common[@]}" --set "train.output_dir=$OUT/$name" "$@"
  cat "$OUT/$name.time"
}
run ppo_gae
run grpo --set ppo.advantage_estimator=grpo --set generation.samples_per_prompt=4 \
  --set ppo.kl_coef=0 --set ppo.kl_loss_coef=0.05 --set ppo.whiten_advantages=false
run rloo --set ppo.advantage_estimator=rloo --set generation.samples_per_prompt=4 \
  --set ppo.whiten_advantages=false
run reinforce_pp --set ppo.advantage_estimator=reinforce_plus_plus --set ppo.whiten_advantages=false
"$py" scripts/plot_run.py "$OUT/ppo_gae" "$OUT/grpo" "$OUT/rloo" "$OUT/reinforce_pp" \
  --names "PPO (GAE)" GRPO RLOO "REINFORCE++" --out docs/estimators.png \
  --title "SmolLM2-135M, VADER reward, 8 responses per step"
"$py" scripts/summarize_runs.py "$OUT/ppo_gae" "$OUT/grpo" "$OUT/rloo" "$OUT/reinforce_pp"
