"""A research fork's policy loss, registered by name (README "Swapping a formula").

    python train.py --import examples.my_losses --set ppo.policy_loss=plain_pg

`plain_pg` is the unclipped importance-weighted policy gradient, token mean of
`-A * exp(logprobs - old_logprobs)` (the surrogate of Schulman et al. 2017, eq. 6, without the
clip of eq. 7). Like every registered loss it takes `[B, T]` float arrays and a 0/1 mask,
returns `(loss, stats)` with token sums divided by `loss_normalizer` (the minibatch's token
count, so micro-batch sums add up to exact token means), and accepts the trainer's other
keyword arguments (cliprange, ...). Its own hyperparameter `pg_coef` (default 1) comes from the
config: `--set ppo.policy_loss_kwargs.pg_coef=0.5`. Reporting `ratio` and `approxkl` lets the
trainer log the first-minibatch invariant (ratio 1, approxkl 0).
"""

import jax.numpy as jnp

from ppo_jax.core import masked_sum, register_policy_loss


@register_policy_loss("plain_pg")
def plain_pg(logprobs, old_logprobs, advantages, mask, *, loss_normalizer=None, pg_coef=1.0,
             **unused):
    n = jnp.maximum(mask.sum(), 1) if loss_normalizer is None else loss_normalizer
    log_ratio = jnp.where(mask > 0, logprobs - old_logprobs, 0.0)
    ratio = jnp.exp(log_ratio)
    loss = pg_coef * masked_sum(-advantages * ratio, mask) / n
    stats = {"pg_loss": loss, "ratio": masked_sum(ratio, mask) / n,
             "approxkl": masked_sum(0.5 * log_ratio ** 2, mask) / n}
    return loss, stats
