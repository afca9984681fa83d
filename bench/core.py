"""Benchmark of ppo_jax.core against the same work written the way TRL 0.11 writes it.

Work timed (one PPO "experience -> loss gradient" pass on response tokens, [B, T] float32):
reward shaping (k1 KL penalty + score on the last token), GAE, advantage whitening, the
clipped policy loss and the clipped value loss, forward and gradient w.r.t. the new log-probs
and the new values.

- JAX: one jitted function built from ``ppo_jax.core`` (compile time reported separately).
- torch: a re-implementation of TRL 0.11 ``PPOTrainer`` semantics written for this bench:
  ``compute_rewards`` with a per-row loop, ``compute_advantages`` with a per-token reversed
  Python loop, ``masked_whiten``, the loss with autograd ``backward``.

The two are checked to agree numerically before timing. Timing runs in ``--rounds`` interleaved
rounds; each round times every JAX version and then torch, each as a block of calls
(``--jax-block`` / ``--torch-block``, ``block_until_ready`` on the JAX side) right after a
warm-up of untimed calls of the same function, under the same rule on both sides (at least
``--warmup-calls`` calls and ``--warmup-s`` seconds). Per JAX version it quotes the ratio of
medians, the ratio of minima, and the median of the per-round ratios (torch block median / JAX
block median of the same round) with their min-max beside it. Also times the GAE alone, reverse
``lax.scan`` (several unrolls) against ``lax.associative_scan``.

Usage: ``python bench/core.py [--batch 256] [--length 1024] [--rounds 30] [--torch-block 3]
[--jax-block 10] [--warmup-calls 1] [--warmup-s 0.1] [--json PATH]``. `--json` writes the
figures (the `core.json` that `bench/report.py` reads), with the git commit they came from.
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
from common import cpu_info, cpu_line, machine_load, run_record, under_malloc_settings, stats, write_json  # noqa: E402
from ppo_jax import core  # noqa: E402

GAMMA, LAM, KL_COEF, CLIP, CLIP_V, VF_COEF = 1.0, 0.95, 0.05, 0.2, 0.2, 0.1


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


def warm(fn, min_calls: int, min_s: float, clock=time.perf_counter) -> int:
    """Untimed calls of ``fn`` until at least ``min_calls`` calls and ``min_s`` seconds have
    passed (the same rule for both sides: a fast function gets more calls); returns the count."""
    t0, calls = clock(), 0
    while calls < min_calls or clock() - t0 < min_s:
        fn()
        calls += 1
    return calls


def interleaved(fns: dict, rounds: int, block: dict, warmup_calls: int, warmup_s: float,
                clock=time.perf_counter) -> dict[str, list[list[float]]]:
    """Time ``fns`` (name -> callable) in ``rounds`` rounds; each round, for each name in order,
    warms that function (``warm``) and then times ``block[name]`` calls of it one by one.
    Returns name -> one list of per-call times (ms) per round: ``[rounds][block[name]]``."""
    out = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            warm(fn, warmup_calls, warmup_s, clock)
            times = []
            for _ in range(block[name]):
                t0 = clock()
                fn()
                times.append(1e3 * (clock() - t0))
            out[name].append(times)
    return out


def compare(ref_blocks: list[list[float]], ours_blocks: list[list[float]]) -> dict:
    """How much faster ours is than the reference, from the blocks of the same rounds
    (``interleaved``): ratio of medians and of minima over all calls, and ``paired_ratio``, the
    stats (median, min, max) of the per-round ratios ref block median / ours block median."""
    ref = [t for b in ref_blocks for t in b]
    ours = [t for b in ours_blocks for t in b]
    pairs = [statistics.median(r) / statistics.median(o) for r, o in zip(ref_blocks, ours_blocks)]
    return {"ratio_of_medians": statistics.median(ref) / statistics.median(ours),
            "ratio_of_minima": min(ref) / min(ours), "paired_ratio": stats(pairs)}


def side_figures(blocks: list[list[float]]) -> dict:
    """Median and min (ms per call) over every timed call of one side."""
    calls = [t for b in blocks for t in b]
    return {"median_ms": statistics.median(calls), "min_ms": min(calls), "calls": len(calls)}


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
    parser.add_argument("--rounds", type=int, default=30,
                        help="interleaved rounds (each: every JAX version, then torch)")
    parser.add_argument("--torch-block", type=int, default=3, help="timed torch calls per round")
    parser.add_argument("--jax-block", type=int, default=10,
                        help="timed calls of each JAX version per round (also: runs of each "
                             "GAE-alone timing = rounds x this)")
    parser.add_argument("--warmup-calls", type=int, default=1,
                        help="untimed calls right before every timed block, both sides")
    parser.add_argument("--warmup-s", type=float, default=0.1,
                        help="... and at least this many seconds of them")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    if min(args.rounds, args.torch_block, args.jax_block) < 1:
        parser.error("--rounds, --torch-block and --jax-block must be >= 1")
    inputs = make_inputs(args.batch, args.length)
    ja, ta = jax_args(inputs), torch_args(inputs)

    print(f"ppo_jax.core benchmark: B={args.batch} T={args.length} float32")
    print(f"CPU: {cpu_line(cpu_info())}")
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

    # interleaved rounds: every JAX version, then torch; each block right after its own warm-up
    fns = {label: (lambda fn=fn: jax.block_until_ready(fn(*ja))) for label, fn in compiled.items()}
    fns["torch"] = lambda: torch_step(*ta)
    block = {name: args.jax_block for name in compiled} | {"torch": args.torch_block}
    blocks = interleaved(fns, args.rounds, block, args.warmup_calls, args.warmup_s)
    side = {name: side_figures(b) for name, b in blocks.items()}
    vs = {label: compare(blocks["torch"], blocks[label]) for label in compiled}

    print(f"\nfull pass (rewards + GAE + whiten + policy/value loss fwd+grad), {args.rounds} "
          "interleaved rounds; median (min) ms per call; speed-up vs torch: ratio of medians, "
          "of minima, and per-round ratios median (min-max):")
    t = side["torch"]
    print(f"  torch, TRL 0.11 style            {t['median_ms']:8.3f} ms ({t['min_ms']:.3f})"
          f"   [{t['calls']} calls]")
    for label in compiled:
        j, c, p = side[label], vs[label], vs[label]["paired_ratio"]
        print(f"  jax jit, GAE {label:20s}{j['median_ms']:8.3f} ms ({j['min_ms']:.3f})"
              f"   x{c['ratio_of_medians']:5.1f}  min/min x{c['ratio_of_minima']:5.1f}  paired "
              f"x{p['median']:5.1f} (x{p['min']:.1f}-x{p['max']:.1f})"
              f"   compile {compile_s[label]:.2f} s   [{j['calls']} calls]")

    gae_alone = {}
    print("\nGAE alone (jitted, [B, T]); median (min) per call:")
    v, r, m = (jnp.asarray(inputs[n]) for n in ("values", "new_values", "mask"))
    for method, unroll, chunk in (("chunked", 1, 16), ("chunked", 1, 32), ("chunked", 1, 64), ("scan", 1, 1),
                                  ("scan", 4, 1), ("scan", 16, 1), ("associative", 1, 1)):
        gae = jax.jit(lambda v, r, m: core.compute_gae(v, r, m, gamma=GAMMA, lam=LAM, method=method,
                                                       unroll=unroll, chunk=chunk))
        jax.block_until_ready(gae(v, r, m))
        gae_med, gae_min = time_ms(lambda: jax.block_until_ready(gae(v, r, m)),
                                   args.rounds * args.jax_block)
        print(f"  {gae_label(method, unroll, chunk):22s}{gae_med:8.3f} ms ({gae_min:.3f})")
        gae_alone[gae_label(method, unroll, chunk)] = {"median_ms": gae_med, "min_ms": gae_min}

    label = gae_label(*default)
    c, p = vs[label], vs[label]["paired_ratio"]
    print(f"\nRESULT default GAE {label}: jax {side[label]['median_ms']:.3f} ms vs torch "
          f"{side['torch']['median_ms']:.3f} ms (medians) -> x{c['ratio_of_medians']:.1f}; "
          f"min/min x{c['ratio_of_minima']:.1f}; per-round ratios x{p['median']:.1f} "
          f"(x{p['min']:.1f}-x{p['max']:.1f}); load average {os.getloadavg()[0]:.2f}")

    if args.json:
        data = {
            "bench": "core", "batch": args.batch, "length": args.length, "dtype": "float32",
            "rounds": args.rounds, "torch_block": args.torch_block, "jax_block": args.jax_block,
            "warmup_calls": args.warmup_calls, "warmup_s": args.warmup_s,
            "runs": side["torch"]["calls"], "jax_runs": args.rounds * args.jax_block,
            "default_gae": label,
            "torch": {k: side["torch"][k] for k in ("median_ms", "min_ms")},
            "jax": {k: {"median_ms": side[k]["median_ms"], "min_ms": side[k]["min_ms"],
                        "compile_s": compile_s[k], **vs[k]} for k in compiled},
            "gae_alone": gae_alone,
            "speedup_default": c["ratio_of_medians"],
            "versions": {"jax": jax.__version__, "torch": torch.__version__},
            "torch_threads": torch.get_num_threads(), "platform": jax.devices()[0].platform,
            **machine_load(), **run_record(),
            "command": ".venv/bin/python bench/core.py " + shlex.join(sys.argv[1:]),
        }
        write_json(args.json, data)


if __name__ == "__main__":
    under_malloc_settings()  # as train.py runs (ppo_jax.trainer.host_memory)
    main()
