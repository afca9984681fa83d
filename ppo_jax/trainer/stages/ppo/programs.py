"""The ahead-of-time view of `PPOTrainer` (`train.py --compile-for`): the jitted programs of a
PPO step with abstract arguments, and what stays in device memory between them. A mixin of
`PPOTrainer`: it reads the trainer's own jitted functions (`_generate`, `_experience`,
`_update`, ...), states and placement, so what is compiled is what `step()` calls.
"""

from __future__ import annotations

from dataclasses import replace

import jax.numpy as jnp

from ppo_jax.core import get_advantage_estimator, needs_greedy_baseline
from ppo_jax.models.functional import Model
from ppo_jax.rollout.scoring import Rollout
from ppo_jax.trainer.programs import Program, batch_shape, out_shapes
from ppo_jax.trainer.stages.ppo.samplers import EngineSampler, rollout_shardings


class PPOPrograms:
    """`programs()` and `resident()` of a built `PPOTrainer` (see `trainer.programs`)."""

    def programs(self) -> list[Program]:
        """The jitted functions of one PPO step (`trainer.programs`) with the arguments of the
        widest batch: prompts `data.max_prompt_length` wide, responses `max_new_tokens` long;
        the ReMax greedy pass when the estimator needs it, the critic-only update when
        `ppo.critic_warmup_steps` > 0 (`per_step` 0: warm-up steps only) and the evaluation
        (`per_step` 1 / eval.every)."""
        cfg, place = self.cfg, self.place
        size, new = cfg.ppo.batch_size, cfg.generation.max_new_tokens
        width = self.prompt_columns.full
        ids = lambda *shape: batch_shape(place, shape, jnp.int32)  # noqa: E731
        q, qm, resp, resp_mask = ids(size, width), ids(size, width), ids(size, new), ids(size, new)
        _, gen_key, upd_key = out_shapes(self._split, (self.state["rng"],), place.replicated)
        actor, critic = self.state["actor"], self.state["critic"]
        scores = None if self.reward_fn is None else batch_shape(place, (size,), jnp.float32)
        remax = needs_greedy_baseline(get_advantage_estimator(cfg.ppo.advantage_estimator))
        baseline = batch_shape(place, (size,), jnp.float32) if remax else None
        ref, reward = place.onload(self.ref_params), place.onload(self.reward_params)
        models = self.ppo_models(actor.params, None if critic is None else critic.params, ref,
                                 reward)
        rollout = Rollout(q, qm, resp, resp_mask)
        logprobs = batch_shape(place, (size, new), jnp.float32)
        exp_args = (models, self.state["kl"], rollout, scores, ids(size), baseline, logprobs)
        exp = out_shapes(lambda *a: self._experience(*a)[0], exp_args, place.rows)
        out, rollout_actor = self._rollout_programs(models.actor)
        sample_args = (rollout_actor, q, qm, gen_key)
        out += self._sampler_programs(self._generate, sample_args, "")
        if remax:
            out += self._sampler_programs(self._generate_greedy, sample_args, "greedy_")
            if self.reward_fn is None:
                out.append(Program("greedy_scores", self._rm_scores, (models.reward, rollout)))
        out += [Program("experience", self._experience, exp_args),
                Program("update", self._update, (actor, critic, self.frozen, exp, upd_key))]
        if cfg.ppo.critic_warmup_steps:
            out.append(Program("update_critic_only", self._update_critic_only,
                               (actor, critic, self.frozen, exp, upd_key), per_step=0.0,
                               note=f"steps 1-{cfg.ppo.critic_warmup_steps}, in place of update"))
        if self.evaluator is not None:
            eval_models = replace(models, critic=None)
            out += self.evaluator.programs(eval_models, per_step=1.0 / cfg.eval.every)
        return out

    def _rollout_programs(self, actor):
        """`([the rollout copy's program], the actor as the sampler takes it)`: with a rollout
        copy (`rollout.weights`), its cast / reshard once per step and its abstract output."""
        if self._rollout_copy is None:
            return [], actor
        sh = rollout_shardings(actor, self._model_shardings().actor, self.place,
                               self.rollout_layout, True)
        params = out_shapes(self._rollout_copy, (actor.params,), sh.params)
        return [Program("rollout_copy", self._rollout_copy, (actor.params,))], \
            Model(actor.graphdef, params)

    def _sampler_programs(self, sampler, args, prefix: str) -> list[Program]:
        """The static sampler (its decode loop at most max_new_tokens - 1 steps) or the paged
        engine's prefill and decode chunk (`EngineSampler.programs`)."""
        if isinstance(sampler, EngineSampler):
            return sampler.programs(*args, prefix=prefix)
        new = self.cfg.generation.max_new_tokens
        return [Program(prefix + "sampler", sampler, args, while_trips=new - 1)]

    def resident(self) -> dict:
        """Train states, the KL controller and RNG, the frozen params (a LoRA run's base, the
        reference's and reward model's: host memory when `model.offload_frozen`) and the eval
        prompts: held between the programs of a step."""
        out = {"state": self.state, "frozen_base": self.frozen,
               "reference": {} if self.shared_base else self.ref_params,  # LoRA: the base
               "reward_model": self.reward_params}
        if self.evaluator is not None:
            out["eval_prompts"] = self.evaluator.inputs()
        return out
