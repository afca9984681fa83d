"""Reward shaping: sequence scores -> per-token rewards, as a registered step.

``make_experience`` calls the function registered under ``ppo.reward_shaping`` (registry
signature in ``ppo_jax.core.registry``); a fork registers another (e.g. no KL in the reward, as
GRPO, which puts the KL in the loss instead: ``ppo.kl_loss_coef``).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V
from ppo_jax.core.masked import masked_whiten
from ppo_jax.core.registry import register_reward_shaping
from ppo_jax.core.rewards import compute_rewards


@register_reward_shaping("kl_penalty")
def kl_penalty_shaping(scores: jax.Array, ended: jax.Array, logprobs: jax.Array,
                       ref_logprobs: jax.Array, mask: jax.Array, *, kl_coef: Any,
                       kl_estimator: str = "kl", reward_clip: Optional[float] = None,
                       score_scale: Any = 1.0, missing_eos_penalty: Optional[float] = None,
                       whiten_rewards: bool = False
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """TRL's shaping: scaled score (minus a missing-EOS penalty) on the last token, KL penalty
    on every token, optional reward whitening.

    In order: ``s = score * score_scale``; ``s -= missing_eos_penalty`` for rows that never
    emitted a stop token (the penalty is subtracted, not substituted); ``rewards, non_score =
    compute_rewards(s, lp, ref, mask, kl_coef, kl_estimator, reward_clip)``; with
    ``whiten_rewards``, ``rewards = masked_whiten(rewards, mask, shift_mean=False)``.
    Sources: TRL 0.11 ``PPOTrainer.step`` / ``compute_rewards`` (``score_clip``,
    ``whiten_rewards``); Ziegler et al. 2019, eq. 2; the missing-EOS penalty as TRL >= 0.12
    ``PPOTrainer`` (``missing_eos_penalty``).

    Args:
      scores: ``[B]`` float, raw sequence scores (reward function or reward model).
      ended: ``[B]`` bool, whether the response emitted a stop token.
      logprobs, ref_logprobs: ``[B, T]`` float, rollout and reference log-probs.
      mask: ``[B, T]`` 0/1 response mask.
      kl_coef: scalar, the KL controller's current value (traced).
      kl_estimator, reward_clip: as ``compute_rewards``.
      score_scale: multiplies the score (may be negative: a cost).
      missing_eos_penalty: optional amount subtracted from the score of unended rows.
      whiten_rewards: whiten the rewards over valid tokens, keeping their mean.

    Returns:
      ``(rewards [B, T], non_score_rewards [B, T], scores [B])``, float32; ``scores`` after
      scaling and penalty (what ``Experience.scores`` stores).

    Raises:
      ValueError: as ``compute_rewards``; ``ended`` not of shape ``[B]``.
    """
    scores = V.as_float("scores", scores, ndim=1)
    ended = V.as_valid("ended", ended, scores.shape)
    scores = scores * score_scale
    if missing_eos_penalty is not None:
        scores = jnp.where(ended, scores, scores - missing_eos_penalty)
    rewards, non_score = compute_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=kl_coef,
                                         estimator=kl_estimator, reward_clip=reward_clip)
    if whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    return rewards, non_score, scores
