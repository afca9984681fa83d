#!/usr/bin/env bash
# The three stages of RLHF on SmolLM2-135M-Instruct with nothing downloaded, measured stage by
# stage (wall time and peak resident memory from /usr/bin/time, written to runs/pipeline/*.time):
#   1. preference data: 4 responses per prompt of configs/prompts/reviews.jsonl sampled by
#      SmolLM2 and ranked by VADER (AI feedback): best-of-4 for SFT, best vs worst and every other
#      pair 0.5 or more apart as preference pairs; 10% of the prompts held out for evaluation;
#   2. SFT (configs/sft.yaml) -> runs/pipeline/sft/actor_hf;
#   3. reward model (configs/reward_model.yaml) -> runs/pipeline/reward_model/reward_model_hf;
#   4. PPO with the four models (configs/ppo_rlhf.yaml) -> runs/pipeline/ppo/actor_hf;
#   5. VADER on held-out prompts (configs/prompts/quotes_eval.jsonl, never trained on), three
#      sampling seeds: SmolLM2 vs the SFT actor, SmolLM2 vs the PPO actor.
# Usage: scripts/rlhf_pipeline.sh   (needs .venv: `scripts/setup_venv.sh gguf` or `make test` first).
# A stage whose runs/pipeline/NAME.time exists is skipped, so an interrupted pipeline continues
# with the stage it was in (remove that stage's output directory first, or the stage refuses to
# overwrite it); remove runs/pipeline to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=runs/pipeline
py=.venv/bin/python
mkdir -p "$OUT"
measure() {  # measure NAME COMMAND...: run it, keep its log and its time / peak RSS
  local name=$1; shift
  if [ -s "$OUT/$name.time" ]; then echo "== $name: done before ($(cat "$OUT/$name.time"))"; return; fi
  echo "== $name: $*"
  /usr/bin/time -f "$name: %e s wall, peak RSS %M kB" -o "$OUT/$name.time" "$@" 2>&1 | tee "$OUT/$name.log"
  cat "$OUT/$name.time"
}
measure data "$py" scripts/make_preference_pairs.py --actor smollm2 \
  --prompts configs/prompts/reviews.jsonl --k 4 --all-pairs-gap 0.5 --eval-fraction 0.1 \
  --out "$OUT/preference_data"
measure sft "$py" train.py --config configs/sft.yaml
measure reward_model "$py" train.py --config configs/reward_model.yaml
measure ppo "$py" train.py --config configs/ppo_rlhf.yaml
held_out=(--prompts configs/prompts/quotes_eval.jsonl --first 64 --seeds 0 1 2 --show 2)
measure eval_sft "$py" scripts/compare_actors.py "$OUT/sft/actor_hf" --base smollm2 "${held_out[@]}" \
  --json "$OUT/heldout_sft.json"
measure eval_ppo "$py" scripts/compare_actors.py "$OUT/ppo/actor_hf" --base smollm2 "${held_out[@]}" \
  --json "$OUT/heldout_ppo.json"
cat "$OUT"/*.time
