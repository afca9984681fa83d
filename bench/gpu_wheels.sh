#!/usr/bin/env bash
# Download the wheels that bench/gpu.sh needs on a GPU machine that reaches no package index but
# already has python3 with jax (+ CUDA plugin), flax, optax, orbax-checkpoint, chex,
# transformers, tokenizers, safetensors, numpy, pyarrow, tqdm, pyyaml, protobuf, packaging and
# requests (e.g. the H200 image this project's GPU figures come from): ppo_jax's other
# training-path dependencies, pure-Python wheels, about 0.5 MB. Their own dependencies are in
# that list, so they are fetched with --no-deps.
#
# Usage: bench/gpu_wheels.sh [DIR (default .whl)]   then, on the GPU machine:
#   PPO_BENCH_PYTHON=python3 PPO_BENCH_WHEELS=DIR bench/gpu.sh --out OUT
# Environment: PPO_BENCH_WHEEL_PYTHON (the target's Python version, default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.whl}"
pyver="${PPO_BENCH_WHEEL_PYTHON:-3.12}"
pip=(python3 -m pip)
if [ -x .venv/bin/python ]; then pip=(.venv/bin/python -m pip); fi
mkdir -p "$dir"
"${pip[@]}" download -q --no-deps --only-binary=:all: --python-version "$pyver" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dir" \
  omegaconf==2.4.0 tensorboardX==2.6.5 vaderSentiment==3.3.2
ls -l "$dir"
