"""The PPO update over packed rows (`ppo.packing`) against padded rows: useful tokens per second
of one jitted `ppo_update` (critic-free, one epoch) on a heavy-tailed batch, SmolLM2-135M's
shape with random float32 weights, the same experience on both sides.

Useful tokens are the batch's real prompt and response tokens; both sides compute the same
losses and gradients on them (tests/trainer/test_packed_update.py). A third row, packed with
the LM head over the padded `[B, N]` responses, measures the head over real tokens only. Response lengths are
lognormal, scaled so that the longest is `--new-tokens` and the mean over the max is
`--mean-over-max` (0.5: half of a padded batch's response slots are padding); prompts are 8 to
`--prompt` tokens. Each round times both sides, in alternating order, after a warm-up call
(compiles); the figure is the median over rounds.

Usage: python bench/packing.py [--batch 16] [--micro 8] [--prompt 32] [--new-tokens 256]
    [--mean-over-max 0.5] [--rounds 3] [--tiny] [--json PATH]
    (--tiny: the tiny random shape, a check of the script, not a figure)
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from harness import ROOT, finish, fmt, interleaved, log, options, stats


def lengths(args, rng) -> tuple[np.ndarray, np.ndarray]:
    """`(prompt lengths, response lengths)` `[batch]`: prompts 8 to `--prompt` tokens,
    responses `rollout.packing.heavy_tailed_lengths` (log-normal, max `--new-tokens`, mean /
    max `--mean-over-max`)."""
    from ppo_jax.rollout.packing import heavy_tailed_lengths

    r = heavy_tailed_lengths(args.batch, args.new_tokens, args.mean_over_max)
    return rng.integers(8, args.prompt + 1, args.batch), r


def experience(q_lens, r_lens, args, vocab, rng):
    """An `Experience` of random tokens with these lengths (left-padded prompts)."""
    import jax.numpy as jnp

    from ppo_jax.trainer.stages.ppo.experience import Experience

    b, p, n = args.batch, args.prompt, args.new_tokens
    qm = (np.arange(p)[None] >= p - q_lens[:, None]).astype(np.int32)
    rm = (np.arange(n)[None] < r_lens[:, None]).astype(np.int32)
    ids = lambda shape: rng.integers(4, vocab, shape).astype(np.int32)  # noqa: E731
    f = lambda: jnp.asarray(rng.normal(0, 0.1, (b, n)), jnp.float32) * rm  # noqa: E731
    logprobs = jnp.asarray(-np.abs(rng.normal(2.0, 0.5, (b, n))), jnp.float32) * rm
    return Experience(
        query_ids=jnp.asarray(ids((b, p)) * qm), query_mask=jnp.asarray(qm),
        response_ids=jnp.asarray(ids((b, n)) * rm), response_mask=jnp.asarray(rm),
        logprobs=logprobs, ref_logprobs=logprobs, values=f(), scores=jnp.zeros(b), rewards=f(),
        advantages=f(), returns=f(), group_ids=jnp.arange(b, dtype=jnp.int32),
        rollout_logprobs=logprobs, action_mask=jnp.asarray(rm), routes=None)


def build(args):
    """`{"padded": fn, "packed": fn}`, each one update call blocked on, and the figures."""
    import jax
    import optax

    from ppo_jax.models import split_model
    from ppo_jax.models.heads import init_model
    from ppo_jax.models.hf_io import load_model_config
    from ppo_jax.models.tiny_random import tiny_config
    from ppo_jax.parallel.mesh import make_mesh
    from ppo_jax.rollout.forward import Rollout
    from ppo_jax.trainer.placement import Placement
    from ppo_jax.trainer.stages.ppo.packing import Packer
    from ppo_jax.trainer.stages.ppo.update import ppo_update
    from ppo_jax.trainer.state import TrainState
    from ppo_jax.trainer.config import load_config
    from ppo_jax.trainer.stages.ppo.settings import update_settings

    cfg = (tiny_config(512) if args.tiny else
           load_model_config(ROOT / "configs/model_shapes/smollm2-135m-instruct", dtype="float32",
                             param_dtype="float32"))
    graphdef, params = split_model(init_model(cfg, seed=0))
    rng = np.random.default_rng(0)
    q_lens, r_lens = lengths(args, rng)
    exp = experience(q_lens, r_lens, args, cfg.vocab_size, rng)
    s = replace(update_settings(load_config(None), shared_critic=False), max_response_length=None,
                mini_batch_size=args.batch, micro_batch_size=args.micro, ppo_epochs=1)
    tx = optax.sgd(1e-4)
    key = jax.random.PRNGKey(0)
    packer = Packer(Placement(make_mesh(data=1, devices=jax.devices()[:1])),
                    micro_batch_size=args.micro, mini_batch_size=args.batch, ppo_epochs=1)
    r = Rollout(exp.query_ids, exp.query_mask, exp.response_ids, exp.response_mask)
    plan, figures = packer.update(r, packer.lengths(r), key)
    update = jax.jit(lambda a, e, k, p: ppo_update(a, None, None, e, k, p, actor_graphdef=graphdef,
                                                   critic_graphdef=None, actor_tx=tx,
                                                   critic_tx=None, settings=s))
    state = TrainState.create(params, tx)

    def call(p):
        return lambda: jax.block_until_ready(update(state, exp, key, p))
    figures.update(useful_tokens=int(q_lens.sum() + r_lens.sum()),
                   response_mean_over_max=float(r_lens.mean() / args.new_tokens))
    # the LM head over the padded [B, N] responses, as before it ran over the real tokens only
    padded_head = plan.replace(rows=plan.rows.replace(head_src=None, head_dst=None))
    return {"padded": call(None), "packed": call(plan), "packed_padded_head": call(padded_head)}, figures


def render(d: dict) -> str:
    rows = ["| rows | update s (median, min-max) | useful tokens/s | slots filled |",
            "| --- | --- | --- | --- |"]
    for name in d["times"]:
        st, fill = d["times"][name], d["figures"][f"packing/update_{'padded_' if name == 'padded' else ''}fill"]
        rows.append(f"| {name} | {fmt(st['median'])} ({fmt(st['min'])}-{fmt(st['max'])}) | "
                    f"{fmt(d['useful_tokens_per_s'][name])} | {fill:.2f} |")
    return "\n".join(rows) + (f"\n\npacked / padded useful tokens/s: **x{d['ratio']:.2f}**; batch "
                              f"{d['args']['batch']} x ({d['args']['prompt']} + "
                              f"{d['args']['new_tokens']}), micro-batches of {d['args']['micro']}, "
                              f"response mean / max {d['figures']['response_mean_over_max']:.2f}; "
                              f"the LM head over real tokens only against over the padded "
                              f"responses: x{d['head_ratio']:.2f}")


def main():
    args = options(__doc__, batch=16, micro=8, prompt=32, new_tokens=256, mean_over_max=0.5,
                   rounds=3, tiny=False, json=None)
    fns, figures = build(args)
    times = interleaved(fns, args.rounds, warmup_calls=1)
    med = {k: stats([t for b in v for t in b]) for k, v in times.items()}
    tps = {k: figures["useful_tokens"] / med[k]["median"] for k in med}
    log(f"packed rows: {figures['packing/update_rows']:.0f} a micro-batch of {args.micro}")
    finish({"args": vars(args), "figures": figures, "times": med, "useful_tokens_per_s": tps,
            "ratio": tps["packed"] / tps["padded"],
            "head_ratio": tps["packed"] / tps["packed_padded_head"]}, render, args.json)


if __name__ == "__main__":
    main()
