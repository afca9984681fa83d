"""A research fork's policy losses, registered by name (docs/forks.md "Swapping a formula").

    python train.py --import examples.my_losses --set ppo.policy_loss=plain_pg
    python train.py --import examples.my_losses --set ppo.policy_loss=ppo_clip_entropy \
        --set ppo.policy_loss_kwargs.ent_coef=0.01

A registered policy loss takes one `LossInputs` batch (`batch.logprobs`, `.old_logprobs`,
`.ref_logprobs`, `.entropy`, `.advantages`, `.mask`, `.group_ids`, ...; `[B, T]` arrays with
masked slots already 0) and the trainer's keywords (cliprange, ...), and returns a PER-TOKEN
loss `[B, T]` plus per-token stats. The trainer reduces once (`ppo.loss_aggregation`), exactly
under gradient accumulation, and logs each stat's token mean; no normaliser here. Reporting
`ratio` and `approxkl` lets the trainer log the first-minibatch invariant (ratio 1, approxkl 0).

- `plain_pg`: the unclipped importance-weighted policy gradient `-A * exp(lp - old)` (the
  surrogate of Schulman et al. 2017, eq. 6, without the clip of eq. 7); its own
  hyperparameter `pg_coef` (default 1): `--set ppo.policy_loss_kwargs.pg_coef=0.5`.
- `ppo_clip_entropy`: the built-in clipped loss plus an entropy bonus `-ent_coef * H` per token
  (PPO paper eq. 9's `c_2 S` term): a new term in a few lines, reusing `ppo_clip_loss`.
"""

import jax.numpy as jnp

from ppo_jax.core import ppo_clip_loss, register_policy_loss


@register_policy_loss("plain_pg")
def plain_pg(batch, *, pg_coef=1.0, **unused):
    log_ratio = batch.logprobs - batch.old_logprobs
    ratio = jnp.exp(log_ratio)
    return -pg_coef * batch.advantages * ratio, {"ratio": ratio, "approxkl": 0.5 * log_ratio ** 2}


@register_policy_loss("ppo_clip_entropy")
def ppo_clip_entropy(batch, *, ent_coef=0.01, **clip_kwargs):
    per_token, stats = ppo_clip_loss(batch, **clip_kwargs)  # cliprange, cliprange_high, dual_clip
    bonus = -ent_coef * batch.entropy
    return per_token + bonus, {**stats, "entropy_bonus": bonus}
