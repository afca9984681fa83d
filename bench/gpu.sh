#!/usr/bin/env bash
# ppo_jax on a GPU (or TPU) machine, bfloat16, random weights of SmolLM2-135M's shape: sets up
# the environment, checks what `jax.devices()` sees, then runs the kept benchmarks' device modes
# and bench/report.py over their JSON. Nothing is downloaded at run time: the models are
# random-init, the SmolLM2 tokenizer ships in bench/smollm2_tokenizer/.
#   ppo_step  bench/ppo_step.py: ppo_jax's PPO step per phase, shared and separate critic,
#             4 epochs, batch 64, 128 new tokens (no TRL peer there: the device image has no
#             torch);
#   engine    bench/engine.py: the paged engine against the static sampler at equal KV memory,
#             256 responses whose lengths `--random-stops 768` makes heavy-tailed, 64 and 128 slots.
#
# Usage:
#   bench/gpu.sh [--out DIR] [ppo_step] [engine]   DIR (default bench/results_raw/gpu) gets
#                                                  ppo_step.json, engine.json and results.md
#   bench/gpu.sh --dry-run [--out DIR]             the same scripts on the CPU, tiny shape and sizes
#                                                  (also PPO_BENCH_DRY=1; default DIR
#                                                  bench/results_raw/quick/gpu)
# Name one benchmark to run it alone (a short device lease; compiles take minutes on XLA:GPU).
#
# Environment set-up (skipped with PPO_BENCH_PYTHON=/path/to/python, an interpreter that already
# has a jax with CUDA/TPU support and ppo_jax's dependencies, or gets the missing ones from
# PPO_BENCH_WHEELS, e.g. on a machine without pip access):
#   1. scripts/setup_venv.sh test   -> .venv (ppo_jax and its dependencies);
#   2. pip install "jax[cuda12]==<the installed jax version>" into .venv; set
#      PPO_BENCH_JAX_EXTRA=tpu for a TPU VM, or =none to keep the installed jax.
# Machine without a package index (e.g. an H200 image with python3, jax + CUDA plugin, flax,
# optax, orbax-checkpoint, chex, transformers, tokenizers, safetensors, numpy, pyarrow, tqdm):
#   here:   bench/gpu_wheels.sh .whl      (omegaconf, tensorboardX, vaderSentiment wheels, <1 MB)
#   there:  PPO_BENCH_PYTHON=python3 PPO_BENCH_WHEELS=.whl bench/gpu.sh --out OUT
# Environment:
#   PPO_BENCH_SHAPE    smollm2 | llama1b (Llama-3.2-1B's decoder with SmolLM2's vocabulary), for
#                      the PPO step; default smollm2; the shapes: configs/model_shapes/
#   PPO_BENCH_CONFIGS  the PPO step's configurations, in order (default "jax-shared jax-separate");
#                      one per call keeps a short lease's finished figures
#   PPO_BENCH_PYTHON, PPO_BENCH_WHEELS (a folder of wheels installed, without their dependencies,
#                      into a temporary folder put first on PYTHONPATH)
#   PPO_BENCH_JAX_EXTRA  cuda12 | tpu | none
#   PPO_BENCH_COMMIT   recorded as the code's commit where the tree has no .git
#   PPO_JAX_CACHE      where the tokenizer, random models and XLA compilation cache go (default .cache)
set -euo pipefail
cd "$(dirname "$0")/.."

dry="${PPO_BENCH_DRY:-0}"
out=
benches=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --out) out="$2"; shift ;;
    ppo_step|engine) benches+=("$1") ;;
    *) echo "unknown argument: $1 (see the header of $0)" >&2; exit 2 ;;
  esac
  shift
done
if [ ${#benches[@]} -eq 0 ]; then benches=(ppo_step engine); fi
if [ -z "$out" ]; then
  out=bench/results_raw/gpu
  if [ "$dry" = 1 ]; then out=bench/results_raw/quick/gpu; fi
fi

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

cache="${PPO_JAX_CACHE:-$PWD/.cache}"
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$cache/jax-compile}"
if [ "$dry" = 1 ]; then
  ppo_step=(--random-shape tiny --epochs 1 --batch 2 --new-tokens 4 --steps 1)
  engine=(--tiny --random-stops 8 --responses 8 --rows 4 --slots 4 --new-tokens 8 --rounds 1)
else
  ppo_step=(--random-shape "${PPO_BENCH_SHAPE:-smollm2}" --epochs 4 --batch 64 --new-tokens 128 --steps 3)
  engine=(--random-stops 768 --slots 64 128 --buckets 2 --rounds 2)
fi
mkdir -p "$out"
for bench in "${benches[@]}"; do
  case "$bench" in
    ppo_step) read -r -a configs <<<"${PPO_BENCH_CONFIGS:-jax-shared jax-separate}"
              "$py" bench/ppo_step.py --configs "${configs[@]}" --dtype bfloat16 \
                --warmup 1 --rounds 1 "${ppo_step[@]}" --json "$out/ppo_step.json" ;;
    engine) "$py" bench/engine.py --workload heavy --dtype bfloat16 "${engine[@]}" \
              --json "$out/engine.json" ;;
  esac
done
"$py" bench/report.py "$out" --out "$out/results.md"
