"""The jitted programs of a PPO step. `build_programs` builds them once per run: each pure
function is bound to its static settings, graphs and optimisers, and jitted with explicit
layouts. `PPOTrainer.step()` calls them through its `jit` attribute, a `StepPrograms`.
`step_programs` and `resident` list them with abstract arguments for `--compile-for`, so what
is compiled is what a run runs.

The functions themselves live with their math and are importable as they are: the sampler
`rollout.sampler.Sampler`, `experience.experience_step`, `update.ppo_update`,
`rollout.forward.rollout_scores` (ReMax's greedy baseline with a reward model), and dynamic
sampling's `core.informative_groups` and `dynamic.select_rollout`. Only arrays and pytrees of
arrays are positional; graphs, optimisers and settings are keywords.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from ppo_jax.core import informative_groups
from ppo_jax.models.functional import Model
from ppo_jax.parallel.rules import ROLLOUT_RULES, tree_shardings
from ppo_jax.rollout.draws import ROUTE_DTYPE, SamplingSettings, TurnSettings
from ppo_jax.rollout.forward import Rollout, rollout_scores
from ppo_jax.rollout.sampler import Sampler
from ppo_jax.rollout.weights import rollout_copy_fn, rollout_rules
from ppo_jax.trainer.config import Config
from ppo_jax.trainer.programs import Program, batch_shape, out_shapes
from ppo_jax.trainer.stages.ppo import dynamic
from ppo_jax.trainer.stages.ppo.experience import (
    ExperienceOut, PPOModels, RolloutBatch, experience_step,
)
from ppo_jax.trainer.stages.ppo.rollout_group import GroupSampler
from ppo_jax.trainer.stages.ppo.packing import abstract_plans
from ppo_jax.trainer.stages.ppo.update import ppo_update


def split_keys(key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A step's PRNG key -> `(next step's key, sampling key, update key)`."""
    return tuple(jax.random.split(key, 3))


@dataclass(frozen=True)
class StepPrograms:
    """The jitted programs one PPO step calls, the objects `--compile-for` compiles too.

    Attributes:
      split_keys: `split_keys`, replicated out.
      rollout_copy: actor params -> their rollout copy (`rollout.weights.rollout_copy_fn`), or
        None when the sampler takes the trained params as they are, or with
        `generation.placement: split` (the `rollout_group.RolloutWeights` sync instead).
      sampler: the run's `rollout.sampler.Sampler` (split: a `rollout_group.GroupSampler`),
        `(actor Model, prompt_ids [B, P], prompt_mask [B, P], key, SamplingSettings) ->
        Generation` (training, ReMax's greedy baseline, dynamic sampling, episodes and the
        evaluation alike).
      reward_model_scores: `rollout.forward.rollout_scores`, `(reward Model, Rollout) -> [B]`.
      experience: `experience.experience_step`.
      update: `update.ppo_update`, the train states donated.
      update_critic_only: the same with the actor left out (`ppo.critic_warmup_steps`).
      informative: `scores [B] -> [B / n]` bool, `core.informative_groups` (dynamic sampling;
        else None).
      select: `dynamic.select_rollout` (dynamic sampling; else None).
    """

    split_keys: Callable
    rollout_copy: Optional[Callable]
    sampler: Sampler
    reward_model_scores: Callable
    experience: Callable
    update: Callable
    update_critic_only: Callable
    informative: Optional[Callable] = None
    select: Optional[Callable] = None


def rollout_shardings(actor: Model, actor_sh: Model, place, layout: str, copied: bool) -> Model:
    """The shardings of the actor as the sampler receives it (`actor`: its arrays or shapes,
    `actor_sh`: their training shardings): the training ones, or, when the trainer makes a
    rollout copy on a mesh, `rollout_rules(layout)`'s."""
    if not copied or place.constraint_mesh is None:
        return actor_sh
    return replace(actor_sh, params=tree_shardings(actor.params, place.mesh,
                                                   rollout_rules(layout)))


def build_sampler(cfg: Config, st, place, m, *, actor, models_sh, rollout_layout: str,
                  rollout_place=None):
    """`(sampler, rollout copy)`: the run's sampler and the trainer's `params -> rollout copy`
    program (None: the sampler reads the trained params). Colocated, the sampler reads the
    rollout copy of the actor (cast to generation.param_dtype, laid out by
    generation.rollout_layout) on the trainer's mesh, or the trained params when no copy is
    needed. Split (`rollout_place` given), a `rollout_group.GroupSampler` on the rollout mesh
    reads the copy `rollout_group.RolloutWeights` keeps there."""
    if rollout_place is not None:
        sh = replace(models_sh.actor, params=tree_shardings(actor.params, rollout_place.mesh,
                                                            ROLLOUT_RULES))
        inner = Sampler(st.engine, m.actor.cfg, by_row=rollout_place.by_row,
                        replicated=rollout_place.replicated, actor_shardings=sh)
        return GroupSampler(inner, rollout=rollout_place, trainer=place), None
    copy = rollout_copy_fn(actor.params, place.constraint_mesh, rollout_layout,
                           cfg.generation.param_dtype)
    sampler = Sampler(st.engine, m.actor.cfg, by_row=place.by_row, replicated=place.replicated,
                      actor_shardings=rollout_shardings(actor, models_sh.actor, place,
                                                        rollout_layout, copy is not None))
    return sampler, copy


def build_programs(cfg: Config, st, place, m, *, actor, models_sh, state: dict, frozen: dict,
                   stop_ids, rollout_layout: str, actor_tx, critic_tx,
                   rollout_place=None) -> StepPrograms:
    """The step's programs, built once per run: each bound to the run's settings `st`
    (`PPOSettings`), graphs (`m`, the loaded models) and optimisers, and jitted with explicit
    layouts: params by the partition rules (`models_sh`, a `PPOModels` of shardings), the
    train states and the `frozen` LoRA base by `place`, batches by row, the rest replicated.
    `actor` is the actor as the sampler sees it (LoRA: base and adapters joined); the sampler
    is `build_sampler`'s (on `rollout_place` with `generation.placement: split`). The
    experience pass and the update compile once per (prompt, response) bucket width."""
    by_row, rep = place.by_row, place.replicated
    sampler, copy = build_sampler(cfg, st, place, m, actor=actor, models_sh=models_sh,
                                  rollout_layout=rollout_layout, rollout_place=rollout_place)
    rollout_sh = Rollout(by_row, by_row, by_row, by_row)
    state_sh = (place.shardings(state["actor"]), place.shardings(state["critic"]))
    frozen_sh = place.shardings(frozen)
    jit_update = partial(jax.jit, in_shardings=(*state_sh, frozen_sh, by_row, rep, rep),
                         out_shardings=(*state_sh, rep), donate_argnums=(0, 1))
    update = partial(ppo_update, actor_graphdef=m.actor.graphdef,
                     critic_graphdef=None if m.critic is None else m.critic.graphdef,
                     actor_tx=actor_tx, critic_tx=critic_tx)
    n, dynamic_sampling = cfg.generation.samples_per_prompt, cfg.ppo.dynamic_sampling
    groups = cfg.ppo.batch_size // n
    return StepPrograms(
        split_keys=jax.jit(split_keys, out_shardings=rep),
        rollout_copy=copy, sampler=sampler,
        reward_model_scores=jax.jit(
            partial(rollout_scores, s=st.experience.forward),
            in_shardings=(models_sh.reward, rollout_sh), out_shardings=by_row),
        experience=jax.jit(
            partial(experience_step, settings=st.experience, stop_token_ids=stop_ids),
            in_shardings=(models_sh, rep, RolloutBatch(*(by_row,) * 7, packing=rep)),
            out_shardings=ExperienceOut(by_row, rep, rep, rep)),
        update=jit_update(partial(update, settings=st.update)),
        # ppo.critic_warmup_steps: the update with the actor left out (compiled when used)
        update_critic_only=jit_update(
            partial(update, settings=replace(st.update, train_actor=False))),
        informative=(jax.jit(partial(informative_groups, num_groups=groups,
                                     samples_per_prompt=n), out_shardings=rep)
                     if dynamic_sampling else None),
        select=(jax.jit(partial(dynamic.select_rollout, keep=groups, n=n),
                        out_shardings=(by_row, by_row, rep, rep)) if dynamic_sampling else None))


def step_programs(jit: StepPrograms, models: PPOModels, state: dict, frozen: dict, *, cfg: Config,
                  settings, place, prompt_width: int, scored_on_host: bool, model_shardings: PPOModels,
                  rollout_layout: str, evaluator=None, weights=None,
                  packer=None) -> list[Program]:
    """The jitted programs of one PPO step (`trainer.programs`) with the arguments of the
    widest batch: prompts `prompt_width` (`data.max_prompt_length`) wide, responses
    `max_new_tokens` long; the ReMax greedy pass when `settings.greedy_baseline` is set, the
    critic-only update when `ppo.critic_warmup_steps` > 0 (`per_step` 0: warm-up steps only)
    and the evaluation (`per_step` 1 / eval.every). With `env.name` the sampler is the engine's
    turn loop (its resume after an observation included) and the experience takes the
    episodes' action mask; the evaluation is compiled single-turn (an abstract build has no
    environment to play).

    Args:
      jit: the step's programs.
      models: the run's `PPOModels` (abstract arrays; the frozen params as the experience
        pass receives them); state: `{"actor", "critic", "kl", "rng"}`; frozen: a LoRA
        model's base (`{"actor", "critic"}`); settings: the run's `PPOSettings`.
      scored_on_host: the reward function scores (else the reward model, in the experience).
      model_shardings: the training shardings of `models`; rollout_layout: the rollout copy's
        layout (`generation.rollout_layout`, resolved).
      evaluator: the `Evaluator` of `eval.*`, or None.
      weights: with `generation.placement: split`, the `rollout_group.RolloutWeights` (placed
        abstractly): the sampler runs on its copy, and the trainer's copy programs are listed.
      packer: with `ppo.packing`, the run's `packing.Packer`: the experience pass and the
        update compile over the packed rows of a heavy-tailed batch (`packing.abstract_plans`).
    """
    size, new = cfg.ppo.batch_size, cfg.generation.max_new_tokens
    ids = lambda *shape: batch_shape(place, shape, jnp.int32)  # noqa: E731
    q, qm = ids(size, prompt_width), ids(size, prompt_width)
    rollout = Rollout(q, qm, ids(size, new), ids(size, new),
                      _abstract_routes(jit.sampler, settings.sampling, place, size, new))
    _, gen_key, upd_key = out_shapes(jit.split_keys, (state["rng"],), place.replicated)
    scores = batch_shape(place, (size,), jnp.float32) if scored_on_host else None
    remax = settings.greedy_baseline is not None
    baseline = batch_shape(place, (size,), jnp.float32) if remax else None
    logprobs = batch_shape(place, (size, new), jnp.float32)
    sampling, episode = settings.sampling, None
    if cfg.env.name:  # episodes: the engine's turn loop, and the experience of its action mask
        # (the environment's stop strings need its tokenizer; they do not change a shape)
        sampling = replace(sampling, turns=TurnSettings((), cfg.env.max_turns))
        episode = {"action_mask": ids(size, new), "ended": batch_shape(place, (size,), bool),
                   "scores": batch_shape(place, (size,), jnp.float32)}
    exp_plan, update_plan = (None, None) if packer is None else abstract_plans(
        packer, size, prompt_width, new)
    exp_args = (models, state["kl"], RolloutBatch(rollout, ids(size), scores, baseline, logprobs,
                                                  packing=exp_plan))
    if episode is not None:
        exp_args = (models, state["kl"], replace(exp_args[2], **episode))
    exp = out_shapes(lambda *a: jit.experience(*a).experience, exp_args, place.by_row)
    if weights is None:
        out, rollout_actor = _rollout_programs(jit.rollout_copy, models.actor,
                                               model_shardings.actor, place, rollout_layout)
    else:
        out, rollout_actor = weights.programs(state["actor"].params, frozen["actor"]), weights.actor
    sample_args = (rollout_actor, q, qm, gen_key)
    out += sampler_programs(jit.sampler, sample_args, sampling, "")
    if remax:
        out += sampler_programs(jit.sampler, sample_args, settings.greedy_baseline, "greedy_")
        if not scored_on_host:
            out.append(Program("greedy_scores", jit.reward_model_scores,
                               (models.reward, rollout.replace(routes=None))))
    actor, critic = state["actor"], state["critic"]
    out += [Program("experience", jit.experience, exp_args),
            Program("update", jit.update, (actor, critic, frozen, exp, upd_key, update_plan))]
    if cfg.ppo.critic_warmup_steps:
        out.append(Program("update_critic_only", jit.update_critic_only,
                           (actor, critic, frozen, exp, upd_key, update_plan), per_step=0.0,
                           note=f"steps 1-{cfg.ppo.critic_warmup_steps}, in place of update"))
    if evaluator is not None:
        out += evaluator.programs(replace(models, critic=None), per_step=1.0 / cfg.eval.every,
                                  sampling_actor=None if weights is None else rollout_actor)
    return out


def _abstract_routes(sampler: Sampler, sampling: SamplingSettings, place, size: int, new: int):
    """The recorded experts `[size, new, sparse layers, k]` (router replay) as the experience
    pass receives them, or None when the sampler records none."""
    if not sampler.records_routes(sampling):
        return None
    cfg = sampler.model_cfg
    return batch_shape(place, (size, new, cfg.num_moe_layers, cfg.num_experts_per_tok),
                       ROUTE_DTYPE)


def _rollout_programs(rollout_copy, actor: Model, actor_sh: Model, place, layout: str):
    """`([the rollout copy's program], the actor as the sampler takes it)`: with a rollout
    copy (`rollout.weights`), its cast / reshard once per step and its abstract output."""
    if rollout_copy is None:
        return [], actor
    sh = rollout_shardings(actor, actor_sh, place, layout, True)
    params = out_shapes(rollout_copy, (actor.params,), sh.params)
    return [Program("rollout_copy", rollout_copy, (actor.params,))], Model(actor.graphdef, params)


def sampler_programs(sampler: Sampler, args, settings: SamplingSettings, prefix: str,
                     per_step: float = 1.0, note: str = "") -> list[Program]:
    """The sampler's programs for `settings` (`Sampler.programs`: the static batch, its decode
    loop at most max_new_tokens - 1 steps, or the paged engine's prefill and decode chunk) as
    `Program`s, each call count scaled by `per_step`."""
    return [Program(p["name"], p["fn"], p["args"], per_step=p["per_step"] * per_step,
                    note=note, while_trips=p["while_trips"])
            for p in sampler.programs(*args, settings, prefix=prefix)]


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
