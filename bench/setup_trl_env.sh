#!/usr/bin/env bash
# Create (or reuse) the benchmark-only virtual environment .venv-bench with TRL 0.11 (the last
# PPOTrainer with `compute_rewards` / `compute_advantages` and `AutoModelForCausalLMWithValueHead`)
# and the transformers / accelerate / datasets releases of its time, on CPU torch.
#
# TRL is installed only here, never in .venv or pyproject.toml. torch is pinned to the CPU
# release the main environment uses (a plain `pip install torch` could pull a CUDA build).
# Idempotent: reinstalls only when this script changed since the last successful install.
# Usage: bench/setup_trl_env.sh     (PYTHON=python3.11 to pick the interpreter)
# torch comes from pip's configured indexes; where those serve the CUDA build under the plain
# version (PyPI on Linux), point TORCH_INDEX_URL at the CPU wheels, e.g.
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bench/setup_trl_env.sh
set -euo pipefail
script="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
venv=.venv-bench
stamp="$venv/.installed-trl"

# TRL 0.11.4 (Oct 2024) was released against transformers 4.45/4.46, accelerate 1.0 and
# datasets 3.0; newer transformers (>= 4.47) change generation/cache internals that TRL 0.11's
# PPOTrainer relies on, and transformers 5 drops APIs it imports.
pins=(
  "torch==2.13.0"
  "trl==0.11.4"
  "transformers==4.46.3"
  "tokenizers>=0.20,<0.21"
  "huggingface-hub>=0.24,<1.0"
  "accelerate==1.0.1"
  "datasets==3.0.2"
  "safetensors>=0.4.3"
  "vadersentiment==3.3.2"
  "sentencepiece"
  "rich"
  "tyro"
  "numpy<2.3"
  "pandas<3"
)

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$script" -nt "$stamp" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "$venv/bin/python" -m pip install -q --index-url "$TORCH_INDEX_URL" "${pins[0]}"
  fi
  "$venv/bin/python" -m pip install -q "${pins[@]}"
  # Fail here, not in the middle of a benchmark, if a wrong torch (CUDA) or TRL slipped in.
  "$venv/bin/python" - <<'PY'
import torch, transformers, trl
from trl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert torch.version.cuda is None, f"CUDA torch installed: {torch.version.cuda}"
assert trl.__version__.startswith("0.11."), trl.__version__
assert hasattr(PPOTrainer, "compute_rewards") and hasattr(PPOTrainer, "compute_advantages")
print(f".venv-bench: torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}")
PY
  touch "$stamp"
fi
