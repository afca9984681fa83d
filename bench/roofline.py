"""Roofline: the PPO update's counted model-FLOP rate (bench/ppo_step.py's worker, in this
process, SmolLM2-135M; `--tiny`: a dry run) against a large jitted float32 matmul's, one run.

Usage: python bench/roofline.py [--tiny] [--batch 8] [--new-tokens 48] [--steps 3] [--warmup 1]
    [--matmul 2048] [--matmul-runs 10] [--json PATH]
"""

from __future__ import annotations

import tempfile
from argparse import Namespace
from pathlib import Path

import gpu
import ppo_step
from harness import finish, fmt, log, options, spread, stats, table, timed, under_malloc_settings

TARGET = 0.5  # issue 13: the update at >= 50% of the matmul rate


def matmul_rate(n: int, runs: int, warmup: int = 2) -> dict:
    """Time `runs` calls of a jitted `[n, n] @ [n, n]` float32 matmul after `warmup` calls."""
    import jax
    import jax.numpy as jnp
    from flops import count_flops

    kx, ky = jax.random.split(jax.random.PRNGKey(0))
    x, y = jax.random.normal(kx, (n, n), jnp.float32), jax.random.normal(ky, (n, n), jnp.float32)
    matmul = jax.jit(lambda a, b: a @ b)
    counted = count_flops(matmul, x, y)["flops"]
    if counted != 2 * n ** 3:
        raise AssertionError(f"counted {counted} FLOPs, expected 2 n^3 = {2 * n ** 3}")
    for _ in range(warmup):
        jax.block_until_ready(matmul(x, y))
    seconds = [timed(lambda: jax.block_until_ready(matmul(x, y))) for _ in range(runs)]
    return {"n": n, "dtype": "float32", "flops": counted, "seconds": stats(seconds),
            "gflops_per_s": stats(counted / t / 1e9 for t in seconds)}


def update_rate(args, model_dir: Path) -> dict:
    """One ppo_step.py jax worker run in this process: its result, the update's counted FLOPs and rate."""
    r = ppo_step.run_jax_worker(Namespace(**vars(args), model_dir=str(model_dir), mode="shared", epochs=1,
                                          dtype="float32"))
    if (counted := r["model_flops"]) is None:
        raise SystemExit("the update's FLOPs could not be counted (see above)")
    return {**r, "flops": counted["update"]["flops"], "xla_flops": counted["update"]["xla_flops"],
            "flops_6n": gpu.phase_flops(r)["update"], "flops_source": counted["source"],
            "seconds": r["stats"]["time/update"], "gflops_per_s": r["stats"]["gflops_per_s/update"],
            "scoring_gflops_per_s": r["stats"]["gflops_per_s/scoring"]}


def markdown(d: dict) -> str:
    """The update's model-FLOP rate against a large matmul's."""
    mm, u, n = d["matmul"], d["update"], d["matmul"]["n"]
    gflop = lambda x: "n/a" if x is None else f"{x / 1e9:.3g}"  # noqa: E731
    rows = [[f"matmul {n}x{n}x{n} (jitted `x @ y`)", spread(mm["gflops_per_s"], 1),
             f"{gflop(mm['flops'])} (2 N^3)", spread(mm["seconds"], 3)],
            [f"PPO update: `{u['model']}`, {u['mode']} critic, {u['epochs']} epoch(s), batch "
             f"{u['batch']}, {u['new_tokens']} new tokens", spread(u["gflops_per_s"], 1),
             f"{gflop(u['flops'])} per step (XLA cost analysis {gflop(u['xla_flops'])}, 6N model "
             f"{gflop(u['flops_6n'])})", spread(u["seconds"], 3)]]
    return "\n".join([
        f"jax {d['jax']}, float32, one process."
        + (" DRY RUN on the tiny random model: not a figure to quote." if d["tiny"] else "")
        + f" GFLOP/s: median (min–max); the update's FLOPs are the matmuls of its compiled "
        f"program ({u['flops_source']}), attention included.", "",
        table(["work", "GFLOP/s", "GFLOP", "seconds"], rows), "",
        f"Update / matmul rate: **{d['ratio']:.2f}** (target ≥ {d['target']:.2f}); scoring ran "
        f"at {fmt(u['scoring_gflops_per_s']['median'], 1)} GFLOP/s. XLA's cost analysis counts "
        "each loop body once (the layers are a `lax.scan`), hence its lower figure."])


def main() -> None:
    args = options(__doc__, tiny=False, batch=8, new_tokens=48, max_prompt_length=64, steps=3,
                   warmup=1, matmul=2048, matmul_runs=10, json=None)
    import jax

    mm = matmul_rate(args.matmul, args.matmul_runs)
    log(f"matmul {args.matmul}^3 float32: {mm['gflops_per_s']['median']:.1f} GFLOP/s")
    with tempfile.TemporaryDirectory(prefix="roofline_") as tmp:
        upd = update_rate(args, ppo_step.resolve_model_dir(None, args.tiny and tmp))
    finish({"bench": "roofline", "tiny": args.tiny,
            "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__, "matmul": mm,
            "update": upd, "ratio": upd["gflops_per_s"]["median"] / mm["gflops_per_s"]["median"],
            "target": TARGET}, markdown, args.json)


if __name__ == "__main__":
    under_malloc_settings()  # as train.py runs (ppo_jax.trainer.host.memory)
    main()
