"""The static settings of a PPO run, built once from its config: sampling, experience making
(with its forward passes), the update and the held-out evaluation.

Each layer takes its own frozen settings dataclass, with no defaults of its own: sampling,
the paged engine, the forward passes, the experience pass, the update and the evaluation.
Every field is written out below from its config key, so a grep for a key
(`cliprange`) finds where it reaches the step. What the config does not hold (the mesh, the
tokenizer's stop and pad ids, the reward model's score statistics) comes from the trainer. The
config itself is checked when it loads (`trainer.config.checks`) and, for what needs more than
one key, by `load_checks`; the code downstream trusts both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ppo_jax.rollout.engine_layout import EngineSettings
from ppo_jax.trainer.stages.ppo.experience import ExperienceSettings
from ppo_jax.core import get_advantage_estimator, needs_greedy_baseline
from ppo_jax.rollout.draws import SamplingSettings
from ppo_jax.rollout.forward import ForwardSettings
from ppo_jax.trainer.config import Config, static_kwargs
from ppo_jax.trainer.stages.ppo.evaluation import EvalSettings
from ppo_jax.trainer.stages.ppo.update import UpdateSettings


@dataclass(frozen=True)
class PPOSettings:
    """The static settings of every jitted call of a PPO step (`settings_for`). greedy_baseline:
    ReMax's greedy sampling, None when the estimator needs none; engine: the paged engine's,
    None with the static batch (`generation.engine`)."""

    sampling: SamplingSettings
    greedy_baseline: Optional[SamplingSettings]
    engine: Optional[EngineSettings]
    experience: ExperienceSettings
    update: UpdateSettings
    eval: EvalSettings


def forward_settings(cfg: Config, *, mesh=None, score_normalizer=None,
                     reward_eos_id: Optional[int] = None) -> ForwardSettings:
    """The forward passes' settings (experience making; the evaluation at its own temperature)."""
    return ForwardSettings(temperature=cfg.generation.temperature,
                           micro_batch_size=cfg.ppo.micro_batch_size,
                           logprob_chunk_size=cfg.model.logprob_chunk_size, mesh=mesh,
                           score_normalizer=score_normalizer, reward_eos_id=reward_eos_id)


def sampling_settings(cfg: Config, *, stop_token_ids: tuple[int, ...], pad_token_id: int,
                      mesh=None) -> SamplingSettings:
    """The training sampler's settings (`generation.*`); one prefill per group of
    `generation.samples_per_prompt` rows unless `generation.share_prompt_prefill` is off.
    Single-turn: an environment's turns are added by `stages.ppo.episodes.EpisodeRunner`
    (its stop strings are the environment's)."""
    g = cfg.generation
    return SamplingSettings(
        max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
        greedy=g.greedy, stop_token_ids=() if g.ignore_eos else tuple(stop_token_ids),
        pad_token_id=pad_token_id,
        samples_per_prompt=g.samples_per_prompt if g.share_prompt_prefill else 1, mesh=mesh,
        turns=None, record_routes=cfg.model.router_replay == "rollout")


def experience_settings(cfg: Config, forward: ForwardSettings, *,
                        shared_critic: bool) -> ExperienceSettings:
    """Experience making's settings (`ppo.*`: KL estimator, reward shaping, advantages)."""
    p = cfg.ppo
    return ExperienceSettings(
        forward=forward, kl_estimator=p.kl_estimator, reward_clip=p.reward_clip,
        score_scale=p.score_scale, missing_eos_penalty=p.missing_eos_penalty,
        whiten_rewards=p.whiten_rewards, whiten_advantages=p.whiten_advantages,
        advantage_estimator=p.advantage_estimator, gamma=p.gamma, lam=p.lam,
        critic_lam=p.critic_lam, lam_length_alpha=p.lam_length_alpha,
        advantage_kwargs=static_kwargs(p.advantage_kwargs), shared_critic=shared_critic,
        reward_shaping=p.reward_shaping, reward_shaping_kwargs=static_kwargs(p.reward_shaping_kwargs),
        overlong_buffer=p.overlong_buffer, overlong_penalty_factor=p.overlong_penalty_factor,
        max_response_length=cfg.generation.max_new_tokens,
        samples_per_prompt=cfg.generation.samples_per_prompt)


def update_settings(cfg: Config, *, shared_critic: bool, mesh=None,
                    router_aux_loss_coef: float = 0.0) -> UpdateSettings:
    """The update's settings (`ppo.*`: epochs, minibatches, losses, clipping, coefficients);
    `router_aux_loss_coef` the MoE actor's (`router_aux_loss_coef`), 0 for a dense one."""
    p = cfg.ppo
    return UpdateSettings(
        ppo_epochs=p.ppo_epochs, mini_batch_size=p.mini_batch_size,
        micro_batch_size=p.micro_batch_size, temperature=cfg.generation.temperature,
        policy_loss=p.policy_loss, value_loss=p.value_loss, cliprange=p.cliprange,
        cliprange_high=p.cliprange_high, dual_clip=p.dual_clip, cliprange_value=p.cliprange_value,
        policy_loss_kwargs=static_kwargs(p.policy_loss_kwargs),
        value_loss_kwargs=static_kwargs(p.value_loss_kwargs), loss_aggregation=p.loss_aggregation,
        entropy_coef=p.entropy_coef, kl_loss_coef=p.kl_loss_coef,
        kl_loss_estimator=p.kl_loss_estimator, shared_critic=shared_critic, vf_coef=p.vf_coef,
        mesh=mesh, train_actor=True, logprob_chunk_size=cfg.model.logprob_chunk_size,
        max_response_length=cfg.generation.max_new_tokens,
        rollout_correction=p.rollout_correction, rollout_correction_cap=p.rollout_correction_cap,
        rollout_correction_band=(p.rollout_correction_band_low, p.rollout_correction_band_high),
        router_aux_loss_coef=router_aux_loss_coef)



def engine_settings(cfg: Config) -> Optional[EngineSettings]:
    """The paged engine's settings (`generation.*`), or None with the static sampler."""
    g = cfg.generation
    if g.engine != "paged":
        return None
    return EngineSettings(page_size=g.page_size, num_pages=g.num_pages,
                          max_concurrent=g.max_concurrent, decode_chunk=g.decode_chunk,
                          decode_buckets=g.decode_buckets, attention=g.attention)


def settings_for(cfg: Config, *, shared_critic: bool = False, mesh=None, rollout_mesh=None,
                 score_normalizer: Optional[tuple[float, float]] = None,
                 reward_eos_id: Optional[int] = None, stop_token_ids: tuple[int, ...] = (),
                 pad_token_id: int = 0, router_aux_loss_coef: float = 0.0) -> PPOSettings:
    """The `PPOSettings` of `cfg`.

    Args:
      shared_critic: the value head sits on the actor (`model.shared_critic`).
      mesh: the mesh of in-jit sharding constraints, None on one device.
      rollout_mesh: the sampler's mesh with `generation.placement: split` (the rollout
        group's); None: `mesh`.
      score_normalizer: the reward model's `(mean, std)` when `reward.normalize`, else None.
      reward_eos_id: with `reward.eos_at_end`, the EOS id the reward model reads at, else None.
      stop_token_ids, pad_token_id: from the tokenizer and the model config;
        `generation.ignore_eos` samples with no stop token.
      router_aux_loss_coef: the MoE actor's (`router_aux_loss_coef`); 0 for a dense actor.
    """
    e = cfg.eval
    forward = forward_settings(cfg, mesh=mesh, score_normalizer=score_normalizer,
                               reward_eos_id=reward_eos_id)
    sampling = sampling_settings(cfg, stop_token_ids=stop_token_ids, pad_token_id=pad_token_id,
                                 mesh=mesh if rollout_mesh is None else rollout_mesh)
    eval_sampling = dataclasses.replace(  # eval.samples_per_prompt answers share a prefill too
        sampling, max_new_tokens=e.max_new_tokens or cfg.generation.max_new_tokens,
        temperature=e.temperature, greedy=e.greedy,
        samples_per_prompt=e.samples_per_prompt if cfg.generation.share_prompt_prefill else 1)
    greedy = needs_greedy_baseline(get_advantage_estimator(cfg.ppo.advantage_estimator))
    return PPOSettings(
        sampling=sampling,
        greedy_baseline=dataclasses.replace(sampling, greedy=True) if greedy else None,
        engine=engine_settings(cfg),
        experience=experience_settings(cfg, forward, shared_critic=shared_critic),
        update=update_settings(cfg, shared_critic=shared_critic, mesh=mesh,
                               router_aux_loss_coef=router_aux_loss_coef),
        eval=EvalSettings(eval_sampling, dataclasses.replace(forward, temperature=e.temperature)))
