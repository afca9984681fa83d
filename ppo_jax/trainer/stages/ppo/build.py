"""What a PPO run builds once, before its first step, as functions of explicit values
(`PPOTrainer._build` calls them in order): the optimisers, train states and frozen params
(`build_params`: the train states take over the loaded param buffers), the models of a jitted
call joined from trained and frozen params (`join_models`) and the held-out evaluation with its
prompts (`build_evaluator`). The step's jitted programs are `step_programs`'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Optional

import jax
import optax

from ppo_jax.core import init_kl_controller
from ppo_jax.models.functional import Model
from ppo_jax.rollout.sampler import Sampler
from ppo_jax.trainer.stages.ppo.experience import PPOModels
from ppo_jax.trainer.config import Config
from ppo_jax.trainer.data.prompts import plain_instruction_config
from ppo_jax.trainer.loading.models import prompt_set
from ppo_jax.trainer.optim import actor_optimizer, optimizer_from_config
from ppo_jax.trainer.state import full_params
from ppo_jax.trainer.stages.ppo import rewards
from ppo_jax.trainer.stages.ppo.evaluation import (
    EvalSettings, Evaluator, eval_batch, eval_rows_multiple,
)


@dataclass
class PPOParams:
    """The params of a PPO run (`build_params`).

    Attributes:
      actor_tx, critic_tx: the optimisers (`optim.*`, schedules over every update).
      state: `{"actor": TrainState, "critic": TrainState or None (a shared critic, or a
        critic-free estimator), "kl": the KL controller, "rng": PRNG key}`, on the mesh.
      frozen: `{"actor", "critic"}`, a LoRA model's frozen base ({} without): an input of every
        jitted call, never trained or saved.
      ref_params, reward_params: the reference's and reward model's params (host memory with
        `model.offload_frozen`; `reward_params` None without a reward model).
      shared_base: the reference is the LoRA actor's base (adapters off or as loaded), the
        same arrays.
    """

    actor_tx: optax.GradientTransformation
    critic_tx: optax.GradientTransformation
    state: dict
    frozen: dict
    ref_params: Any
    reward_params: Any
    shared_base: bool


def build_params(cfg: Config, place, models) -> PPOParams:
    """The optimisers, train states, KL controller, RNG and frozen params of `models`
    (`loading.models.build_models`, or `abstract_models`): the train states take over
    (donate) the loaded param buffers, so `models.actor.params` and `models.critic.params`
    are None afterwards; with `model.offload_frozen` the reference (unless it is the actor's
    base) and the reward model go to host memory between experience passes."""
    p = cfg.ppo
    opt_steps = cfg.train.steps * p.ppo_epochs * (p.batch_size // p.mini_batch_size)
    actor_tx = actor_optimizer(cfg.optim, opt_steps, shared_critic=cfg.model.shared_critic)
    critic_tx = optimizer_from_config(cfg.optim, cfg.optim.critic_lr, opt_steps)
    state = {
        "actor": place.create_state(models.actor.params, actor_tx),
        "critic": (None if models.critic is None
                   else place.create_state(models.critic.params, critic_tx)),
        "kl": place.replicate(init_kl_controller(p.kl_controller, p.kl_coef, p.target_kl,
                                                 p.horizon)),
        "rng": place.replicate(jax.random.PRNGKey(cfg.train.seed)),
    }
    frozen = {"actor": models.actor.frozen,
              "critic": {} if models.critic is None else models.critic.frozen}
    models.actor.params = None
    if models.critic is not None:
        models.critic.params = None
    ref_params = models.reference.params
    shared_base = bool(cfg.model.lora.rank) and not cfg.model.reference
    reward_params = models.reward.params if models.reward else None
    if cfg.model.offload_frozen:
        if not shared_base:  # the actor's base stays where the actor needs it
            ref_params = place.offload(ref_params)
        reward_params = place.offload(reward_params)
    return PPOParams(actor_tx=actor_tx, critic_tx=critic_tx, state=state, frozen=frozen,
                     ref_params=ref_params, reward_params=reward_params, shared_base=shared_base)


def join_models(models, frozen: dict, actor_params, critic_params=None, ref_params=None,
                reward_params=None) -> PPOModels:
    """The run's `models` (their graphs) as one `PPOModels` value around the given params,
    each trained model's joined with its `frozen` base (`trainer.state.full_params`); the reward model
    only when the run has one, the critic only when `critic_params` is given."""
    critic = (None if critic_params is None
              else Model(models.critic.graphdef, full_params(frozen["critic"], critic_params)))
    reward = None if models.reward is None else Model(models.reward.graphdef, reward_params)
    return PPOModels(Model(models.actor.graphdef, full_params(frozen["actor"], actor_params)),
                     Model(models.reference.graphdef, ref_params), critic, reward)


def build_evaluator(cfg: Config, place, tokenizer, model_cfg, settings: EvalSettings,
                    shardings: PPOModels, *, abstract: bool, reward_fn: Optional[Callable],
                    decode: Callable, sampler: Sampler, rollout_shards: int = 1) -> Evaluator:
    """The held-out evaluation (`eval.*`): the eval prompts tokenised like the training
    prompts (`loading.models.prompt_set`; shapes only when `abstract`), sampled with the eval
    `settings`, scored by the run's reward (`reward_fn`, or the reward model), its models laid
    out as `shardings` (the critic left out), sampled by the run's `sampler` (laid out for
    the trained params; its rows a multiple of the rollout group's `rollout_shards` too
    with `generation.placement: split`); with `eval.plain_instruction`, its `plain`
    evaluator of the same problems asked plainly (`data.prompts.plain_instruction_config`),
    decoded without `data.response_prefix`.

    Raises:
      FileNotFoundError / ValueError / ConfigError: a bad eval prompt file, or prompts too
        long for the context (see `loading.models.build_prompts`).
    """
    e = cfg.eval
    plain = None
    if e.plain_instruction:  # the same problems, plainly asked: eval/accuracy_plain
        plain = build_evaluator(plain_instruction_config(cfg, e.plain_instruction), place,
                                tokenizer, model_cfg, settings, shardings, abstract=abstract,
                                reward_fn=reward_fn,
                                decode=partial(rewards.decode_responses, tokenizer, ""),
                                sampler=sampler, rollout_shards=rollout_shards)
    prompts = prompt_set(cfg, tokenizer, model_cfg, e.prompts, "eval.prompts", abstract=abstract,
                         new_tokens=settings.sampling.max_new_tokens, rows=e.num_prompts,
                         new_tokens_key=("eval.max_new_tokens" if e.max_new_tokens
                                         else "generation.max_new_tokens"))
    batch = eval_batch(prompts, e.num_prompts,
                       eval_rows_multiple(math.lcm(place.batch_shards, rollout_shards),
                                          cfg.ppo.micro_batch_size),
                       e.samples_per_prompt)
    return Evaluator(batch, settings, place, replace(shardings, critic=None), seed=e.seed,
                     reward_fn=reward_fn, decode=decode, plain=plain,
                     sampler=sampler.laid_out(shardings.actor))
