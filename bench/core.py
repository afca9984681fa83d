"""Benchmark of ppo_jax.core against the same work written the way TRL 0.11 writes it.

Work timed (one PPO "experience -> loss gradient" pass on response tokens, [B, T] float32):
reward shaping (k1 KL penalty + score on the last token), GAE, advantage whitening, the
clipped policy loss and the clipped value loss, forward and gradient w.r.t. the new log-probs
and the new values.

- JAX: one jitted function built from ``ppo_jax.core`` (compile time reported separately, then
  the median of many runs with ``block_until_ready``).
- torch: a re-implementation of TRL 0.11 ``PPOTrainer`` semantics written for this bench:
  ``compute_rewards`` with a per-row loop, ``compute_advantages`` with a per-token reversed
  Python loop, ``masked_whiten``, the loss with autograd ``backward``.

The two are checked to agree numerically before timing. Also times the GAE alone, reverse
``lax.scan`` (several unrolls) against ``lax.associative_scan``.

Usage: ``python bench/core.py [--batch 256] [--length 1024] [--runs 30] [--jax-runs 300]
[--json PATH]``. `--json` writes the figures (the `core.json` that `bench/report.py` reads).
torch is a benchmark-only dependency.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_load, write_json  # noqa: E402
from ppo_jax import core  # noqa: E402

GAMMA, LAM, KL_COEF, CLIP, CLIP_V, VF_COEF = 1.0, 0.95, 0.05, 0.2, 0.2, 0.1
WARMUP = 50  # untimed calls before each timed JAX block


# --------------------------------------------------------------------------- inputs
def make_inputs(batch: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, length + 1, size=batch)  # TRL needs non-empty rows
    lengths[0] = length  # one full row
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)
    logprobs = -np.abs(rng.normal(1.0, 1.0, (batch, length))).astype(np.float32)
    f32 = lambda x: x.astype(np.float32)
    return {
        "scores": f32(rng.normal(0.0, 1.0, batch)),
        "logprobs": logprobs,
        "ref_logprobs": f32(logprobs + rng.normal(0.0, 0.1, (batch, length))),
        "values": f32(rng.normal(0.0, 1.0, (batch, length))),
        "mask": mask,
        "new_logprobs": f32(logprobs + rng.normal(0.0, 0.15, (batch, length))),
        "new_values": f32(rng.normal(0.0, 1.0, (batch, length))),
    }


# --------------------------------------------------------------------------- JAX
def make_jax_step(method: str, unroll: int = 1, chunk: int = 32):
    def step(scores, logprobs, ref_logprobs, values, mask, new_logprobs, new_values, kl_coef):
        rewards, _ = core.compute_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=kl_coef)
        adv, returns = core.compute_gae(values, rewards, mask, gamma=GAMMA, lam=LAM, method=method,
                                       unroll=unroll, chunk=chunk)
        adv = core.masked_whiten(adv, mask)

        def loss_fn(nlp, nv):
            pg, _ = core.policy_loss(nlp, logprobs, adv, mask, cliprange=CLIP)
            vf, _ = core.value_loss(nv, values, returns, mask, cliprange_value=CLIP_V)
            return pg + VF_COEF * vf

        loss, (g_lp, g_v) = jax.value_and_grad(loss_fn, argnums=(0, 1))(new_logprobs, new_values)
        return loss, g_lp, g_v, adv, returns

    return jax.jit(step)


def jax_args(inputs):
    names = ("scores", "logprobs", "ref_logprobs", "values", "mask", "new_logprobs", "new_values")
    return [jnp.asarray(inputs[n]) for n in names] + [jnp.asarray(KL_COEF, jnp.float32)]


# --------------------------------------------------------------------------- torch (TRL 0.11 semantics)
def t_masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def t_masked_var(x, mask):
    mean = t_masked_mean(x, mask)
    var = t_masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    return var * n / (n - 1)


def t_masked_whiten(x, mask):
    mean, var = t_masked_mean(x, mask), t_masked_var(x, mask)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def torch_step(scores, logprobs, ref_logprobs, values, mask, new_logprobs, new_values, kl_coef):
    # compute_rewards: one row at a time, the score added at the last non-masked index.
    rows = []
    for score, lp, ref, m in zip(scores, logprobs, ref_logprobs, mask):
        reward = -kl_coef * (lp - ref)
        last = m.nonzero()[-1]
        reward[last] += score
        rows.append(reward)
    rewards = torch.stack(rows)
    # compute_advantages: per-token reversed loop over the response length.
    values = values * mask
    rewards = rewards * mask
    length = rewards.shape[-1]
    last_gae = 0.0
    reversed_adv = []
    for t in reversed(range(length)):
        next_values = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + GAMMA * next_values - values[:, t]
        last_gae = delta + GAMMA * LAM * last_gae
        reversed_adv.append(last_gae)
    adv = torch.stack(reversed_adv[::-1]).transpose(0, 1)
    returns = adv + values
    adv = t_masked_whiten(adv, mask).detach()
    # loss: clipped value + clipped policy, autograd backward.
    new_logprobs = new_logprobs.detach().requires_grad_(True)
    new_values = new_values.detach().requires_grad_(True)
    v_clipped = torch.clamp(new_values, values - CLIP_V, values + CLIP_V)
    vf = 0.5 * t_masked_mean(torch.max((new_values - returns) ** 2, (v_clipped - returns) ** 2), mask)
    ratio = torch.exp(new_logprobs - logprobs)
    pg = t_masked_mean(torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP)), mask)
    loss = pg + VF_COEF * vf
    loss.backward()
    return loss.detach(), new_logprobs.grad, new_values.grad, adv, returns


def torch_args(inputs):
    names = ("scores", "logprobs", "ref_logprobs", "values", "mask", "new_logprobs", "new_values")
    return [torch.from_numpy(inputs[n].copy()) for n in names] + [KL_COEF]


# --------------------------------------------------------------------------- timing
def time_ms(fn, runs: int) -> tuple[float, float]:
    """(median, min) wall time of ``fn()`` in ms over ``runs`` calls."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times), 1e3 * min(times)


def check_agree(jax_out, torch_out, mask):
    valid = mask > 0
    names = ("loss", "grad logprobs", "grad values", "advantages", "returns")
    for name, a, b in zip(names, jax_out, torch_out):
        a, b = np.asarray(a, np.float64), b.numpy().astype(np.float64)
        if name in ("advantages", "returns"):  # TRL leaves garbage on padding
            a, b = a[valid], b[valid]
        scale = max(np.abs(b).max(), 1e-30)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale, err_msg=name)


def gae_label(method: str, unroll: int, chunk: int) -> str:
    return {"scan": f"scan(unroll={unroll})", "chunked": f"chunked(chunk={chunk})"}.get(method, method)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=30, help="timed runs of the torch version")
    parser.add_argument("--jax-runs", type=int, default=300, help="timed runs of each JAX version")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    inputs = make_inputs(args.batch, args.length)
    ja, ta = jax_args(inputs), torch_args(inputs)

    print(f"ppo_jax.core benchmark: B={args.batch} T={args.length} float32")
    print(f"machine: {os.cpu_count()} CPU cores; jax {jax.__version__} on {jax.devices()[0].platform}; "
          f"torch {torch.__version__} with {torch.get_num_threads()} threads (default); "
          f"load average {os.getloadavg()[0]:.2f} (timings are wall clock: other load inflates them)")

    torch_out = torch_step(*ta)
    default = (core.gae.DEFAULT_GAE_METHOD, core.gae.DEFAULT_UNROLL, core.gae.DEFAULT_CHUNK)
    others = (("chunked", 1, 16), ("scan", 1, 0), ("scan", 16, 0), ("associative", 0, 0))
    compiled, compile_s = {}, {}
    for method, unroll, chunk in [default] + [c for c in others if c != default]:
        label = gae_label(method, unroll, chunk)
        t0 = time.perf_counter()
        compiled[label] = make_jax_step(method, max(unroll, 1), max(chunk, 1)).lower(*ja).compile()
        compile_s[label] = time.perf_counter() - t0
        check_agree(jax.block_until_ready(compiled[label](*ja)), torch_out, inputs["mask"])
    print("numerics: JAX (every GAE method) == torch/TRL (loss, both gradients, advantages, returns)")

    # torch first, then each JAX version in turn; the first WARMUP calls of each JAX block are
    # untimed (right after the torch runs, XLA:CPU calls were measured up to 2x slower for a
    # few tens of ms on a 2-core machine).
    times = {"torch": [time_ms(lambda: torch_step(*ta), 1)[0] for _ in range(args.runs)]}
    time.sleep(1.0)
    for label, fn in compiled.items():
        for _ in range(WARMUP):
            jax.block_until_ready(fn(*ja))
        times[label] = [time_ms(lambda: jax.block_until_ready(fn(*ja)), 1)[0] for _ in range(args.jax_runs)]
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}

    print("\nfull pass (rewards + GAE + whiten + policy/value loss fwd+grad); median (min) per call:")
    print(f"  torch, TRL 0.11 style            {med['torch']:8.3f} ms ({best['torch']:.3f})"
          f"   [{args.runs} runs]")
    for label in compiled:
        print(f"  jax jit, GAE {label:20s}{med[label]:8.3f} ms ({best[label]:.3f})"
              f"   x{med['torch'] / med[label]:5.1f} (min/min x{best['torch'] / best[label]:5.1f})"
              f"   compile {compile_s[label]:.2f} s   [{len(times[label])} runs]")

    gae_alone = {}
    print("\nGAE alone (jitted, [B, T]); median (min) per call:")
    v, r, m = (jnp.asarray(inputs[n]) for n in ("values", "new_values", "mask"))
    for method, unroll, chunk in (("chunked", 1, 16), ("chunked", 1, 32), ("chunked", 1, 64), ("scan", 1, 1),
                                  ("scan", 4, 1), ("scan", 16, 1), ("associative", 1, 1)):
        gae = jax.jit(lambda v, r, m: core.compute_gae(v, r, m, gamma=GAMMA, lam=LAM, method=method,
                                                       unroll=unroll, chunk=chunk))
        jax.block_until_ready(gae(v, r, m))
        gae_med, gae_min = time_ms(lambda: jax.block_until_ready(gae(v, r, m)), args.jax_runs)
        print(f"  {gae_label(method, unroll, chunk):22s}{gae_med:8.3f} ms ({gae_min:.3f})")
        gae_alone[gae_label(method, unroll, chunk)] = {"median_ms": gae_med, "min_ms": gae_min}

    label = gae_label(*default)
    print(f"\nRESULT default GAE {label}: jax {med[label]:.3f} ms vs torch {med['torch']:.3f} ms (medians)"
          f" -> x{med['torch'] / med[label]:.1f}; min/min x{best['torch'] / best[label]:.1f}; "
          f"load average {os.getloadavg()[0]:.2f}")

    if args.json:
        data = {
            "bench": "core", "batch": args.batch, "length": args.length, "dtype": "float32",
            "runs": args.runs, "jax_runs": args.jax_runs, "default_gae": label,
            "torch": {"median_ms": med["torch"], "min_ms": best["torch"]},
            "jax": {k: {"median_ms": med[k], "min_ms": best[k], "compile_s": compile_s[k]}
                    for k in compiled},
            "gae_alone": gae_alone,
            "speedup_default": med["torch"] / med[label],
            "versions": {"jax": jax.__version__, "torch": torch.__version__},
            "torch_threads": torch.get_num_threads(), "platform": jax.devices()[0].platform,
            **machine_load(),
            "command": ".venv/bin/python bench/core.py " + shlex.join(sys.argv[1:]),
        }
        write_json(args.json, data)


if __name__ == "__main__":
    main()
