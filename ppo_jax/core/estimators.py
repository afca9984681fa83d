"""The registered advantage estimators: GAE with a critic, and the critic-free GRPO, RLOO,
REINFORCE++, REINFORCE++-baseline and ReMax. The formulas are in `gae.py` and `outcome.py`.

The trainer calls every estimator the same way:

    fn(values, rewards, mask, *, gamma, lam, scores, group_ids, baseline_scores,
       **advantage_kwargs) -> (advantages [B, T], returns [B, T])

- `values [B, T]`: the critic's values, zeros when no critic is loaded;
- `rewards [B, T]`: the shaped rewards, a KL penalty per token plus the score at the last real
  token;
- `mask [B, T]`: 0/1 response mask;
- `scores [B]`: the sequence scores after shaping (scaled, penalised);
- `group_ids [B]` int32: rows answering the same prompt share an id;
- `baseline_scores [B]`: for ReMax, the shaped score of the greedy response to the row's
  prompt; zeros otherwise.

The trainer adds `critic_lam` and `lam_length_alpha` only when `ppo.critic_lam` /
`ppo.lam_length_alpha` are set, which the config allows only for an estimator with a critic.
Three attributes tell the trainer what an estimator needs: `fn.uses_critic = False` (no critic
is loaded or trained), `fn.needs_greedy_baseline = True` and `fn.needs_groups = True` (refused
with one sample per prompt). A fork's estimator takes `**unused` for what it ignores.
"""

from __future__ import annotations

from ppo_jax.core import outcome
from ppo_jax.core.decoupled_gae import decoupled_gae
from ppo_jax.core.gae import DEFAULT_CHUNK, DEFAULT_GAE_METHOD, DEFAULT_UNROLL
from ppo_jax.core.registry import register_advantage_estimator

def _critic_free(fn):
    fn.uses_critic = False
    return fn


def _grouped(fn):
    """Mark `fn` as comparing the samples of a prompt (`needs_groups`)."""
    fn.needs_groups = True
    return fn


@register_advantage_estimator("gae")
def gae(values, rewards, mask, *, gamma, lam, scores=None, group_ids=None, baseline_scores=None,
        critic_lam=None, lam_length_alpha=0.0, method: str = DEFAULT_GAE_METHOD,
        unroll: int = DEFAULT_UNROLL, chunk: int = DEFAULT_CHUNK):
    """`compute_gae` (Schulman et al. 2016) on the critic's values; `advantage_kwargs` may set
    `method`, `unroll`, `chunk`. With `critic_lam` (the returns' own lambda) or `lam_length_alpha`
    (VAPO's per-row policy lambda) this is decoupled GAE, as in VC-PPO / VAPO; with neither, one
    `compute_gae` call. The outcome inputs are not used."""
    del scores, group_ids, baseline_scores
    return decoupled_gae(values, rewards, mask, gamma=gamma, lam=lam, critic_lam=critic_lam,
                         lam_length_alpha=lam_length_alpha, method=method, unroll=unroll,
                         chunk=chunk)


@register_advantage_estimator("grpo")
@_critic_free
@_grouped
def grpo(values, rewards, mask, *, scores, group_ids, norm_by_std: bool = True, eps: float = 1e-6,
         **unused):
    """`outcome.grpo`: `(r - mean_group) / (std_group + eps)` (unbiased std) on every token;
    `norm_by_std=false` is Dr. GRPO. The KL stays in the rewards only if the shaping puts it
    there; GRPO proper puts it in the loss (`ppo.kl_loss_coef`, `ppo.kl_coef=0`)."""
    return outcome.grpo(scores, group_ids, mask, norm_by_std=norm_by_std, eps=eps)


@register_advantage_estimator("rloo")
@_critic_free
@_grouped
def rloo(values, rewards, mask, *, scores, group_ids, **unused):
    """`outcome.rloo`: `r_i - mean_{j != i} r_j` within the group, on every token."""
    return outcome.rloo(scores, group_ids, mask)


@register_advantage_estimator("reinforce_plus_plus")
@_critic_free
def reinforce_plus_plus(values, rewards, mask, *, gamma, **unused):
    """`outcome.reinforce_plus_plus`: returns of the shaped (KL-penalised) rewards, whitened
    over the batch."""
    return outcome.reinforce_plus_plus(rewards, mask, gamma=gamma)


@register_advantage_estimator("reinforce_plus_plus_baseline")
@_critic_free
@_grouped
def reinforce_plus_plus_baseline(values, rewards, mask, *, gamma, scores, group_ids, **unused):
    """`outcome.reinforce_plus_plus_baseline`: the group mean score subtracted first."""
    return outcome.reinforce_plus_plus_baseline(rewards, scores, group_ids, mask, gamma=gamma)


@register_advantage_estimator("remax")
@_critic_free
def remax(values, rewards, mask, *, baseline_scores, **unused):
    """`outcome.remax`: returns minus the greedy response's score."""
    return outcome.remax(rewards, baseline_scores, mask)


remax.needs_greedy_baseline = True


def uses_critic(fn) -> bool:
    """Whether the trainer must load and train a critic for estimator `fn`."""
    return getattr(fn, "uses_critic", True)


def needs_groups(fn) -> bool:
    """Whether estimator `fn` compares the samples of a prompt (GRPO, Dr. GRPO, RLOO,
    REINFORCE++-baseline). With one sample per prompt its advantages are all zero, so the trainer
    refuses `generation.samples_per_prompt=1` for it."""
    return getattr(fn, "needs_groups", False)


def needs_greedy_baseline(fn) -> bool:
    """Whether the trainer must sample a greedy response per prompt for estimator `fn`."""
    return getattr(fn, "needs_greedy_baseline", False)
