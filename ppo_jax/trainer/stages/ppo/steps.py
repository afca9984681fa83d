"""The jitted programs of a PPO step as module-level pure functions of explicit arguments, and
`Jitted`, the step's programs once bound (`build.build_programs` binds each with
`functools.partial` over its static settings and `jax.jit` with its shardings).

  split_keys           key -> (next step's key, sampling key, update key)
  reward_model_scores  the reward model's scores of a rollout (ReMax's greedy baseline)
  experience_step      log-probs, values, KL-shaped rewards, advantages (`make_experience`)
  update_step          every PPO epoch and minibatch on one experience (`ppo_update`)

A test or a fork imports and calls them as they are (eagerly, or under its own `jax.jit`):
only arrays and pytrees of arrays are positional, graphs, optimisers and settings are keywords.
The sampler is `stages.ppo.samplers.make_sampler`; dynamic sampling's two programs are
`core.informative_groups` and `stages.ppo.dynamic.select_rollout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import optax

from ppo_jax.models.functional import Model
from ppo_jax.rollout.experience import Experience, ExperienceSettings, PPOModels, make_experience
from ppo_jax.rollout.sampler import ended_rows
from ppo_jax.rollout.forward import Rollout, ForwardSettings, rollout_scores
from ppo_jax.trainer.stages.ppo.update import UpdateSettings, ppo_update


class ExperienceOut(NamedTuple):
    """What `experience_step` returns: the experience (`[B, ...]` rows), the updated KL
    controller, the experience's stats (scalars) and the batch's real prompt and response
    token counts (`{"prompt", "response"}`, int32 scalars)."""

    experience: Experience
    kl_state: Any
    stats: dict
    tokens: dict


def split_keys(key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A step's PRNG key -> `(next step's key, sampling key, update key)`."""
    return tuple(jax.random.split(key, 3))


def reward_model_scores(reward: Model, rollout: Rollout, *, forward: ForwardSettings) -> jax.Array:
    """The reward model's `[B]` float32 scores of `rollout` (`rollout.forward.rollout_scores`;
    prompts `[B, P]`, responses `[B, N]`), normalised as `forward` says."""
    return rollout_scores(reward, rollout, forward)


def experience_step(models: PPOModels, kl_state, rollout: Rollout, scores, group_ids,
                    baseline_scores, rollout_logprobs, action_mask=None, ended=None, *,
                    settings: ExperienceSettings, stop_token_ids: Sequence[int]) -> ExperienceOut:
    """The experience of one rollout (`rollout.experience.make_experience`), its rows' ended
    flags read from `stop_token_ids` (`rollout.sampler.ended_rows`).

    Args:
      models: `PPOModels` (the reward model only when `scores` is None).
      kl_state: the KL controller's state; its value is this step's kl_coef.
      rollout: prompts `[B, P]`, responses `[B, N]` and their masks.
      scores: `[B]` float32 from a reward function, or None (the reward model scores).
      group_ids: `[B]` int32 prompt group of each row.
      baseline_scores: `[B]` float32 ReMax greedy scores, or None.
      rollout_logprobs: `[B, N]` float32, the sampler's log-probs of its draws, or None.
      action_mask: `[B, N]` int32, 1 on the drawn tokens of a multi-turn rollout (its
        observations 0: `core.actions`), or None (single-turn: every response token).
      ended: `[B]` bool, the episodes that ended (not cut by the budget), or None: read from
        the responses (a multi-turn response holds stop tokens in its observations).
      settings: `ExperienceSettings` (static).
      stop_token_ids: the tokens that end a response (a row holding one ended).

    Returns:
      `ExperienceOut(experience, kl_state, stats, tokens)`.

    Raises:
      ValueError: as `make_experience` (batch not a multiple of the micro-batch, an unknown
        estimator or shaping, log-probs of the wrong shape).
    """
    if ended is None:
        ended = ended_rows(rollout.response_ids, rollout.response_mask, stop_token_ids)
    exp, kl_state, stats = make_experience(
        models, rollout, kl_state, scores, ended, settings=settings, group_ids=group_ids,
        baseline_scores=baseline_scores, rollout_logprobs=rollout_logprobs,
        action_mask=action_mask)
    tokens = {"prompt": rollout.query_mask.sum(), "response": rollout.response_mask.sum()}
    return ExperienceOut(exp, kl_state, stats, tokens)


def update_step(actor_state, critic_state, frozen: dict, experience: Experience, rng, *,
                actor_graphdef, critic_graphdef, actor_tx: optax.GradientTransformation,
                critic_tx: optax.GradientTransformation, settings: UpdateSettings):
    """The whole PPO update on one experience (`stages.ppo.update.ppo_update`).

    Args:
      actor_state, critic_state: `TrainState`s (`critic_state` None without a separate critic).
      frozen: `{"actor": ..., "critic": ...}`, a LoRA model's frozen base ({} without).
      experience: `Experience` of `[B, ...]` rows, B a multiple of the minibatch.
      rng: PRNG key of the epochs' permutations.
      actor_graphdef, critic_graphdef: the models' graphs (`critic_graphdef` None without).
      actor_tx, critic_tx: the optimisers.
      settings: `UpdateSettings` (static; `train_actor=False` for a critic warm-up step).

    Returns:
      `(actor_state, critic_state, stats)`, stats `[ppo_epochs, minibatches]` arrays.

    Raises:
      ValueError: as `ppo_update` (batch sizes that do not divide).
    """
    return ppo_update(actor_state, critic_state, experience, rng, actor_graphdef=actor_graphdef,
                      critic_graphdef=critic_graphdef, actor_tx=actor_tx, critic_tx=critic_tx,
                      settings=settings, frozen=frozen)


@dataclass(frozen=True)
class Jitted:
    """The jitted programs one PPO step calls (what `--compile-for` lists, `stages.ppo.compile_for`).

    Attributes:
      split_keys: `split_keys`, replicated out.
      rollout_copy: actor params -> their rollout copy (`rollout.weights.rollout_copy_fn`), or
        None when the sampler takes the trained params as they are.
      sample: `(actor Model, prompt_ids [B, P], prompt_mask [B, P], key) -> (response_ids
        [B, N], response_mask [B, N], logprobs [B, N])` (`samplers.make_sampler`).
      sample_greedy: the same, greedy (ReMax's baseline); None when the estimator needs none.
      reward_model_scores: `reward_model_scores`, `(reward Model, Rollout) -> [B]`.
      experience: `experience_step`.
      update: `update_step`, the train states donated.
      update_critic_only: the same with the actor left out (`ppo.critic_warmup_steps`).
      informative: `scores [B] -> [B / n]` bool, `core.informative_groups` (dynamic sampling;
        else None).
      select: `dynamic.select_rollout` (dynamic sampling; else None).
    """

    split_keys: Callable
    rollout_copy: Optional[Callable]
    sample: Callable
    sample_greedy: Optional[Callable]
    reward_model_scores: Callable
    experience: Callable
    update: Callable
    update_critic_only: Callable
    informative: Optional[Callable] = None
    select: Optional[Callable] = None
