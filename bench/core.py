"""ppo_jax.core's PPO math (reward shaping, GAE, whitening, clipped losses, gradient) jitted,
against the same work written as TRL 0.11 does in torch (checked to agree first), float32, in
interleaved rounds. (GAE's methods against each other: docs/benchmarks.md, "Studies".)

Usage: python bench/core.py [--batch 256] [--length 1024] [--rounds 30] [--torch-block 3]
    [--jax-block 10] [--warmup-s 0.1] [--json PATH]
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from harness import compare, finish, interleaved, log, options, ratio, stats, table, under_malloc_settings
from ppo_jax import core

GAMMA, LAM, KL_COEF, CLIP, CLIP_V, VF_COEF = 1.0, 0.95, 0.05, 0.2, 0.2, 0.1
NAMES = ("scores", "logprobs", "ref_logprobs", "values", "mask", "new_logprobs", "new_values")


def make_inputs(batch: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, length + 1, size=batch)  # TRL needs non-empty rows
    lengths[0] = length  # one full row
    logprobs = -np.abs(rng.normal(1.0, 1.0, (batch, length))).astype(np.float32)
    arrays = {"scores": rng.normal(0.0, 1.0, batch), "logprobs": logprobs,
              "ref_logprobs": logprobs + rng.normal(0.0, 0.1, (batch, length)),
              "values": rng.normal(0.0, 1.0, (batch, length)),
              "mask": np.arange(length)[None, :] < lengths[:, None],
              "new_logprobs": logprobs + rng.normal(0.0, 0.15, (batch, length)),
              "new_values": rng.normal(0.0, 1.0, (batch, length))}
    return {k: v.astype(np.float32) for k, v in arrays.items()}


@jax.jit
def jax_step(scores, logprobs, ref_logprobs, values, mask, new_logprobs, new_values, kl_coef):
    """The pass with ppo_jax.core, GAE by its default method."""
    rewards, _ = core.compute_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=kl_coef)
    adv, returns = core.compute_gae(values, rewards, mask, gamma=GAMMA, lam=LAM)
    adv = core.masked_whiten(adv, mask)

    def loss_fn(nlp, nv):
        pg, _ = core.policy_loss(nlp, logprobs, adv, mask, cliprange=CLIP)
        vf, _ = core.value_loss(nv, values, returns, mask, cliprange_value=CLIP_V)
        return pg + VF_COEF * vf

    loss, (g_lp, g_v) = jax.value_and_grad(loss_fn, argnums=(0, 1))(new_logprobs, new_values)
    return loss, g_lp, g_v, adv, returns


# --------------------------------------------------------------------------- torch (TRL 0.11)
def t_masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def t_masked_whiten(x, mask):
    mean, n = t_masked_mean(x, mask), mask.sum()
    var = t_masked_mean((x - mean) ** 2, mask) * n / (n - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def torch_step(scores, logprobs, ref_logprobs, values, mask, new_logprobs, new_values, kl_coef):
    rows = []  # compute_rewards: one row at a time, the score at the last non-masked index
    for score, lp, ref, m in zip(scores, logprobs, ref_logprobs, mask):
        reward = -kl_coef * (lp - ref)
        reward[m.nonzero()[-1]] += score
        rows.append(reward)
    values, rewards = values * mask, torch.stack(rows) * mask
    length, last_gae, reversed_adv = rewards.shape[-1], 0.0, []
    for t in reversed(range(length)):  # compute_advantages: per-token reversed loop
        next_values = values[:, t + 1] if t < length - 1 else 0.0
        last_gae = rewards[:, t] + GAMMA * next_values - values[:, t] + GAMMA * LAM * last_gae
        reversed_adv.append(last_gae)
    adv = torch.stack(reversed_adv[::-1]).transpose(0, 1)
    returns = adv + values
    adv = t_masked_whiten(adv, mask).detach()
    new_logprobs = new_logprobs.detach().requires_grad_(True)
    new_values = new_values.detach().requires_grad_(True)
    v_clipped = torch.clamp(new_values, values - CLIP_V, values + CLIP_V)
    vf = 0.5 * t_masked_mean(torch.max((new_values - returns) ** 2, (v_clipped - returns) ** 2), mask)
    ratio_ = torch.exp(new_logprobs - logprobs)
    pg = t_masked_mean(torch.max(-adv * ratio_, -adv * torch.clamp(ratio_, 1 - CLIP, 1 + CLIP)), mask)
    loss = pg + VF_COEF * vf
    loss.backward()
    return loss.detach(), new_logprobs.grad, new_values.grad, adv, returns


def check_agree(jax_out, torch_out, mask):
    valid = mask > 0
    for name, a, b in zip(("loss", "grad logprobs", "grad values", "advantages", "returns"), jax_out, torch_out):
        a, b = np.asarray(a, np.float64), b.numpy().astype(np.float64)
        if name in ("advantages", "returns"):  # TRL leaves garbage on padding
            a, b = a[valid], b[valid]
        scale = max(np.abs(b).max(), 1e-30)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale, err_msg=name)


def side_figures(blocks: list[list[float]]) -> dict:
    """The stats of every timed call of one side, in ms."""
    return stats(1e3 * t for b in blocks for t in b)


def markdown(d: dict) -> str:
    t, j, p = d["torch"], d["jax"], d["jax"]["paired_ratio"]
    rows = [["torch, TRL 0.11 style", f"{t['median']:.3f} ({t['min']:.3f})", "×1.0", "×1.0", "—", "—"],
            [f"ppo_jax.core, jax jit (GAE: {d['gae']}, the default)", f"{j['median']:.3f} ({j['min']:.3f})",
             ratio(j["ratio_of_medians"], 1), ratio(j["ratio_of_minima"], 1),
             f"×{p['median']:.1f} (×{p['min']:.1f}–×{p['max']:.1f}, {p['n']} rounds)", f"{j['compile_s']:.2f}"]]
    return "\n".join([
        f"B={d['batch']}, T={d['length']}, float32; torch with TRL 0.11's Python loops. ms per call: "
        f"median (min) of every timed call of {d['rounds']} interleaved rounds, in blocks of "
        f"{d['jax_block']} (JAX) and {d['torch_block']} (torch) calls after {d['warmup_calls']}+ "
        f"untimed calls and {d['warmup_s']:g}+ s; speed-up vs torch: median/median, min/min, per round.", "",
        table(["implementation", "ms per call", "median / median", "min / min", "per-round ratios",
               "compile s"], rows)])


def main() -> None:
    args = options(__doc__, batch=256, length=1024, rounds=30, torch_block=3, jax_block=10,
                   warmup_s=0.1, json=None)
    args.warmup_calls = 1  # untimed calls right before every timed block, both sides
    inputs = make_inputs(args.batch, args.length)
    ja = [jnp.asarray(inputs[n]) for n in NAMES] + [jnp.asarray(KL_COEF, jnp.float32)]
    ta = [torch.from_numpy(inputs[n].copy()) for n in NAMES] + [KL_COEF]
    log(f"B={args.batch} T={args.length}; jax {jax.__version__}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads)")

    t0 = time.perf_counter()
    compiled = jax_step.lower(*ja).compile()
    compile_s = time.perf_counter() - t0
    check_agree(jax.block_until_ready(compiled(*ja)), torch_step(*ta), inputs["mask"])
    log("numerics: JAX == torch/TRL (loss, both gradients, advantages, returns)")

    fns = {"jax": lambda: jax.block_until_ready(compiled(*ja)), "torch": lambda: torch_step(*ta)}
    blocks = interleaved(fns, args.rounds, {"jax": args.jax_block, "torch": args.torch_block},
                         args.warmup_calls, args.warmup_s)
    finish({"bench": "core", **vars(args), "dtype": "float32", "gae": core.gae.DEFAULT_GAE_METHOD,
            "torch": side_figures(blocks["torch"]),
            "jax": {**side_figures(blocks["jax"]), "compile_s": compile_s, **compare(blocks["torch"], blocks["jax"])},
            "versions": {"jax": jax.__version__, "torch": torch.__version__},
            "torch_threads": torch.get_num_threads(), "platform": jax.devices()[0].platform}, markdown, args.json)


if __name__ == "__main__":
    under_malloc_settings()  # as train.py runs (ppo_jax.trainer.host.memory)
    main()
