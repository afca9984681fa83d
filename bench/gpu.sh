#!/usr/bin/env bash
# PPO-step throughput, MFU and sampler bandwidth of ppo_jax on a GPU (or TPU) machine, bf16:
# sets up the environment, checks what `jax.devices()` sees, then runs bench/gpu.py (random
# weights of the SmolLM2-135M shape and of a ~1.07B Llama shape; see its docstring for what is
# measured and the FLOPs / bytes models). Nothing is downloaded at run time: the models are
# random-init, the SmolLM2 tokenizer ships in bench/smollm2_tokenizer/.
#
# Environment set-up (skipped with PPO_BENCH_PYTHON=/path/to/python, an interpreter that already
# has a jax with CUDA/TPU support and ppo_jax's dependencies, or gets the missing ones from
# PPO_BENCH_WHEELS, e.g. on a machine without pip access):
#   1. scripts/setup_venv.sh test   -> .venv (ppo_jax and its dependencies);
#   2. pip install "jax[cuda12]==<the installed jax version>" into .venv (CUDA 12 wheels of
#      jaxlib + the nvidia-* runtime wheels). This needs pip access to those wheels (PyPI or a
#      mirror); set PPO_BENCH_JAX_EXTRA=tpu for a TPU VM, or =none to keep the installed jax.
#
# Usage:
#   bench/gpu.sh [--json PATH]           e.g. bench/gpu.sh --json bench/results_raw/gpu.json
#                                        (bench/report.py adds a gpu.json it finds to results.md)
#   bench/gpu.sh --dry-run               same code path on the CPU, tiny model (also PPO_BENCH_DRY=1)
# The settings (2 models x shared/separate critic, 4 epochs, batch 64, 128 new tokens, 1 warm-up +
# 3 measured steps, a 420 s time budget: bench/gpu.py SETTINGS) are sized to finish in under
# 8 minutes on one H200, compiles included (an estimate: not yet timed there).
#
# Machine without a package index (e.g. an H200 image with python3, jax + CUDA plugin, flax,
# optax, orbax-checkpoint, chex, transformers, tokenizers, safetensors, numpy, pyarrow, tqdm):
#   here:   bench/gpu_wheels.sh .whl      (omegaconf, tensorboardX, vaderSentiment wheels, <1 MB)
#   there:  PPO_BENCH_PYTHON=python3 PPO_BENCH_WHEELS=.whl bench/gpu.sh --json OUT/gpu.json
# Environment: PPO_BENCH_PEAK_TFLOPS / PPO_BENCH_PEAK_HBM_TBS (peak dense bf16 TFLOP/s and memory
# TB/s per chip where the device is not in gpu.py's tables), PPO_BENCH_PYTHON,
# PPO_BENCH_WHEELS (a folder of wheels installed, without their dependencies, into a temporary
# folder put first on PYTHONPATH), PPO_BENCH_JAX_EXTRA (cuda12 | tpu | none), PPO_BENCH_COMMIT
# (recorded as the code's commit where the tree has no .git; default `git rev-parse HEAD`),
# PPO_JAX_CACHE (where the tokenizer, random models and XLA compilation cache go; default .cache).
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

if [ -n "${PPO_BENCH_WHEELS:-}" ]; then
  site="$(mktemp -d "${TMPDIR:-/tmp}/ppo_bench_site.XXXXXX")"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$PPO_BENCH_WHEELS"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  echo "installed $(ls "$PPO_BENCH_WHEELS" | grep -c '\.whl$') wheel(s) from $PPO_BENCH_WHEELS into $site" >&2
fi
if [ "$dry" = 1 ]; then
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
fi
if [ "$dry" != 1 ] && command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
    --format=csv,noheader 2>/dev/null | sed 's/^/nvidia-smi: /' || true
fi
"$py" - <<'PY'
import jax
devs = jax.devices()
import flax, optax, transformers
print(f"jax {jax.__version__}, backend {jax.default_backend()}: {len(devs)} device(s): "
      + ", ".join(sorted({d.device_kind for d in devs}))
      + f"; flax {flax.__version__}, optax {optax.__version__}, transformers {transformers.__version__}")
PY
if [ "$dry" != 1 ] && [ "$("$py" -c 'import jax; print(jax.default_backend())')" = cpu ]; then
  echo "JAX sees no accelerator (see above). Install jax with CUDA/TPU support, or pass" \
       "--dry-run to check the code path on the CPU." >&2
  exit 1
fi

export PPO_BENCH_COMMAND="bench/gpu.sh $*"
exec "$py" bench/gpu.py "$@"
