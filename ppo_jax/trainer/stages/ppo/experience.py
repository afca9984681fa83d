"""The experience pass of a PPO step: the forward passes of the four models on one rollout, then
the PPO math on their outputs (reward shaping, the advantage estimator, the KL controller).

The order and formulas follow TRL 0.11 `PPOTrainer.step` (`batched_forward_pass`,
`compute_rewards`, `compute_advantages`). With `ppo.overlong_buffer` > 0, DAPO's soft overlong
punishment (DAPO eq. 13) is added to the score before the shaping; `score_mean` stays the raw
score. The sampler's own log-probs, when given, are kept beside the recomputed ones and their gap
is logged (`mismatch/*`), so the update can correct for it (`ppo.rollout_correction`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from ppo_jax.core import (
    action_order,
    compact_actions,
    ended_rows,
    expand_actions,
    explained_variance,
    group_baseline_explained_variance,
    get_advantage_estimator,
    get_reward_shaping,
    masked_mean,
    overlong_penalty,
    masked_whiten,
    rollout_mismatch,
    sequence_kl,
    update_kl_controller,
    uses_critic,
)
from ppo_jax.models.functional import Model
from ppo_jax.rollout.forward import (
    Rollout,
    ForwardSettings,
    rollout_logprobs,
    rollout_logprobs_and_values,
    rollout_scores,
    rollout_values,
)


@struct.dataclass
class PPOModels:
    """The models of experience making (and of the evaluation), each a `Model` (graphdef +
    params): a pytree, so one argument of a jitted call, with its shardings made by tree-map.

    `critic` is None without a separate critic (a shared critic's value head sits on the
    actor, `ExperienceSettings.shared_critic`; a critic-free estimator has none); `reward` is
    None when the scores come from a reward function.
    """

    actor: Model
    reference: Model
    critic: Optional[Model] = None
    reward: Optional[Model] = None


@dataclass(frozen=True)
class ExperienceSettings:
    """Static settings of the experience pass (hashable: a static jit argument), built from the
    config by `stages.ppo.settings.experience_settings`; the fields are the `ppo.*` keys of the
    same name, plus `forward` (the forward passes), `shared_critic` (`model.shared_critic`),
    `max_response_length` (`generation.max_new_tokens`: L_max of the overlong punishment; None:
    the rollout's width) and `samples_per_prompt` (above 1, a critic's stats add the group
    baseline's explained variance). `*_kwargs` are `(name, value)` tuples."""

    forward: ForwardSettings
    kl_estimator: str
    reward_clip: Optional[float]
    score_scale: float
    missing_eos_penalty: Optional[float]
    whiten_rewards: bool
    whiten_advantages: bool
    advantage_estimator: str
    gamma: float
    lam: float
    critic_lam: Optional[float]
    lam_length_alpha: float
    advantage_kwargs: tuple
    shared_critic: bool
    reward_shaping: str
    reward_shaping_kwargs: tuple
    overlong_buffer: int
    overlong_penalty_factor: float
    max_response_length: Optional[int]
    samples_per_prompt: int

    def shaping_fixed_kwargs(self, kl_coef) -> dict:
        """The trainer's own keyword arguments of a reward-shaping call."""
        return {"kl_coef": kl_coef, "kl_estimator": self.kl_estimator,
                "reward_clip": self.reward_clip, "score_scale": self.score_scale,
                "missing_eos_penalty": self.missing_eos_penalty,
                "whiten_rewards": self.whiten_rewards}

    def estimator_fixed_kwargs(self) -> dict:
        """The trainer's own keyword arguments of an advantage-estimator call: `gamma`, `lam`,
        and `critic_lam` / `lam_length_alpha` only when set (a fork's estimator need not take
        them; the config refuses them with a critic-free estimator)."""
        out = {"gamma": self.gamma, "lam": self.lam}
        if self.critic_lam is not None:
            out["critic_lam"] = self.critic_lam
        if self.lam_length_alpha:
            out["lam_length_alpha"] = self.lam_length_alpha
        return out

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
    response_mask: jax.Array  # [B, N] int32, 1 on every response token (attention)
    logprobs: jax.Array  # [B, N] float32, actor at rollout time
    ref_logprobs: jax.Array  # [B, N] float32
    values: jax.Array  # [B, N] float32, critic at rollout time
    scores: jax.Array  # [B] float32, after scaling / penalty
    rewards: jax.Array  # [B, N] float32
    advantages: jax.Array  # [B, N] float32 (whitened when configured)
    returns: jax.Array  # [B, N] float32
    group_ids: jax.Array  # [B] int32, rows answering the same prompt share an id
    # [B, N] float32, the log-probs the sampler drew the tokens with (the rollout engine's);
    # equal to `logprobs` when the sampler gives none (then no rollout correction applies)
    rollout_logprobs: jax.Array
    # [B, N] int32, 1 on the tokens the actor sampled: the losses' mask. A multi-turn response's
    # observation tokens are 0 here, 1 in response_mask (core.actions); single-turn: equal
    action_mask: jax.Array
    # [B, N, moe_layers, k] int, the experts each response token went through when sampled,
    # replayed by the update's actor passes (`model.router_replay: rollout`); None: no replay
    routes: Optional[jax.Array] = None


def _row_stats(name: str, x: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    mean = masked_mean(x, mask)
    var = masked_mean(jnp.square(x - mean), mask)
    return {f"{name}_mean": mean, f"{name}_std": jnp.sqrt(var)}


def forward_passes(models: PPOModels, rollout: Rollout, scores, *,
                   settings: ExperienceSettings, packing=None):
    """The forward passes of experience making, each in micro-batch chunks.

    Args:
      models: `PPOModels`; without a critic (and no shared critic) the values are zeros.
      rollout: the prompts and responses; its `routes`, when recorded, route the actor's MoE
        layers (never the reference's: they are the actor's choices).
      scores: `[B]` from a reward function, or None to read `models.reward`
        (`forward.rollout_scores`, normalised when `settings.forward.score_normalizer` is set).
      packing: None, or the chunks' `rollout.packing.PackedRows` (leaves `[n_chunks, ...]`):
        the actor, reference and critic passes run over packed rows; the reward model reads
        padded rows.

    Returns:
      `(logprobs, entropy, values, ref_logprobs [B, N], scores [B])`, float32.
    """
    s = settings.forward
    if settings.shared_critic:
        logprobs, entropy, values = rollout_logprobs_and_values(models.actor, rollout, s, packing)
    else:
        logprobs, entropy = rollout_logprobs(models.actor, rollout, s, with_entropy=True,
                                             packing=packing)
        values = (jnp.zeros(rollout.response_mask.shape, jnp.float32) if models.critic is None
                  else rollout_values(models.critic, rollout, s, packing))
    ref_logprobs = rollout_logprobs(models.reference, rollout, s, replay=False, packing=packing)
    if scores is None:
        scores = rollout_scores(models.reward, rollout, s)
    return logprobs, entropy, values, ref_logprobs, scores


def _advantages(values, rewards, mask, scores, group_ids, baseline_scores, s: ExperienceSettings):
    """The registered estimator's `(advantages, returns)`, advantages whitened when set."""
    batch = mask.shape[0]
    group_ids = jnp.arange(batch, dtype=jnp.int32) if group_ids is None else group_ids
    baseline = (jnp.zeros((batch,), jnp.float32) if baseline_scores is None
                else baseline_scores.astype(jnp.float32) * s.score_scale)
    estimator = get_advantage_estimator(s.advantage_estimator)
    advantages, returns = estimator(values, rewards, mask, **s.estimator_fixed_kwargs(),
                                    scores=scores, group_ids=group_ids, baseline_scores=baseline,
                                    **dict(s.advantage_kwargs))
    if s.whiten_advantages:
        advantages = jnp.where(mask > 0, masked_whiten(advantages, mask), 0.0)
    return advantages, returns, group_ids


def _shaped_returns(raw_scores, ended, logprobs, ref_logprobs, values, actions, kl_coef,
                    group_ids, baseline_scores, s: ExperienceSettings, *, compact: bool):
    """`(rewards, non_score, scores, advantages, returns, group_ids)` of the registered reward
    shaping and advantage estimator over the action tokens `actions` `[B, N]`. With `compact`
    (a multi-turn rollout) both run on each row's action tokens moved to the front
    (`core.compact_actions`: gamma and lambda step over actions only) and the per-token results
    go back in place, 0 on observations."""
    order = action_order(actions) if compact else None
    pack = (lambda x: compact_actions(x, order)) if compact else (lambda x: x)
    unpack = (lambda x: expand_actions(x, order)) if compact else (lambda x: x)
    mask = pack(actions)
    shaping = get_reward_shaping(s.reward_shaping)
    rewards, non_score, scores = shaping(raw_scores, ended, pack(logprobs), pack(ref_logprobs),
                                         mask, **s.shaping_kwargs(kl_coef))
    advantages, returns, group_ids = _advantages(pack(values), rewards, mask, scores, group_ids,
                                                 baseline_scores, s)
    return (unpack(rewards), unpack(non_score), scores, unpack(advantages), unpack(returns),
            group_ids)


def _critic_stats(values, returns, mask, group_ids, s: ExperienceSettings) -> dict[str, jax.Array]:
    """`values_explained_variance` (and, with groups, its leave-one-out group reference) for an
    estimator with a critic; nothing for a critic-free one."""
    if not uses_critic(get_advantage_estimator(s.advantage_estimator)):
        return {}
    stats = {"values_explained_variance": explained_variance(values, returns, mask)}
    if group_ids is not None:
        stats["group_baseline_explained_variance"] = group_baseline_explained_variance(
            returns, group_ids, mask)
    return stats


def make_experience(models: PPOModels, rollout: Rollout, kl_state, scores, ended, *,
                    settings: ExperienceSettings, group_ids=None, baseline_scores=None,
                    rollout_logprobs=None, action_mask=None,
                    packing=None) -> tuple[Experience, Any, dict[str, jax.Array]]:
    """Score a rollout and compute rewards, advantages and returns.

    Args:
      models: `PPOModels` (with `settings.shared_critic`, the actor's params are
        a `CausalLMWithValueHead`'s and `critic` is None; `reward` None when `scores` are given).
      rollout: `Rollout`: `[B, P]` left-padded prompts, `[B, N]` responses and their mask.
      kl_state: `KLControllerState`; its `value` is the kl_coef of this step.
      scores: `[B]` float32 from a reward function, or None to use the reward model.
      ended: `[B]` bool, whether the response emitted a stop token (`core.ended_rows`).
      settings: `ExperienceSettings` (static).
      group_ids: `[B]` int32 prompt group of each row (`generation.samples_per_prompt`);
        None: every row its own group.
      baseline_scores: `[B]` float32 raw scores of the greedy response to each row's prompt
        (ReMax), scaled like `scores`; None: zeros. A critic-free estimator gets zero values.
      rollout_logprobs: `[B, N]` float, the log-probs the sampler drew the responses with
        (full distribution, sampling temperature); stored in the experience, and the stats gain
        `core.rollout_mismatch(logprobs, rollout_logprobs, mask)` (`mismatch/*`). None: the
        experience's `rollout_logprobs` are its `logprobs` (no mismatch, no `mismatch/*` stats).
      action_mask: `[B, N]` 0/1, 1 on the tokens the actor sampled, 0 on a multi-turn
        response's observation tokens (`core.actions`): rewards, KL, entropy, advantages and
        every stat are over these tokens, gamma and lambda step over them only (verl), and the
        update's losses take them as their mask. None: every response token (single-turn,
        exactly as without the argument). `response_length` stays the whole response;
        `action_length` is added.
      packing: None, or the micro-batch chunks' `rollout.packing.PackedRows`
        (`forward_passes`): the same experience, computed over packed rows.

    Returns:
      `(experience, new_kl_state, stats)`. The KL controller is updated with this batch's KL
      (mean over sequences of the summed per-token k1), as TRL does after each step. With an
      estimator that uses a critic, stats hold `values_explained_variance`
      (`core.explained_variance` of the values against the returns, the critic's targets) and,
      with `settings.samples_per_prompt` > 1, `group_baseline_explained_variance` (its
      reference: the leave-one-out mean return of the prompt's other samples,
      `core.group_baseline_explained_variance`).

    Raises:
      ValueError: the batch is not a multiple of micro_batch_size; an unknown estimator or
        reward shaping; `rollout_logprobs` not a float array of the responses' shape.
    """
    s = settings
    length = rollout.response_mask.astype(jnp.int32)
    mask = length if action_mask is None else action_mask.astype(jnp.int32) * length
    logprobs, entropy, values, ref_logprobs, scores = forward_passes(
        models, rollout, scores, settings=s, packing=packing)
    raw_scores = scores.astype(jnp.float32)
    overlong = overlong_penalty(length.sum(axis=1),
                                max_length=s.max_response_length or mask.shape[1],
                                buffer=s.overlong_buffer,
                                penalty_factor=s.overlong_penalty_factor)
    rewards, non_score, scores, advantages, returns, group_ids = _shaped_returns(
        raw_scores + overlong, ended, logprobs, ref_logprobs, values, mask, kl_state.value,
        group_ids, baseline_scores, s, compact=action_mask is not None)
    mean_kl = jnp.mean(sequence_kl(logprobs, ref_logprobs, mask))
    new_kl_state = update_kl_controller(kl_state, mean_kl, mask.shape[0])
    valid = mask > 0
    stats = {
        "score_mean": jnp.mean(raw_scores),
        "score_std": jnp.std(raw_scores),
        "non_score_reward": jnp.mean(jnp.sum(non_score, axis=1)),
        "kl": mean_kl,
        "kl_coef": kl_state.value,
        "entropy": jnp.mean(jnp.sum(jnp.where(valid, entropy, 0.0), axis=1)),
        "entropy_per_token": masked_mean(entropy, mask),
        "response_length": jnp.mean(jnp.sum(length, axis=1).astype(jnp.float32)),
        **({"action_length": jnp.mean(jnp.sum(mask, axis=1).astype(jnp.float32))}
           if action_mask is not None else {}),
        "ended_fraction": jnp.mean(ended.astype(jnp.float32)),
        **({"overlong_penalty": jnp.mean(overlong)} if s.overlong_buffer else {}),
        **_row_stats("advantages", advantages, mask),
        **_row_stats("returns", returns, mask),
        **_row_stats("values", values, mask),
        **_critic_stats(values, returns, mask, group_ids if s.samples_per_prompt > 1 else None, s),
    }
    if rollout_logprobs is None:
        rollout_logprobs = logprobs
    else:
        stats.update(rollout_mismatch(logprobs, rollout_logprobs, mask))
        rollout_logprobs = rollout_logprobs.astype(jnp.float32)
    exp = Experience(
        query_ids=rollout.query_ids, query_mask=rollout.query_mask,
        response_ids=rollout.response_ids, response_mask=length, logprobs=logprobs,
        ref_logprobs=ref_logprobs, values=values, scores=scores, rewards=rewards,
        advantages=advantages, returns=returns, group_ids=group_ids,
        rollout_logprobs=rollout_logprobs, action_mask=mask, routes=rollout.routes)
    return exp, new_kl_state, stats


@struct.dataclass
class RolloutBatch:
    """What the experience pass takes from sampling and scoring, as one value (a pytree).

    rollout: the prompts `[B, P]` and responses `[B, N]`.
    group_ids: `[B]` int32, the prompt group of each row.
    scores: `[B]` float32 from a reward function, or None: the reward model scores.
    baseline_scores: `[B]` float32, ReMax's greedy-response scores, or None.
    rollout_logprobs: `[B, N]` float32, the sampler's log-probs of its draws, or None.
    action_mask: `[B, N]` int32, 1 on a multi-turn rollout's drawn tokens (0 on observations),
      or None: single-turn, every response token is an action.
    ended: `[B]` bool, the multi-turn episodes that ended, or None: read from the stop tokens
      (a multi-turn response holds stop tokens inside its observations).
    packing: the micro-batch chunks' `rollout.packing.PackedRows` (`ppo.packing`), or None.
    """

    rollout: Rollout
    group_ids: jax.Array
    scores: Optional[jax.Array] = None
    baseline_scores: Optional[jax.Array] = None
    rollout_logprobs: Optional[jax.Array] = None
    action_mask: Optional[jax.Array] = None
    ended: Optional[jax.Array] = None
    packing: Any = None


class ExperienceOut(NamedTuple):
    """What `experience_step` returns: the experience, the updated KL controller, the stats
    (scalars) and the batch's real prompt and response token counts (`{"prompt", "response"}`,
    int32 scalars)."""

    experience: Experience
    kl_state: Any
    stats: dict
    tokens: dict


def experience_step(models: PPOModels, kl_state, batch: RolloutBatch, *,
                    settings: ExperienceSettings, stop_token_ids: Sequence[int]) -> ExperienceOut:
    """`make_experience` on one `RolloutBatch`, the step's jitted program (`settings` and
    `stop_token_ids`, the tokens that end a response, are static). Raises as `make_experience`."""
    r = batch.rollout
    ended = batch.ended
    if ended is None:
        ended = ended_rows(r.response_ids, r.response_mask, stop_token_ids)
    exp, kl_state, stats = make_experience(
        models, r, kl_state, batch.scores, ended, settings=settings, group_ids=batch.group_ids,
        baseline_scores=batch.baseline_scores, rollout_logprobs=batch.rollout_logprobs,
        action_mask=batch.action_mask, packing=batch.packing)
    tokens = {"prompt": r.query_mask.sum(), "response": r.response_mask.sum()}
    return ExperienceOut(exp, kl_state, stats, tokens)
