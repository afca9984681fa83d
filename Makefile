# One command each, on a fresh machine: `make train` (main job) and `make test` (test suite).
ARGS ?=

.PHONY: train rlvr tools test test-slow pipeline bench bench-quick bench-gpu-dry bench-gpu bench-train

# Benchmarks: `make bench` sets up .venv and the TRL-only .venv-bench, runs bench/core.py,
# bench/generate.py, bench/ppo_step.py and bench/engine.py (each prints its table against its
# peer and writes it with its figures, the git commit and the CPU under $(BENCH_RAW);
# bench/harness.py), then bench/report.py collects them into bench/results.md (each benchmark's
# wall time is in it). Run it on a quiet machine from a clean tree (other load inflates every
# figure; results.md warns about a dirty tree and about raw files from several commits or
# CPUs). The one-question studies retired from bench/ (their figures,
# commits and the way to re-run them): docs/benchmarks.md "Studies (retired scripts)".
# `make bench-quick` runs the same pipeline with tiny sizes (a smoke check of the scripts, not
# figures to quote; ~5 minutes) and writes bench/results_raw/quick/results.md instead.
BENCH_RAW ?= bench/results_raw
BENCH_QUICK_RAW ?= bench/results_raw/quick

train:
	scripts/setup_venv.sh gguf
	.venv/bin/python train.py $(ARGS)

# RL with verifiable rewards (docs/rlvr.md): GRPO on reasoning-gym's chain sums, held-out
# accuracy every 10 steps; writes runs/rlvr
rlvr:
	scripts/setup_venv.sh gguf,rlvr
	.venv/bin/python train.py --config configs/rlvr.yaml $(ARGS)

# Multi-turn RL with a calculator tool (docs/environments.md): demonstrations, a 4-step SFT
# warm-up, then GRPO over episodes with the calculator environment
tools:
	scripts/setup_venv.sh gguf,rlvr
	.venv/bin/python scripts/make_tool_demos.py --config configs/tools.yaml --out runs/tool_demos \
		--answer --train 128 --eval 16
	.venv/bin/python train.py --config configs/tools_sft.yaml
	.venv/bin/python train.py --config configs/tools.yaml $(ARGS)

# two pytest workers (pytest-xdist), one test file each at a time: XLA compiles on one core, so
# one worker leaves the second core mostly idle (2-core AMD EPYC: 910 s -> 601 s)
TEST_WORKERS ?= 2
test:
	scripts/setup_venv.sh test
	.venv/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

# The three stages of RLHF on SmolLM2 (docs/stages.md "The three stages"): preference data, SFT, reward
# model, PPO with four models, held-out evaluation; writes runs/pipeline (about 30 minutes).
pipeline:
	scripts/setup_venv.sh gguf
	scripts/rlhf_pipeline.sh

test-slow:
	scripts/setup_venv.sh test
	.venv/bin/python -m pytest -q -m slow $(ARGS)

bench:
	scripts/setup_venv.sh test
	bench/setup_trl_env.sh
	mkdir -p $(BENCH_RAW)
	.venv/bin/python bench/core.py --json $(BENCH_RAW)/core.json
	.venv/bin/python bench/generate.py --json $(BENCH_RAW)/generate.json
	.venv/bin/python bench/ppo_step.py --json $(BENCH_RAW)/ppo_step.json
	.venv/bin/python bench/engine.py --json $(BENCH_RAW)/engine.json
	.venv/bin/python bench/report.py $(BENCH_RAW) --out bench/results.md

bench-quick:
	scripts/setup_venv.sh test
	bench/setup_trl_env.sh
	mkdir -p $(BENCH_QUICK_RAW)
	.venv/bin/python bench/core.py --batch 16 --length 64 --rounds 3 --torch-block 1 --jax-block 3 --json $(BENCH_QUICK_RAW)/core.json
	.venv/bin/python bench/generate.py --new-tokens 4 --runs 1 --json $(BENCH_QUICK_RAW)/generate.json
	.venv/bin/python bench/ppo_step.py --epochs 1 --steps 1 --warmup 1 --rounds 1 --new-tokens 4 --json $(BENCH_QUICK_RAW)/ppo_step.json
	.venv/bin/python bench/engine.py --tiny --rounds 1 --responses 16 --rows 4 --slots 4 --new-tokens 24 --json $(BENCH_QUICK_RAW)/engine.json
	.venv/bin/python bench/report.py $(BENCH_QUICK_RAW) --out $(BENCH_QUICK_RAW)/results.md

# Whole train.py runs measured from outside (bench/train_run.py: wall time, peak RSS, page faults,
# CPU time, phase medians; about 65 minutes on 2 CPU cores): `make train` itself, then two A/Bs in
# 2 interleaved rounds, 5 steps of the default config with and without train.py's malloc settings
# and 10 steps of the earlier default (batch 8, reviews.jsonl) with responses that stop at a
# sentence end, with and without the column buckets; then bench/report.py rewrites results.md
# from $(BENCH_RAW): give the BENCH_RAW of your `make bench` run so that its sections stay (of
# the same measured code: bench/report.py warns when the raw files come from several commits).
TRAIN_AB_MALLOC = --set train.steps=5 --set eval.every=0
TRAIN_AB_COLUMNS = --set train.steps=10 --set eval.every=0 --set ppo.batch_size=8 \
	--set data.prompts=configs/prompts/reviews.jsonl --set generation.stop_token_ids=[2,30,17,47]
bench-train:
	scripts/setup_venv.sh gguf
	mkdir -p $(BENCH_RAW)
	.venv/bin/python bench/train_run.py --title "make train" --json $(BENCH_RAW)/train_run.json
	.venv/bin/python bench/train_run.py --rounds 2 --title "malloc settings A/B" \
	  --variant "malloc settings on" "$(TRAIN_AB_MALLOC)" \
	  --variant "malloc settings off" "PPO_JAX_MALLOC_TUNING=0 $(TRAIN_AB_MALLOC)" \
	  --json $(BENCH_RAW)/train_ab_malloc.json
	.venv/bin/python bench/train_run.py --rounds 2 --title "column buckets A/B" \
	  --variant "buckets 4 (prompt and response)" "$(TRAIN_AB_COLUMNS) --set data.prompt_buckets=4 --set generation.response_buckets=4" \
	  --variant "buckets off (full widths)" "$(TRAIN_AB_COLUMNS) --set data.prompt_buckets=1 --set generation.response_buckets=1" \
	  --json $(BENCH_RAW)/train_ab_columns.json
	.venv/bin/python bench/report.py $(BENCH_RAW) --out bench/results.md

# bench/gpu.sh on the CPU with a tiny model: checks the GPU benchmarks' code path anywhere
# (tests/bench runs it too); writes $(BENCH_QUICK_RAW)/gpu.
bench-gpu-dry:
	scripts/setup_venv.sh test
	bench/gpu.sh --dry-run --out $(BENCH_QUICK_RAW)/gpu

# On a GPU machine: bench/ppo_step.py (ppo_jax only) and bench/engine.py in bf16 on random
# weights of SmolLM2's shape, into $(BENCH_RAW)/gpu with its own results.md. Without pip access,
# see the header of bench/gpu.sh (PPO_BENCH_PYTHON, PPO_BENCH_WHEELS, bench/gpu_wheels.sh).
bench-gpu:
	bench/gpu.sh --out $(BENCH_RAW)/gpu
