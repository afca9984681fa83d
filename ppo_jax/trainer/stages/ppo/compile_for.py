"""The ahead-of-time view of a PPO step (`train.py --compile-for`, `trainer.programs`): the
step's jitted programs with abstract arguments (`step_programs`), and what stays in device
memory between them (`resident`). The programs are the step's own `steps.Jitted` objects, the
very ones `PPOTrainer.step()` calls, so what is compiled is what a run runs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import jax.numpy as jnp

from ppo_jax.models.functional import Model
from ppo_jax.rollout.experience import PPOModels
from ppo_jax.rollout.forward import Rollout
from ppo_jax.trainer.config import Config
from ppo_jax.trainer.programs import Program, batch_shape, out_shapes
from ppo_jax.trainer.stages.ppo.samplers import EngineSampler, rollout_shardings
from ppo_jax.trainer.stages.ppo.steps import Jitted


def step_programs(jit: Jitted, models: PPOModels, state: dict, frozen: dict, *, cfg: Config,
                  place, prompt_width: int, scored_on_host: bool, model_shardings: PPOModels,
                  rollout_layout: str, evaluator=None) -> list[Program]:
    """The jitted programs of one PPO step (`trainer.programs`) with the arguments of the
    widest batch: prompts `prompt_width` (`data.max_prompt_length`) wide, responses
    `max_new_tokens` long; the ReMax greedy pass when `jit.sample_greedy` is set, the
    critic-only update when `ppo.critic_warmup_steps` > 0 (`per_step` 0: warm-up steps only)
    and the evaluation (`per_step` 1 / eval.every).

    Args:
      jit: the step's programs.
      models: the run's `PPOModels` (abstract arrays; the frozen params as the experience
        pass receives them); state: `{"actor", "critic", "kl", "rng"}`; frozen: a LoRA
        model's base (`{"actor", "critic"}`).
      scored_on_host: the reward function scores (else the reward model, in the experience).
      model_shardings: the training shardings of `models`; rollout_layout: the rollout copy's
        layout (`generation.rollout_layout`, resolved).
      evaluator: the `Evaluator` of `eval.*`, or None.
    """
    size, new = cfg.ppo.batch_size, cfg.generation.max_new_tokens
    ids = lambda *shape: batch_shape(place, shape, jnp.int32)  # noqa: E731
    q, qm = ids(size, prompt_width), ids(size, prompt_width)
    rollout = Rollout(q, qm, ids(size, new), ids(size, new))
    _, gen_key, upd_key = out_shapes(jit.split_keys, (state["rng"],), place.replicated)
    scores = batch_shape(place, (size,), jnp.float32) if scored_on_host else None
    remax = jit.sample_greedy is not None
    baseline = batch_shape(place, (size,), jnp.float32) if remax else None
    logprobs = batch_shape(place, (size, new), jnp.float32)
    # no action mask, ended read from the responses: a single-turn step (env.* is not compiled)
    exp_args = (models, state["kl"], rollout, scores, ids(size), baseline, logprobs, None, None)
    exp = out_shapes(lambda *a: jit.experience(*a).experience, exp_args, place.by_row)
    out, rollout_actor = _rollout_programs(jit.rollout_copy, models.actor, model_shardings.actor,
                                           place, rollout_layout)
    sample_args = (rollout_actor, q, qm, gen_key)
    out += _sampler_programs(jit.sample, sample_args, "", new)
    if remax:
        out += _sampler_programs(jit.sample_greedy, sample_args, "greedy_", new)
        if not scored_on_host:
            out.append(Program("greedy_scores", jit.reward_model_scores, (models.reward, rollout)))
    actor, critic = state["actor"], state["critic"]
    out += [Program("experience", jit.experience, exp_args),
            Program("update", jit.update, (actor, critic, frozen, exp, upd_key))]
    if cfg.ppo.critic_warmup_steps:
        out.append(Program("update_critic_only", jit.update_critic_only,
                           (actor, critic, frozen, exp, upd_key), per_step=0.0,
                           note=f"steps 1-{cfg.ppo.critic_warmup_steps}, in place of update"))
    if evaluator is not None:
        out += evaluator.programs(replace(models, critic=None), per_step=1.0 / cfg.eval.every)
    return out


def _rollout_programs(rollout_copy, actor: Model, actor_sh: Model, place, layout: str):
    """`([the rollout copy's program], the actor as the sampler takes it)`: with a rollout
    copy (`rollout.weights`), its cast / reshard once per step and its abstract output."""
    if rollout_copy is None:
        return [], actor
    sh = rollout_shardings(actor, actor_sh, place, layout, True)
    params = out_shapes(rollout_copy, (actor.params,), sh.params)
    return [Program("rollout_copy", rollout_copy, (actor.params,))], Model(actor.graphdef, params)


def _sampler_programs(sampler, args, prefix: str, max_new_tokens: int) -> list[Program]:
    """The static sampler (its decode loop at most max_new_tokens - 1 steps) or the paged
    engine's prefill and decode chunk (`EngineSampler.programs`)."""
    if isinstance(sampler, EngineSampler):
        return sampler.programs(*args, prefix=prefix)
    return [Program(prefix + "sampler", sampler, args, while_trips=max_new_tokens - 1)]


def resident(state: dict, frozen: dict, ref_params, reward_params, *, shared_base: bool,
             evaluator: Optional[object] = None) -> dict:
    """Train states, the KL controller and RNG, the frozen params (a LoRA run's base, the
    reference's and reward model's: host memory when `model.offload_frozen`) and the eval
    prompts: held between the programs of a step (`StageTrainer.resident`). With
    `shared_base` the reference is the actor's base, counted once."""
    out = {"state": state, "frozen_base": frozen,
           "reference": {} if shared_base else ref_params,  # LoRA: the base
           "reward_model": reward_params}
    if evaluator is not None:
        out["eval_prompts"] = evaluator.inputs()
    return out
