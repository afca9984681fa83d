"""Experience making: the scoring passes of the four models and the PPO math on one rollout.

`make_experience` is one pure function (jit it with the settings static): actor log-probs
(old), reference log-probs, critic values and (optionally) reward-model scores, each computed in
micro-batch chunks; reward-model scores optionally normalised by the mean / std measured when the
reward model was trained; then the registered reward shaping (`ppo.reward_shaping`, default
"kl_penalty": score scale, missing-EOS penalty, `compute_rewards`, optional reward whitening),
the registered advantage estimator and advantage whitening. The order and formulas follow TRL
0.11 `PPOTrainer.step` (`batched_forward_pass`, `compute_rewards`, `compute_advantages`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from ppo_jax.core import (
    get_advantage_estimator,
    get_reward_shaping,
    masked_mean,
    masked_whiten,
    update_kl_controller,
)
from ppo_jax.rollout.scoring import map_in_chunks as _map_in_chunks
from ppo_jax.rollout.scoring import (
    critic_values,
    policy_logprobs,
    policy_logprobs_and_values,
    reward_model_scores,
)


@dataclass(frozen=True)
class ExperienceSettings:
    """Static settings of experience making (hashable, so it can be a static jit argument)."""

    temperature: float = 1.0
    micro_batch_size: int = 4
    kl_estimator: str = "kl"
    reward_clip: Optional[float] = None
    score_scale: float = 1.0
    missing_eos_penalty: Optional[float] = None
    whiten_rewards: bool = False
    whiten_advantages: bool = True
    advantage_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    advantage_kwargs: tuple = ()  # extra (name, value) keyword arguments of the estimator
    shared_critic: bool = False  # actor params hold {"policy", "value_head"}; no critic model
    mesh: Optional[Mesh] = None  # split the rows of every micro-batch chunk over ("data", "fsdp")
    # (mean, std): reward-model scores become (score - mean) / std (reward.normalize)
    score_normalizer: Optional[tuple[float, float]] = None
    # EOS id written over the last response token before the reward model reads it
    # (reward.eos_at_end; `scoring.end_with_eos`), None: the response as sampled
    reward_eos_id: Optional[int] = None
    reward_shaping: str = "kl_penalty"  # a registered reward shaping (core.registry)
    reward_shaping_kwargs: tuple = ()  # extra (name, value) keyword arguments of the shaping
    # vocabulary columns per block of the log-prob / entropy head (scoring.head_logprobs);
    # 0: the full [B, N, V] logits
    logprob_chunk_size: int = 0

    def shaping_fixed_kwargs(self, kl_coef) -> dict:
        """The trainer's own keyword arguments of a reward-shaping call."""
        return {"kl_coef": kl_coef, "kl_estimator": self.kl_estimator,
                "reward_clip": self.reward_clip, "score_scale": self.score_scale,
                "missing_eos_penalty": self.missing_eos_penalty,
                "whiten_rewards": self.whiten_rewards}

    def shaping_kwargs(self, kl_coef) -> dict:
        """Keyword arguments of every reward-shaping call `fn(scores, ended, logprobs,
        ref_logprobs, mask, **kwargs)`."""
        return {**self.shaping_fixed_kwargs(kl_coef), **dict(self.reward_shaping_kwargs)}


@struct.dataclass
class Experience:
    """One batch of experience; every field `[B, ...]`, `N` = response length, `P` = prompt."""

    query_ids: jax.Array  # [B, P] int32
    query_mask: jax.Array  # [B, P] int32
    response_ids: jax.Array  # [B, N] int32
    response_mask: jax.Array  # [B, N] int32
    logprobs: jax.Array  # [B, N] float32, actor at rollout time
    ref_logprobs: jax.Array  # [B, N] float32
    values: jax.Array  # [B, N] float32, critic at rollout time
    scores: jax.Array  # [B] float32, after scaling / penalty
    rewards: jax.Array  # [B, N] float32
    advantages: jax.Array  # [B, N] float32 (whitened when configured)
    returns: jax.Array  # [B, N] float32
    group_ids: jax.Array  # [B] int32, rows answering the same prompt share an id


def _row_stats(name: str, x: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    mean = masked_mean(x, mask)
    var = masked_mean(jnp.square(x - mean), mask)
    return {f"{name}_mean": mean, f"{name}_std": jnp.sqrt(var)}


def scoring_passes(actor, reference, critic, reward, rollout, scores, *,
                   settings: ExperienceSettings):
    """The forward passes of experience making, each in micro-batch chunks.

    Args:
      actor, reference, critic, reward: `(graphdef, params)` pairs; critic / reward may be
        `(None, None)` (no critic: zero values; scores given).
      rollout: `(query_ids, query_mask, response_ids, response_mask)`.
      scores: `[B]` from a reward function, or None to read the reward model (normalised by
        `settings.score_normalizer` when set, OpenRLHF's `normalize_reward`).

    Returns:
      `(logprobs, entropy, values, ref_logprobs [B, N], scores [B])`, float32.
    """
    s = settings
    head = {"logprob_chunk_size": s.logprob_chunk_size, "mesh": s.mesh}  # scoring.head_logprobs

    def run(fn, *arrays):
        return _map_in_chunks(fn, s.micro_batch_size, *arrays, mesh=s.mesh)

    if s.shared_critic:
        logprobs, entropy, values = run(lambda *r: policy_logprobs_and_values(
            *actor, *r, temperature=s.temperature, **head), *rollout)
    else:
        logprobs, entropy = run(lambda *r: policy_logprobs(
            *actor, *r, temperature=s.temperature, with_entropy=True, **head), *rollout)
        values = (jnp.zeros(rollout[3].shape, jnp.float32) if critic[0] is None else
                  run(lambda *r: critic_values(*critic, *r), *rollout))
    ref_logprobs = run(lambda *r: policy_logprobs(*reference, *r, temperature=s.temperature,
                                                  **head), *rollout)
    if scores is None:
        scores = run(lambda *r: reward_model_scores(*reward, *r, eos_id=s.reward_eos_id), *rollout)
        if s.score_normalizer is not None:
            mean, std = s.score_normalizer
            scores = (scores - mean) / std
    return logprobs, entropy, values, ref_logprobs, scores


def make_experience(actor_graphdef, actor_params, ref_graphdef, ref_params, critic_graphdef,
                    critic_params, reward_graphdef, reward_params, kl_state, query_ids,
                    query_mask, response_ids, response_mask, scores, ended, *,
                    settings: ExperienceSettings, group_ids=None, baseline_scores=None
                    ) -> tuple[Experience, Any, dict[str, jax.Array]]:
    """Score a rollout and compute rewards, advantages and returns.

    Args:
      *_graphdef, *_params: split models; `reward_graphdef` / `reward_params` may be None when
        `scores` come from a reward function; with `settings.shared_critic`, `actor_params` is
        `{"policy", "value_head"}` and the critic arguments are None.
      kl_state: `KLControllerState`; its `value` is the kl_coef of this step.
      query_ids, query_mask: `[B, P]` int32 left-padded prompts.
      response_ids, response_mask: `[B, N]` int32 (mask 1 up to and including the stop token).
      scores: `[B]` float32 from a reward function, or None to use the reward model.
      ended: `[B]` bool, whether the response emitted a stop token.
      settings: `ExperienceSettings` (static).
      group_ids: `[B]` int32 prompt group of each row (`generation.samples_per_prompt`);
        None: every row its own group.
      baseline_scores: `[B]` float32 raw scores of the greedy response to each row's prompt
        (ReMax), scaled like `scores`; None: zeros. A critic-free estimator gets zero values
        (`critic_graphdef` None, no shared critic).

    Returns:
      `(experience, new_kl_state, stats)`. The KL controller is updated with this batch's KL
      (mean over sequences of the summed per-token k1), as TRL does after each step.

    Raises:
      ValueError: the batch is not a multiple of micro_batch_size; an unknown estimator or
        reward shaping.
    """
    s = settings
    rollout = (query_ids, query_mask, response_ids, response_mask)
    mask = response_mask.astype(jnp.int32)
    logprobs, entropy, values, ref_logprobs, scores = scoring_passes(
        (actor_graphdef, actor_params), (ref_graphdef, ref_params), (critic_graphdef, critic_params),
        (reward_graphdef, reward_params), rollout, scores, settings=s)
    raw_scores = scores.astype(jnp.float32)
    shaping = get_reward_shaping(s.reward_shaping)
    rewards, non_score, scores = shaping(raw_scores, ended, logprobs, ref_logprobs, mask,
                                         **s.shaping_kwargs(kl_state.value))
    batch = query_ids.shape[0]
    group_ids = jnp.arange(batch, dtype=jnp.int32) if group_ids is None else group_ids
    baseline = (jnp.zeros((batch,), jnp.float32) if baseline_scores is None
                else baseline_scores.astype(jnp.float32) * s.score_scale)
    estimator = get_advantage_estimator(s.advantage_estimator)
    advantages, returns = estimator(values, rewards, mask, gamma=s.gamma, lam=s.lam,
                                    scores=scores, group_ids=group_ids, baseline_scores=baseline,
                                    **dict(s.advantage_kwargs))
    if s.whiten_advantages:
        advantages = jnp.where(mask > 0, masked_whiten(advantages, mask), 0.0)

    valid = mask > 0
    kl_per_seq = jnp.sum(jnp.where(valid, logprobs - ref_logprobs, 0.0), axis=1)
    mean_kl = jnp.mean(kl_per_seq)
    new_kl_state = update_kl_controller(kl_state, mean_kl, query_ids.shape[0])
    lengths = jnp.sum(mask, axis=1).astype(jnp.float32)
    stats = {
        "score_mean": jnp.mean(raw_scores),
        "score_std": jnp.std(raw_scores),
        "non_score_reward": jnp.mean(jnp.sum(non_score, axis=1)),
        "kl": mean_kl,
        "kl_coef": kl_state.value,
        "entropy": jnp.mean(jnp.sum(jnp.where(valid, entropy, 0.0), axis=1)),
        "entropy_per_token": masked_mean(entropy, mask),
        "response_length": jnp.mean(lengths),
        "ended_fraction": jnp.mean(ended.astype(jnp.float32)),
        **_row_stats("advantages", advantages, mask),
        **_row_stats("returns", returns, mask),
        **_row_stats("values", values, mask),
    }
    exp = Experience(query_ids, query_mask, response_ids, mask, logprobs, ref_logprobs, values,
                     scores, rewards, advantages, returns, group_ids)
    return exp, new_kl_state, stats
