"""Roofline of the PPO update on this machine: the update phase's model-FLOP rate against a
large float32 matmul's, measured in one run (issue 13: the update at >= 50% of that rate).

What is measured, in this order, in one process:

- matmul: `jax.jit(lambda x, y: x @ y)` on `--matmul N` square float32 matrices (2 N^3 FLOPs,
  checked against the jaxpr count), `--matmul-runs` timed calls after 2 warm-up calls;
  GFLOP/s = 2 N^3 / median time.
- update: ppo_jax's `PPOTrainer` built exactly as `bench/ppo_step.py --worker jax` builds it
  (SmolLM2-135M-Instruct by default; `--tiny`: the tiny random Llama, a dry run), `--warmup` +
  `--steps` whole PPO steps; the update phase's time is `time/update` of each measured step
  (the jitted `ppo_update`: epochs x one minibatch, forward + backward + Adam, and reading its
  stats back). Its FLOPs per step are counted from the compiled function's jaxpr (matmuls, scan
  bodies x trip count: bench/flops.py); XLA's `cost_analysis()` (which counts each loop body
  once, so undercounts scanned layers) and the 6N-per-token model of bench/gpu.py are printed
  beside it. GFLOP/s = counted FLOPs / time, median over the measured steps.

Prints the CPU model and instruction sets, both rates and their ratio; `--json PATH` writes them
(bench/report.py turns it into results.md's "Roofline" section).

Usage: python bench/roofline.py [--tiny | --model-dir DIR] [--mode shared] [--epochs 1]
           [--batch 8] [--new-tokens 48] [--steps 3] [--warmup 1] [--matmul 2048]
           [--matmul-runs 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled
sys.path.insert(0, str(ROOT / "bench"))
import gpu_figures  # noqa: E402  (the 6N-per-token model)
import ppo_step  # noqa: E402  (bench/ppo_step.py: the jax worker)
from common import cpu_info, cpu_line, run_record, under_malloc_settings, stats, write_json  # noqa: E402

TARGET = 0.5  # issue 13: the update at >= 50% of the matmul rate


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def matmul_rate(n: int, runs: int, warmup: int = 2) -> dict:
    """Time `runs` calls of a jitted `[n, n] @ [n, n]` float32 matmul after `warmup` calls."""
    import jax
    import jax.numpy as jnp
    from flops import count_flops

    kx, ky = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (n, n), jnp.float32)
    y = jax.random.normal(ky, (n, n), jnp.float32)
    matmul = jax.jit(lambda a, b: a @ b)
    counted = count_flops(matmul, x, y)["flops"]
    if counted != 2 * n ** 3:
        raise AssertionError(f"counted {counted} FLOPs, expected 2 n^3 = {2 * n ** 3}")
    for _ in range(warmup):
        jax.block_until_ready(matmul(x, y))
    seconds = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(matmul(x, y))
        seconds.append(time.perf_counter() - t0)
    return {"n": n, "dtype": "float32", "flops": counted, "seconds": stats(seconds),
            "gflops_per_s": stats(counted / t / 1e9 for t in seconds)}


def update_rate(args, model_dir: Path) -> dict:
    """One ppo_step.py jax worker run; the update's counted FLOPs, time and GFLOP/s."""
    worker_args = Namespace(model_dir=str(model_dir), mode=args.mode, epochs=args.epochs,
                            batch=args.batch, new_tokens=args.new_tokens, steps=args.steps,
                            warmup=args.warmup, max_prompt_length=args.max_prompt_length,
                            seed=0, dtype="float32", remat="none")
    r = ppo_step.run_jax_worker(worker_args)
    counted = r["model_flops"]
    if counted is None:
        raise SystemExit("the update's FLOPs could not be counted (see above)")
    keep = ("model", "mode", "epochs", "batch", "new_tokens", "n_params", "n_params_critic",
            "prompt_width", "seq_tokens_mean", "warmup_steps", "measured_steps", "load_s",
            "first_step_s", "peak_rss_mib", "versions")
    return {**{k: r[k] for k in keep},
            "flops": counted["update"]["flops"], "xla_flops": counted["update"]["xla_flops"],
            "flops_6n": gpu_figures.phase_flops(r)["update"],
            "flops_source": counted["source"],
            "seconds": r["stats"]["time/update"],
            "gflops_per_s": r["stats"]["gflops_per_s/update"],
            "scoring_gflops_per_s": r["stats"]["gflops_per_s/scoring"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model-dir", default=None, help="HF directory (default: ensure_smollm2())")
    which.add_argument("--tiny", action="store_true", help="the tiny random Llama (a dry run)")
    parser.add_argument("--mode", choices=("shared", "separate"), default="shared")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--max-prompt-length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="measured PPO steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (compile)")
    parser.add_argument("--matmul", type=int, default=2048, help="N of the N x N x N matmul")
    parser.add_argument("--matmul-runs", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1")

    import jax

    cpu = cpu_info()
    log(f"CPU: {cpu_line(cpu)}; jax {jax.__version__} on {jax.devices()[0].device_kind}")
    mm = matmul_rate(args.matmul, args.matmul_runs)
    log(f"matmul {args.matmul}^3 float32: {mm['gflops_per_s']['median']:.1f} GFLOP/s (median of "
        f"{args.matmul_runs})")
    with tempfile.TemporaryDirectory(prefix="roofline_") as tmp:
        if args.tiny:
            from ppo_jax.models.tiny_random import ensure_tiny_random

            model_dir = ensure_tiny_random(Path(tmp) / "tiny-random-llama")
        else:
            model_dir = ppo_step.resolve_model_dir(args.model_dir)
        upd = update_rate(args, model_dir)
    data = {
        "bench": "roofline", "tiny": args.tiny,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu, "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
        "matmul": mm, "update": upd,
        "ratio": upd["gflops_per_s"]["median"] / mm["gflops_per_s"]["median"], "target": TARGET,
        "command": ppo_step.command_line(), "load_average": os.getloadavg()[0], **run_record(),
    }
    from sections import roofline_markdown

    print(roofline_markdown(data))
    if args.json:
        write_json(args.json, data)

if __name__ == "__main__":
    under_malloc_settings()  # as train.py runs (ppo_jax.trainer.host_memory)
    main()
