"""Stage 3, PPO, on the shared loop of `trainer.loop`. A step has three named parts
(`stages.ppo.parts`): `sample_rollout` (the next prompts, cut to the batch's widest prompt
bucket, and the actor's responses, cut to the longest response's bucket: `trainer.stages.ppo.columns`),
`score_rollout` (the reward function on the decoded text, or the reward model on the tokens,
and one jitted experience pass: log-probs, reference log-probs, values, rewards, advantages,
returns) and `learn` (one jitted call runs every PPO epoch and minibatch). Jitted functions
take every array as an argument (models as `PPOModels`); graphs, optimisers and settings
(`stages.ppo.settings`) are static. With `eval.*` the actor is evaluated on held-out prompts
(`trainer.stages.ppo.evaluation`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import jax
import numpy as np

from ppo_jax.core import init_kl_controller
from ppo_jax.models.functional import Model
from ppo_jax.models.lora import join
from ppo_jax.rollout.experience import PPOModels, make_experience
from ppo_jax.rollout.sampler import ended_rows
from ppo_jax.rollout.weights import resolve_layout, rollout_copy_fn
from ppo_jax.rollout.scoring import Rollout, rollout_scores
from ppo_jax.trainer.loop import StageTrainer
from ppo_jax.trainer.stages.ppo.columns import PromptColumns, ResponseColumns
from ppo_jax.trainer.config import ConfigError, eval_enabled
from ppo_jax.trainer.data.prompts import PromptSampler, prompt_records
from ppo_jax.trainer.stages.ppo.evaluation import Evaluator, eval_batch, eval_rows_multiple
from ppo_jax.trainer.host.memory import release_host_memory
from ppo_jax.trainer.optim import optimizer_from_config
from ppo_jax.trainer.rewards.functions import check_prompt_rows, get_reward_function
from ppo_jax.trainer.loading.models import (
    abstract_models, build_models, pad_token_id, prompt_set, stop_token_ids,
)
from ppo_jax.trainer.stages.ppo.checks import check_names
from ppo_jax.trainer.stages.ppo.parts import Learned, Sampled, Scored, step_metrics
from ppo_jax.trainer.stages.ppo.programs import PPOPrograms
from ppo_jax.trainer.stages.ppo.dynamic import DynamicSampling
from ppo_jax.trainer.stages.ppo.rewards import PPORewards
from ppo_jax.trainer.stages.ppo.samplers import (
    check_engine, check_kernel, engine_metrics, make_sampler, rollout_shardings,
)
from ppo_jax.trainer.stages.ppo.settings import engine_settings, settings_for
from ppo_jax.trainer.stages.ppo.update import ppo_update


class PPOTrainer(PPOPrograms, PPORewards, DynamicSampling, StageTrainer):
    """Owns the models, states and jitted steps of one PPO run.

    `PPOTrainer(cfg, resume=False, devices=None)` loads everything (raising ConfigError /
    FileNotFoundError / ValueError before any compile); `train()` runs the remaining steps;
    `step()` runs one.

    Every array lives on the device mesh of `cfg.mesh` (over `devices`, default all devices of
    all processes; `trainer.placement`): params and optimiser states sharded by the named rules
    of `ppo_jax.parallel.rules`, batches split over ("data", "fsdp"), the KL controller and RNG
    replicated. Each process feeds and reads only its own rows of every batch.
    """

    name = "ppo"
    finite_keys = ("kl",)

    def _check_config(self) -> None:
        check_names(self.cfg)

    def _check_inputs(self) -> None:
        self._check_config()
        sources = [("data.prompts", self.cfg.data.prompts)]
        if eval_enabled(self.cfg.eval):
            sources.append(("eval.prompts", self.cfg.eval.prompts))
        for key, source in sources:  # fails before loading
            rows = prompt_records(self.cfg, source, key)[1]
            if self.cfg.reward.kind == "function":
                check_prompt_rows(self.cfg.reward.function, rows, key, source)

    def _build(self) -> None:
        cfg, place = self.cfg, self.place
        place.check_batch("ppo.batch_size", cfg.ppo.batch_size)
        check_engine(cfg, place.batch_shards)
        build = abstract_models if self.is_abstract else build_models
        models = build(cfg, sharding_fn=place.sharding_fn)
        check_kernel(cfg, models.actor.cfg, place.mesh)
        self.models, self.tokenizer = models, models.tokenizer
        self.prompts = self._prompt_set(cfg.data.prompts, "data.prompts")
        self.prompt_columns = PromptColumns(self.prompts.mask, cfg.data.prompt_buckets)
        self.stop_ids = stop_token_ids(cfg, self.tokenizer, models.actor.cfg)
        self.reward_fn = (get_reward_function(cfg.reward.function, **cfg.reward.function_kwargs)
                          if cfg.reward.kind == "function" else None)
        self.settings = settings_for(
            cfg, shared_critic=cfg.model.shared_critic, mesh=place.constraint_mesh,
            score_normalizer=models.score_normalizer if cfg.reward.normalize else None,
            reward_eos_id=self.reward_eos_id(), stop_token_ids=self.stop_ids,
            pad_token_id=pad_token_id(self.tokenizer, models.actor.cfg))
        self._build_state()
        self.prompt_order = PromptSampler(len(self.prompts), cfg.train.seed, cfg.data.shuffle)
        self._build_functions()
        self.evaluator = self._build_evaluator() if eval_enabled(cfg.eval) else None
        self._eval_samples: list[dict] = []

    def _build_state(self) -> None:
        """Train states (taking over the loaded param buffers), KL controller, RNG; the frozen
        params (offloaded to host memory with `model.offload_frozen`)."""
        cfg, place, models, p = self.cfg, self.place, self.models, self.cfg.ppo
        opt_steps = cfg.train.steps * p.ppo_epochs * (p.batch_size // p.mini_batch_size)
        self.actor_tx = optimizer_from_config(cfg.optim, cfg.optim.actor_lr, opt_steps)
        self.critic_tx = optimizer_from_config(cfg.optim, cfg.optim.critic_lr, opt_steps)
        self.state = {  # the train states take over (donate) the loaded param buffers
            "actor": place.create_state(models.actor.params, self.actor_tx),
            "critic": (None if models.critic is None  # shared critic, or a critic-free estimator
                       else place.create_state(models.critic.params, self.critic_tx)),
            "kl": place.replicate(init_kl_controller(p.kl_controller, p.kl_coef, p.target_kl, p.horizon)),
            "rng": place.replicate(jax.random.PRNGKey(cfg.train.seed)),
        }
        # a LoRA model's frozen base: an input of every jitted call, never trained or saved
        self.frozen = {"actor": models.actor.frozen,
                       "critic": {} if models.critic is None else models.critic.frozen}
        models.actor.params = None
        if models.critic is not None:
            models.critic.params = None
        self.ref_params = models.reference.params
        # LoRA: the reference is the actor's base (adapters off or as loaded), the same arrays
        self.shared_base = bool(cfg.model.lora.rank) and not cfg.model.reference
        self.reward_params = models.reward.params if models.reward else None
        if cfg.model.offload_frozen:  # host memory between experience passes
            if not self.shared_base:  # the actor's base stays where the actor needs it
                self.ref_params = place.offload(self.ref_params)
            self.reward_params = place.offload(self.reward_params)

    def ppo_models(self, actor_params, critic_params=None, ref_params=None,
                   reward_params=None) -> PPOModels:
        """The run's models as one `PPOModels` value around the given params (the reward model
        only when the run has one; the critic only when given)."""
        m, frozen = self.models, self.frozen
        critic = (None if critic_params is None
                  else Model(m.critic.graphdef, join(frozen["critic"], critic_params)))
        reward = None if m.reward is None else Model(m.reward.graphdef, reward_params)
        return PPOModels(Model(m.actor.graphdef, join(frozen["actor"], actor_params)),
                         Model(m.reference.graphdef, ref_params), critic, reward)

    def _model_shardings(self) -> PPOModels:
        state = self.state
        critic = state["critic"].params if state["critic"] is not None else None
        return self.place.shardings(self.ppo_models(state["actor"].params, critic,
                                                    self.ref_params, self.reward_params))

    # ----------------------------------------------------------------------------------------
    def _build_functions(self) -> None:
        """The jitted calls of a step, with explicit layouts: params by the rules (by tree-map
        over `PPOModels` and the train states), batches by rows, the rest replicated."""
        st, place = self.settings, self.place
        rows, rep = place.rows, place.replicated
        models_sh = self._model_shardings()
        stops = self.stop_ids

        def experience(models, kl_state, rollout, scores, group_ids, baseline_scores,
                       rollout_logprobs):
            ended = ended_rows(rollout.response_ids, rollout.response_mask, stops)
            exp, kl_state, stats = make_experience(
                models, rollout, kl_state, scores, ended, settings=st.experience,
                group_ids=group_ids, baseline_scores=baseline_scores,
                rollout_logprobs=rollout_logprobs)
            tokens = {"prompt": rollout.query_mask.sum(), "response": rollout.response_mask.sum()}
            return exp, kl_state, stats, tokens

        critic = self.models.critic

        def update(actor_state, critic_state, frozen, exp, rng, settings=st.update):
            return ppo_update(actor_state, critic_state, exp, rng,
                              actor_graphdef=self.models.actor.graphdef,
                              critic_graphdef=None if critic is None else critic.graphdef,
                              actor_tx=self.actor_tx, critic_tx=self.critic_tx, settings=settings,
                              frozen=frozen)

        self._split = jax.jit(lambda key: tuple(jax.random.split(key, 3)), out_shardings=rep)
        g = self.cfg.generation
        self.rollout_layout = resolve_layout(g.rollout_layout, g.engine)
        actor = self.ppo_models(self.state["actor"].params).actor  # LoRA: base and adapters
        self._rollout_copy = rollout_copy_fn(actor.params, place.constraint_mesh,
                                             self.rollout_layout, g.param_dtype)
        actor_sh = rollout_shardings(actor, models_sh.actor, place, self.rollout_layout,
                                     self._rollout_copy is not None)
        engine = engine_settings(self.cfg)
        self._generate = make_sampler(st.sampling, engine, actor_sh, place, self.models.actor.cfg)
        self._generate_greedy = make_sampler(replace(st.sampling, greedy=True), engine, actor_sh,
                                             place, self.models.actor.cfg)
        self._rm_scores = jax.jit(
            lambda reward, rollout: rollout_scores(reward, rollout, st.experience.scoring),
            in_shardings=(models_sh.reward, Rollout(rows, rows, rows, rows)), out_shardings=rows)
        # experience making and the update compile once per (prompt, response) bucket width
        self.response_columns = ResponseColumns(self.cfg.generation.max_new_tokens,
                                                self.cfg.generation.response_buckets, rows, rep)
        self._experience = jax.jit(
            experience, in_shardings=(models_sh, rep, Rollout(rows, rows, rows, rows), rows, rows,
                                      rows, rows),
            out_shardings=(rows, rep, rep, rep))
        actor_sh, critic_sh = place.shardings(self.state["actor"]), place.shardings(self.state["critic"])
        frozen_sh = place.shardings(self.frozen)
        jit_update = partial(jax.jit, in_shardings=(actor_sh, critic_sh, frozen_sh, rows, rep),
                             out_shardings=(actor_sh, critic_sh, rep), donate_argnums=(0, 1))
        self._update = jit_update(update)
        # ppo.critic_warmup_steps: the same update with the actor left out (compiled when used)
        critic_only = replace(st.update, train_actor=False)
        self._update_critic_only = jit_update(
            lambda a, c, f, e, k: update(a, c, f, e, k, critic_only))
        if self.cfg.ppo.dynamic_sampling:
            self._build_dynamic()

    def rollout_actor(self) -> Model:
        """The actor the sampler runs: the trained params, or their rollout copy (cast to
        `generation.param_dtype`, laid out by `generation.rollout_layout`; made once per step,
        `rollout.weights`)."""
        actor = self.ppo_models(self.state["actor"].params).actor
        if self._rollout_copy is None:
            return actor
        return Model(actor.graphdef, self._rollout_copy(actor.params))

    def _build_evaluator(self) -> Evaluator:
        """The held-out evaluation (`eval.*`): its prompts tokenised like the training prompts,
        sampled with the eval settings, scored by the run's reward.

        Raises:
          FileNotFoundError / ValueError / ConfigError: a bad eval prompt file, or prompts too
            long for the context (see `build_prompts`).
        """
        cfg, e, place = self.cfg, self.cfg.eval, self.place
        new_tokens = self.settings.eval.sampling.max_new_tokens
        prompts = self._prompt_set(e.prompts, "eval.prompts", new_tokens, e.num_prompts,
                                   "eval.max_new_tokens" if e.max_new_tokens
                                   else "generation.max_new_tokens")
        batch = eval_batch(prompts, e.num_prompts,
                           eval_rows_multiple(place.batch_shards, cfg.ppo.micro_batch_size),
                           e.samples_per_prompt)
        shardings = replace(self._model_shardings(), critic=None)
        return Evaluator(batch, self.settings.eval, place, shardings, seed=e.seed,
                         reward_fn=self.reward_fn, decode=self._decode)

    def _prompt_set(self, path: str, key: str, new_tokens: int | None = None, rows: int = 0,
                    new_tokens_key: str = "generation.max_new_tokens"):
        """`setup.prompt_set` of this run (shapes only in an abstract build)."""
        return prompt_set(self.cfg, self.tokenizer, self.models.actor.cfg, path, key,
                          abstract=self.is_abstract, new_tokens=new_tokens, rows=rows,
                          new_tokens_key=new_tokens_key)

    def reward_eos_id(self) -> int | None:
        """The tokenizer's EOS id (the actor config's first, in an abstract build) when
        `reward.eos_at_end` (the reward model reads every response at an EOS), else None."""
        if not self.cfg.reward.eos_at_end:
            return None
        if self.tokenizer is None:
            return int(self.stop_ids[0]) if self.stop_ids else 0
        return int(self.tokenizer.eos_token_id)

    def evaluate(self) -> dict:
        """Evaluate the current actor on the held-out prompts (`eval.*`); keeps its first
        `eval.num_samples` decoded responses for `after_log`. Returns `eval/*` metrics and
        `time/eval` ({} when evaluation is off)."""
        if self.evaluator is None:
            return {}
        ref, reward = self.place.onload(self.ref_params), self.place.onload(self.reward_params)
        models = self.ppo_models(self.state["actor"].params, None, ref, reward)
        metrics, self._eval_samples = self.evaluator(models, self.cfg.eval.num_samples)
        del ref, reward, models
        release_host_memory()
        return metrics

    def start_metrics(self) -> dict:
        """The starting policy's evaluation, logged as step 0 (`eval.at_start`)."""
        return self.evaluate() if self.cfg.eval.at_start else {}

    def periodic_metrics(self, step: int) -> dict:
        """The evaluation every `eval.every` steps."""
        every = self.cfg.eval.every
        return self.evaluate() if every and step % every == 0 else {}

    # ----------------------------------------------------------------------------------------
    def step(self) -> dict:
        """One PPO step, in three named parts: `sample_rollout` (prompts in, responses out),
        `score_rollout` (rewards and experience) and `learn` (the update); returns its metrics
        (floats), assembled from the three parts by `ppo_parts.step_metrics`.

        Host work inside the step is limited to this process's rows: their prompt ids go in,
        and with a reward function their response tokens come out, are decoded and scored, and
        the scores go back in (`jax.make_array_from_process_local_data` with several
        processes). Everything else stays on the devices until the step's scalars are read.
        """
        t0 = time.perf_counter()
        sampled = self.dynamic_rollout() if self.cfg.ppo.dynamic_sampling else self.sample_rollout()
        scored = self.score_rollout(sampled)
        learned = self.learn(scored, sampled.update_key)
        self.state = {"actor": learned.actor, "critic": learned.critic, "kl": scored.kl_state,
                      "rng": sampled.rng}
        self.step_count += 1
        self._last_rollout = (sampled.prompts, scored.responses, sampled.rollout,
                              scored.experience.scores)
        return step_metrics(t0, sampled, scored, learned, self.prompt_order.position)

    def sample_rollout(self) -> Sampled:
        """The next batch of prompts and the actor's responses (and ReMax's greedy baseline).

        Column buckets (`trainer.stages.ppo.columns`): the prompts keep the batch's widest prompt (rounded
        up), read from the whole batch's indices that every process knows; the responses are
        cut after sampling to the batch's longest response (rounded up; a global max over the
        row-sharded mask). Both widths are logged (`prompt_width`, `response_width`).
        """
        place, batch = self.place, self.cfg.ppo.batch_size
        lo, hi = place.row_range(batch)
        n = self.cfg.generation.samples_per_prompt  # rows of one prompt are adjacent: one group
        whole = np.repeat(self.prompt_order.next_indices(batch // n), n)  # the whole batch's
        idx, width = whole[lo:hi], self.prompt_columns.width(whole)  # this process's rows
        cut = self.prompt_columns.cut
        q = place.put_rows(cut(self.prompts.ids[idx], width), (batch, width))
        qm = place.put_rows(cut(self.prompts.mask[idx], width), (batch, width))
        groups = place.put_rows((np.arange(batch, dtype=np.int32) // n)[lo:hi], (batch,))
        rng, gen_key, upd_key = self._split(self.state["rng"])
        actor = self.rollout_actor()
        resp, resp_mask, logprobs = jax.block_until_ready(self._generate(actor, q, qm, gen_key))
        prompts, rows = [self.prompts.texts[i] for i in idx], self._rows_of(idx)
        baseline = self._greedy_baseline(actor, q, qm, gen_key, prompts, rows)
        resp, resp_mask, resp_width = self.response_columns(resp, resp_mask)
        return Sampled(prompts, Rollout(q, qm, resp, resp_mask), groups, baseline, upd_key, rng,
                       int(width), int(resp_width), time.perf_counter(), rows,
                       rollout_logprobs=self.response_columns.cut(logprobs, resp_width),
                       engine_stats=engine_metrics(self._generate))

    def score_rollout(self, sampled: Sampled) -> Scored:
        """The reward (the reward function on this process's decoded rows, or the reward model
        inside the experience pass) and the experience: log-probs, reference log-probs,
        values, rewards, advantages, returns; the KL controller updated."""
        responses, scores, parts = None, sampled.scores, sampled.reward_stats or {}
        r = sampled.rollout
        if self.reward_fn is not None and scores is None:
            responses, scores, parts = self._text_scores(sampled.prompts, r.response_ids,
                                                         r.response_mask, sampled.rows)
        release_host_memory()  # the freed buffers of a phase are not reusable by the next one
        ref, reward = self.place.onload(self.ref_params), self.place.onload(self.reward_params)
        critic = self.state["critic"]
        models = self.ppo_models(self.state["actor"].params,
                                 None if critic is None else critic.params, ref, reward)
        exp, kl_state, stats, tokens = self._experience(
            models, self.state["kl"], r, scores, sampled.group_ids, sampled.baseline_scores,
            sampled.rollout_logprobs)
        del ref, reward, models  # offloaded frozen params: the device copy lives for this pass
        stats = {**jax.device_get(stats), **parts}  # replicated scalars: readable everywhere
        release_host_memory()
        return Scored(exp, kl_state, stats, tokens, responses, time.perf_counter())

    def learn(self, scored: Scored, key) -> Learned:
        """The PPO update on the experience (critic only during `ppo.critic_warmup_steps`)."""
        warmup = self.step_count < self.cfg.ppo.critic_warmup_steps
        update = self._update_critic_only if warmup else self._update
        actor, critic, stats = update(self.state["actor"], self.state["critic"], self.frozen,
                                      scored.experience, key)
        return Learned(actor, critic, jax.device_get(stats), warmup, time.perf_counter())

    # ----------------------------------------------------------------------------------------
    def export_actor(self, out_dir: Path | None = None) -> Path:
        """Save the current actor as an HF directory (loadable by transformers; a LoRA actor
        with its adapters merged into the weights, and its adapters alone in PEFT's format in
        `actor_adapter/` beside it); collective."""
        out_dir = Path(out_dir or self.out / "actor_hf")
        actor = self.models.actor
        params = join(self.frozen["actor"], self.state["actor"].params)
        if actor.cfg.lora_rank:
            self.write_adapter(self.state["actor"].params, actor.cfg,
                               out_dir.parent / "actor_adapter", "causal_lm",
                               self.models.actor_path)
        return self.write_hf(actor.graphdef, params, actor.cfg, out_dir)

    def export(self) -> Path:
        return self.export_actor()

    def after_log(self, step: int) -> None:
        """Decoded samples every `train.sample_every` steps (and at step 1); the eval samples
        of an evaluation at this step (marked `"eval": true`)."""
        cfg = self.cfg.train
        eval_samples, self._eval_samples = self._eval_samples, []
        if not self.writer.enabled:
            return
        if step > 0 and cfg.sample_every and (step % cfg.sample_every == 0 or step == 1):
            self.writer.write_samples(step, self.last_samples[:cfg.num_samples])
        if eval_samples:
            self.writer.write_samples(step, eval_samples, tag="eval/samples")

    def progress_postfix(self, metrics: dict) -> dict:
        return {"reward": f"{metrics['score_mean']:.3f}", "kl": f"{metrics['kl']:.3f}",
                "s_per_step": f"{metrics['time/step']:.1f}"}
