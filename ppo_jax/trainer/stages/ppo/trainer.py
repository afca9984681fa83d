"""Stage 3, PPO, on the shared loop of `trainer.loop`.

`step()` reads top to bottom: sample, score, learn. `sample_rollout` samples; DAPO's rounds
are in `dynamic_rollout` and multi-turn episodes in `episode_rollout`. `score_rollout` computes
the reward, then runs one jitted experience pass. `learn` runs every PPO epoch and minibatch in
one jitted call. With `ppo.max_staleness` > 0 `async_step` runs instead: the same parts on a
batch the rollout group streamed ahead (`async_rollout`, docs/async_rl.md), the update
overlapping the next batch's generation. Each part returns a named value of `step_data`. What
is built once, before the first step, lives in `build`; the jitted programs the step calls live
in `step_programs`, and `--compile-for` compiles the same objects.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from pathlib import Path
from typing import Optional

import jax

from ppo_jax.core import get_policy_loss
from ppo_jax.models.functional import Model
from ppo_jax.trainer.stages.ppo.experience import PPOModels, RolloutBatch
from ppo_jax.rollout.forward import Rollout, aux_loss_weight
from ppo_jax.rollout.sampler import engine_metrics
from ppo_jax.rollout.weights import resolve_layout
from ppo_jax.trainer.config import eval_enabled
from ppo_jax.trainer.data.order import DataOrder
from ppo_jax.trainer.host.memory import release_host_memory
from ppo_jax.trainer.loading.models import (
    abstract_models, build_models, pad_token_id, prompt_set, stop_token_ids,
)
from ppo_jax.trainer.loop import StageTrainer
from ppo_jax.trainer.stages.ppo import (
    build, dynamic, episodes, load_checks, rewards, step_data, step_programs,
)
from ppo_jax.trainer.stages.ppo.async_rollout import AsyncRollout, staleness_figures
from ppo_jax.trainer.stages.ppo.packing import Packer
from ppo_jax.trainer.stages.ppo.step_data import (
    LastRollout, Learned, PromptBatch, PromptColumns, ResponseColumns, Sampled, Scored,
)
from ppo_jax.trainer.stages.ppo.rollout_group import RolloutWeights, Synced
from ppo_jax.trainer.stages.ppo.settings import settings_for
from ppo_jax.trainer.placement import Placement
from ppo_jax.trainer.split import split_placement
from ppo_jax.trainer.state import full_params


class PPOTrainer(StageTrainer):
    """Owns the models, states and jitted steps of one PPO run.

    `PPOTrainer(cfg, resume=False, devices=None)` loads everything (raising ConfigError /
    FileNotFoundError / ValueError before any compile); `train()` runs the remaining steps;
    `step()` runs one.

    Every array lives on the device mesh of `cfg.mesh` over `devices`, by default all devices
    of all processes. Params and optimiser states are sharded by the named rules of
    `ppo_jax.parallel.rules`, batches are split over the "data" and "fsdp" axes, and the KL
    controller and RNG are replicated. Each process feeds and reads only its own rows of every
    batch. With `generation.placement: split` the sampler and the rollout copy of the actor
    live on a rollout group of `generation.rollout_devices` of those devices instead, with its
    own mesh (`trainer.split`, `rollout_group`); `cfg.mesh` lays out the others.

    Attributes (besides `StageTrainer`'s), all set in `_build`:
      models, tokenizer: the loaded `loading.models.Models`, whose trained params move into
        `state`, and the tokenizer, None in an abstract build.
      stop_ids: the tokens ending a response.
      reward_fn: the reward function, each call limited to `reward.timeout_s`; None when a
        reward model scores.
      prompts, prompt_columns, prompt_order: the prompt set, its buckets, its resumable order.
      settings: `PPOSettings`, the static settings of the jitted calls.
      actor_tx, critic_tx, state, frozen, ref_params, reward_params, shared_base: as
        `build.PPOParams` says; `state` is `{"actor", "critic", "kl", "rng"}`.
      rollout_layout: the resolved `generation.rollout_layout`.
      rollout_place: the rollout group's `Placement` (split), else `place` itself.
      rollout_weights: the split placement's `rollout_group.RolloutWeights`, else None.
      response_columns: the response buckets.
      jit: the step's jitted programs, a `step_programs.StepPrograms`.
      evaluator: the `Evaluator` of `eval.*`, an `episodes.EpisodeEvaluator` with `env.name`,
        or None.
      episodes: the `episodes.EpisodeRunner` of `env.*`, or None.
      driver: the `async_rollout.AsyncRollout` of `ppo.max_staleness` > 0, started by the
        first step (of a run or a resumed run); None before, and with staleness 0.
      _eval_samples: the evaluator's last decoded samples, until `after_log` writes them.
      _last_rollout: the last step's `step_data.LastRollout`, None before the first.
    """

    name = "ppo"
    finite_keys = ("kl",)

    def _make_placement(self, devices, abstract: bool) -> Placement:
        """The trainer's placement; with `generation.placement: split` the devices are divided
        first (`trainer.split`) and the rollout group's placement is kept as `rollout_place`."""
        g = self.cfg.generation
        if g.placement != "split":
            self.rollout_place = super()._make_placement(devices, abstract)
            return self.rollout_place
        place, self.rollout_place = split_placement(self.cfg.mesh, g.rollout_devices, devices,
                                                    abstract)
        return place

    @property
    def split(self) -> bool:
        """Whether the sampler runs on its own rollout group (`generation.placement: split`)."""
        return self.rollout_place is not self.place

    def _check_config(self) -> None:
        load_checks.check_names(self.cfg)

    def _check_inputs(self) -> None:
        load_checks.check_names(self.cfg)
        load_checks.check_prompt_files(self.cfg)  # fails before loading

    def _build(self) -> None:
        cfg, place = self.cfg, self.place
        rollout = self.rollout_place
        load_checks.check_placement(cfg, place, rollout if self.split else None)
        load = abstract_models if self.is_abstract else build_models
        models = load(cfg, sharding_fn=place.sharding_fn)
        load_checks.check_kernel(cfg, models.actor.cfg, rollout.mesh)
        load_checks.check_router_replay(cfg, models.actor.cfg)
        self.models, self.tokenizer = models, models.tokenizer
        self.prompts = prompt_set(cfg, self.tokenizer, models.actor.cfg, cfg.data.prompts,
                                  "data.prompts", abstract=self.is_abstract)
        self.prompt_columns = PromptColumns(self.prompts.mask, cfg.data.prompt_buckets)
        self.stop_ids = stop_token_ids(cfg, self.tokenizer, models.actor.cfg)
        self.reward_fn = load_checks.reward_function(cfg) if cfg.reward.kind == "function" else None
        self.settings = settings_for(
            cfg, shared_critic=cfg.model.shared_critic, mesh=place.constraint_mesh,
            rollout_mesh=rollout.mesh if self.split else None,
            score_normalizer=models.score_normalizer if cfg.reward.normalize else None,
            reward_eos_id=rewards.reward_eos_id(cfg.reward.eos_at_end, self.tokenizer,
                                                self.stop_ids),
            stop_token_ids=self.stop_ids,
            pad_token_id=pad_token_id(self.tokenizer, models.actor.cfg),
            router_aux_loss_coef=aux_loss_weight(models.actor.cfg,
                                                 cfg.model.router_aux_loss_coef))
        self.episodes = (episodes.EpisodeRunner(cfg.env, self.settings.sampling, self.tokenizer)
                         if cfg.env.name and not self.is_abstract else None)
        params = build.build_params(cfg, place, models)  # takes over the loaded param buffers
        self.actor_tx, self.critic_tx, self.state = params.actor_tx, params.critic_tx, params.state
        self.frozen, self.shared_base = params.frozen, params.shared_base
        self.ref_params, self.reward_params = params.ref_params, params.reward_params
        self.prompt_order = DataOrder(len(self.prompts), cfg.train.seed, cfg.data.shuffle)
        self.rollout_layout = ("tensor" if self.split else
                               resolve_layout(cfg.generation.rollout_layout, cfg.generation.engine))
        self.rollout_weights = self._rollout_weights() if self.split else None
        self.response_columns = ResponseColumns(cfg.generation.max_new_tokens,
                                                cfg.generation.response_buckets, place.by_row,
                                                place.replicated)
        self.jit = self._build_programs()
        self.evaluator = (build.build_evaluator(
            cfg, place, self.tokenizer, models.actor.cfg, self.settings.eval,
            self._model_shardings(), abstract=self.is_abstract, reward_fn=self.reward_fn,
            decode=self.decode, sampler=self.jit.sampler, rollout_shards=rollout.batch_shards)
            if eval_enabled(cfg.eval) else None)
        if self.episodes is not None and self.evaluator is not None:  # eval prompts as episodes
            self.evaluator = episodes.EpisodeEvaluator.of(
                cfg, self.evaluator, self.settings.eval.sampling, self.tokenizer,
                self.jit.sampler, pool=self.episodes.pool)
        self._eval_samples: list[dict] = []
        self._last_rollout: Optional[LastRollout] = None
        self.driver: Optional[AsyncRollout] = None
        self.packer = (None if not cfg.ppo.packing else Packer(
            self.place, micro_batch_size=cfg.ppo.micro_batch_size,
            mini_batch_size=cfg.ppo.mini_batch_size, ppo_epochs=cfg.ppo.ppo_epochs,
            micro_batch_tokens=cfg.ppo.micro_batch_tokens, keep_micro_batches=getattr(
                get_policy_loss(cfg.ppo.policy_loss), "per_micro_batch", False)))

    def ppo_models(self, actor_params, critic_params=None, ref_params=None,
                   reward_params=None) -> PPOModels:
        """The run's models as one `PPOModels` value around the given params (`build.join_models`:
        the reward model only when the run has one; the critic only when given)."""
        return build.join_models(self.models, self.frozen, actor_params, critic_params,
                                 ref_params, reward_params)

    def _model_shardings(self) -> PPOModels:
        state = self.state
        critic = state["critic"].params if state["critic"] is not None else None
        return self.place.shardings(self.ppo_models(state["actor"].params, critic,
                                                    self.ref_params, self.reward_params))

    def _build_programs(self) -> step_programs.StepPrograms:
        """The step's jitted programs for this run."""
        return step_programs.build_programs(
            self.cfg, self.settings, self.place, self.models,
            actor=self.ppo_models(self.state["actor"].params).actor,  # LoRA: base and adapters
            models_sh=self._model_shardings(), state=self.state, frozen=self.frozen,
            stop_ids=self.stop_ids, rollout_layout=self.rollout_layout, actor_tx=self.actor_tx,
            critic_tx=self.critic_tx, rollout_place=self.rollout_place if self.split else None)

    def _rollout_weights(self) -> RolloutWeights:
        """The split placement's copy of the actor on the rollout group (placed abstractly in
        an abstract build; synced before the first sampling otherwise)."""
        trained, frozen = self.state["actor"].params, self.frozen["actor"]
        weights = RolloutWeights(self.models.actor.graphdef, trained, frozen, trainer=self.place,
                                 rollout=self.rollout_place,
                                 param_dtype=self.cfg.generation.param_dtype)
        if self.is_abstract:
            weights.place_abstract(trained, frozen)
        return weights

    def sync_weights(self) -> Synced:
        """Send the current actor to the rollout group (`RolloutWeights.sync`, split placement):
        after every update, and before the first sampling of a run or a resumed run."""
        return self.rollout_weights.sync(self.state["actor"].params, self.frozen["actor"],
                                         version=self.step_count)

    def rollout_actor(self) -> Model:
        """The actor the sampler runs. Colocated: the trained params, or their rollout copy,
        made once per step, cast to `generation.param_dtype` and laid out by
        `generation.rollout_layout`. Split: the copy on the rollout group, synced first when it
        does not hold this step's weights (the first step; after a resume)."""
        if self.split:
            weights = self.rollout_weights
            if not self.is_abstract and weights.version != self.step_count:
                self.sync_weights()
            return weights.actor
        actor = self.ppo_models(self.state["actor"].params).actor
        if self.jit.rollout_copy is None:
            return actor
        return Model(actor.graphdef, self.jit.rollout_copy(actor.params))

    def evaluate(self) -> dict:
        """Evaluate the current actor on the held-out prompts (`eval.*`); keeps its first
        `eval.num_samples` decoded responses for `after_log`. Returns `eval/*` metrics and
        `time/eval` ({} when evaluation is off)."""
        if self.evaluator is None:
            return {}
        ref, reward = self.place.onload(self.ref_params), self.place.onload(self.reward_params)
        models = self.ppo_models(self.state["actor"].params, None, ref, reward)
        sampling = self.rollout_actor() if self.split else None  # the rollout group's copy
        with self._reward_faults(f"the evaluation at step {self.step_count}"):
            metrics, self._eval_samples = self.evaluator(models, self.cfg.eval.num_samples,
                                                         sampling_actor=sampling)
        del ref, reward, models
        release_host_memory()
        return metrics

    def start_metrics(self) -> dict:
        """The starting policy's evaluation, logged as step 0 (`eval.at_start`)."""
        return self.evaluate() if self.cfg.eval.at_start else {}

    def periodic_metrics(self, step: int) -> dict:
        """The evaluation every `eval.every` steps and at the last step (`train.steps`, or the
        one that spent `train.max_minutes`)."""
        every = self.cfg.eval.every
        due = every and (step % every == 0 or self.is_last_step(step))
        return self.evaluate() if due else {}

    # ----------------------------------------------------------------------------------------
    def step(self) -> dict:
        """One PPO step, in three named parts: `sample_rollout` (prompts in, responses out;
        `dynamic_rollout` with `ppo.dynamic_sampling`), `score_rollout` (rewards and
        experience) and `learn` (the update); returns its metrics (floats), assembled from the
        three parts by `step_data.step_metrics`.

        Host work inside the step is limited to this process's rows: their prompt ids go in,
        and with a reward function their response tokens come out, are decoded and scored, and
        the scores go back in (`jax.make_array_from_process_local_data` with several
        processes). Everything else stays on the devices until the step's scalars are read.
        """
        if self.cfg.ppo.max_staleness:
            return self.async_step()
        t0 = time.perf_counter()
        sampled = (self.episode_rollout() if self.episodes is not None
                   else self.dynamic_rollout() if self.cfg.ppo.dynamic_sampling
                   else self.sample_rollout())
        scored = self.score_rollout(sampled)
        learned = self.learn(scored, sampled.update_key)
        self.state = {"actor": learned.actor, "critic": learned.critic, "kl": scored.kl_state,
                      "rng": sampled.rng}
        self.step_count += 1
        synced = self.sync_weights() if self.split else None  # staleness 0: every update
        self._last_rollout = LastRollout(prompts=sampled.prompts, responses=scored.responses,
                                         rollout=sampled.rollout,
                                         scores=scored.experience.scores)
        return step_data.step_metrics(t0, sampled, scored, learned, self.prompt_order.position,
                                      synced)

    def sample_rollout(self) -> Sampled:
        """The next batch of prompts and the actor's responses (and ReMax's greedy baseline).

        Column buckets (`stages.ppo.step_data`): the prompts keep the batch's widest prompt
        (rounded up, `step_data.next_prompts`); the responses are cut after sampling to the batch's
        longest response (rounded up; a global max over the row-sharded mask). Both widths are
        logged (`prompt_width`, `response_width`).
        """
        batch = self.next_prompts(bucketed=True)
        rng, gen_key, update_key = self.jit.split_keys(self.state["rng"])
        actor = self.rollout_actor()
        out = jax.block_until_ready(
            self.jit.sampler(actor, batch.ids, batch.mask, gen_key, self.settings.sampling))
        engine_stats = engine_metrics(self.jit.sampler.last_stats)
        baseline = self.greedy_baseline(actor, batch.ids, batch.mask, gen_key, batch.texts,
                                        batch.rows)
        resp, resp_mask, resp_width = self.response_columns(out.response_ids, out.response_mask)
        n = self.cfg.generation.samples_per_prompt  # rows of one prompt are adjacent: one group
        cut = self.response_columns.cut
        routes = None if out.routes is None else cut(out.routes, resp_width)
        return Sampled(
            prompts=batch.texts, rollout=Rollout(batch.ids, batch.mask, resp, resp_mask, routes),
            group_ids=step_data.group_ids(self.place, self.cfg.ppo.batch_size, n),
            baseline_scores=baseline, update_key=update_key, rng=rng,
            prompt_width=batch.width, response_width=int(resp_width), end=time.perf_counter(),
            rows=batch.rows, rollout_logprobs=cut(out.logprobs, resp_width),
            engine_stats=engine_stats)

    def episode_rollout(self) -> Sampled:
        """Multi-turn episodes with the run's environment (`env.*`, `stages.ppo.episodes`):
        the responses hold the actor's turns and the observations between them
        (`action_mask` 1 on the drawn tokens), scored by the environment's rewards."""
        batch = self.next_prompts(bucketed=True)
        rng, gen_key, update_key = self.jit.split_keys(self.state["rng"])
        return episodes.sampled_episodes(
            self.episodes, self.jit.sampler, self.rollout_actor(), batch, gen_key, update_key, rng,
            columns=self.response_columns, place=self.place, batch_size=self.cfg.ppo.batch_size,
            n=self.cfg.generation.samples_per_prompt, step=self.step_count + 1,
            last_checkpoint=self.checkpointer.latest_step)

    def dynamic_rollout(self) -> Sampled:
        """DAPO's dynamic sampling (`stages.ppo.dynamic`): rounds of full-width prompts
        sampled and scored until the batch can be filled with informative groups; the
        `Sampled` batch of those, its scores and reward means attached."""
        p, jit, n = self.cfg.ppo, self.jit, self.cfg.generation.samples_per_prompt
        rng, key, update_key = jit.split_keys(self.state["rng"])
        actor = self.rollout_actor()

        def draw(key) -> dynamic.DrawnRound:
            return dynamic.draw_round(self.next_prompts(bucketed=False), actor, key,
                                      sample=partial(jit.sampler,
                                                     settings=self.settings.sampling),
                                      score=self.score_texts,
                                      informative=jit.informative)

        drawn, rng = dynamic.draw_rounds(draw, rng, key, split_keys=jit.split_keys,
                                         groups=p.batch_size // n, max_rounds=p.max_sampling_rounds)
        return dynamic.informative_rollout(
            drawn, rng, update_key, select=jit.select, response_columns=self.response_columns,
            prompts=self.prompts, place=self.place, n=n, prompt_width=self.prompt_columns.full)

    # --- the asynchronous step (ppo.max_staleness > 0, docs/async_rl.md) ---------------------
    def async_step(self) -> dict:
        """One step of asynchronous RL (`async_rollout`): take the next finished batch the
        rollout group streamed (waiting for it if need be), score it, refuse its too-stale
        samples, and dispatch the update; while the trainer's devices run it, the stream runs
        until the next step's batch is finished; then the new weights go to the rollout group
        and the next batch is submitted. Metrics: the synchronous step's, plus the staleness
        figures (`async_rollout.staleness_figures`), the stream's (`rollout/*`) and
        `time/rollout_wait`, the seconds spent waiting for the batch."""
        t0 = time.perf_counter()
        sampled, taken, figures = self.stream_rollout()
        scored = self.score_rollout(sampled, read_stats=False)
        if figures["rollout/refused"]:
            scored.experience = scored.experience.replace(action_mask=self.driver.refuse(
                scored.experience.action_mask, taken.staleness))
        learned = self.learn(scored, sampled.update_key, meanwhile=self.driver.pump)
        scored = dataclasses.replace(scored, stats=jax.device_get(scored.stats))
        self.state = {"actor": learned.actor, "critic": learned.critic, "kl": scored.kl_state,
                      "rng": sampled.rng}
        self.step_count += 1
        synced = self.sync_weights()
        self.driver.set_params(self.rollout_weights.actor.params, self.step_count)
        self.driver.fill()
        self._last_rollout = LastRollout(prompts=sampled.prompts, responses=scored.responses,
                                         rollout=sampled.rollout,
                                         scores=scored.experience.scores)
        metrics = step_data.step_metrics(t0, sampled, scored, learned, self.prompt_order.position,
                                         synced)
        return {**metrics, **figures, "time/rollout_wait": taken.wait_s}

    def stream_rollout(self):
        """`(Sampled, Taken, figures)`: the next batch from the stream on the trainer's rows,
        cut to its response bucket; the prompt order and the run's key as of this batch (what a
        checkpoint after this step holds); its staleness figures
        (`async_rollout.staleness_figures`), the stream's figures among them. The `Taken`
        carries `staleness`, `[B]` on the trainer's rows."""
        if self.driver is None:
            self.driver = self._start_driver()
        taken = self.driver.take(self.step_count + 1)
        sub, gen = taken.submitted, self.jit.sampler.to_trainer(taken.batch.generation)
        self.prompt_order.position = sub.position
        resp, resp_mask, width = self.response_columns(gen.response_ids, gen.response_mask)
        staleness, figures = staleness_figures(taken.batch.versions, width, self.step_count,
                                               self.cfg.ppo.max_staleness)
        lo, hi = self.place.row_range(self.cfg.ppo.batch_size)
        taken = dataclasses.replace(taken, staleness=self.place.put_rows(
            staleness[lo:hi], staleness.shape))
        p, n = sub.prompts, self.cfg.generation.samples_per_prompt
        cut = self.response_columns.cut
        routes = None if gen.routes is None else cut(gen.routes, width)
        sampled = Sampled(
            prompts=p.texts, rollout=Rollout(p.ids, p.mask, resp, resp_mask, routes),
            group_ids=step_data.group_ids(self.place, self.cfg.ppo.batch_size, n),
            baseline_scores=None, update_key=sub.update_key, rng=sub.rng,
            prompt_width=p.width, response_width=int(width), end=time.perf_counter(),
            rows=p.rows, rollout_logprobs=cut(gen.logprobs, width),
            engine_stats=self.driver.stream_metrics())
        return sampled, taken, figures

    def _start_driver(self) -> AsyncRollout:
        """The stream on the rollout group, holding the current weights (synced first), and
        its first s + 1 batches submitted from the prompt order's position and the run's key
        (a resumed run's: the checkpoint's)."""
        cfg, g = self.cfg, self.cfg.generation
        actor = self.rollout_actor()
        width = self.prompt_columns.full  # the engine's one prompt width: no prompt buckets
        engine = self.jit.sampler.sampler.paged(actor.graphdef, self.settings.sampling,
                                                cfg.ppo.batch_size, width)
        stream = engine.stream(actor.params, self.step_count,
                               max_batches_in_flight=cfg.ppo.max_staleness + 1,
                               partial_rollouts=g.partial_rollouts, kv_on_switch=g.kv_on_switch)
        order = DataOrder(len(self.prompts), cfg.train.seed, cfg.data.shuffle,
                          position=self.prompt_order.position)
        driver = AsyncRollout(
            stream, order=order, rng=self.state["rng"], next_step=self.step_count + 1,
            last_step=cfg.train.steps, max_staleness=cfg.ppo.max_staleness,
            draw=lambda o: self.next_prompts(bucketed=False, order=o),
            split_keys=self.jit.split_keys, to_rollout=self.jit.sampler.to_rollout,
            by_row=self.place.by_row)
        driver.fill()
        return driver

    def score_rollout(self, sampled: Sampled, read_stats: bool = True) -> Scored:
        """The reward (the reward function on this process's decoded rows, or the reward model
        inside the experience pass) and the experience: log-probs, reference log-probs,
        values, rewards, advantages, returns; the KL controller updated. `read_stats=False`
        leaves the stats on the devices, so the pass may still be running when this returns
        (the asynchronous step reads them after the update)."""
        responses, scores, reward_stats = None, sampled.scores, sampled.reward_stats or {}
        r = sampled.rollout
        if self.reward_fn is not None and scores is None:
            text = self.score_texts(sampled.prompts, r.response_ids, r.response_mask, sampled.rows)
            responses, scores, reward_stats = text.responses, text.scores, text.components
        release_host_memory()  # the freed buffers of a phase are not reusable by the next one
        ref, reward = self.place.onload(self.ref_params), self.place.onload(self.reward_params)
        critic = self.state["critic"]
        models = self.ppo_models(self.state["actor"].params,
                                 None if critic is None else critic.params, ref, reward)
        plan, packed = (None, {}) if self.packer is None else self.packer.experience(
            r, self.packer.lengths(r))
        batch = RolloutBatch(r, sampled.group_ids, scores, sampled.baseline_scores,
                             sampled.rollout_logprobs, sampled.action_mask, sampled.ended, plan)
        out = self.jit.experience(models, self.state["kl"], batch)
        del ref, reward, models  # offloaded frozen params: the device copy lives for this pass
        stats = {**(jax.device_get(out.stats) if read_stats else out.stats),
                 **reward_stats, **packed}  # replicated: readable everywhere
        release_host_memory()
        return Scored(experience=out.experience, kl_state=out.kl_state, stats=stats,
                      tokens=out.tokens, responses=responses, end=time.perf_counter())

    def learn(self, scored: Scored, key, meanwhile=None) -> Learned:
        """The PPO update on the experience (critic only during `ppo.critic_warmup_steps`);
        `meanwhile()`, when given, runs on the host after the update is dispatched and before
        its stats are read (the asynchronous step's rollout rounds)."""
        warmup = self.step_count < self.cfg.ppo.critic_warmup_steps
        update = self.jit.update_critic_only if warmup else self.jit.update
        e = scored.experience
        plan, packed = None, {}
        if self.packer is not None:
            r = Rollout(e.query_ids, e.query_mask, e.response_ids, e.response_mask)
            plan, packed = self.packer.update(r, self.packer.lengths(r), key)
        actor, critic, stats = update(self.state["actor"], self.state["critic"], self.frozen, e,
                                      key, plan)
        if meanwhile is not None:
            meanwhile()
        return Learned(actor=actor, critic=critic, stats={**jax.device_get(stats), **packed},
                       critic_warmup=warmup, end=time.perf_counter())

    # --- the step's host-side helpers -------------------------------------------------------
    def next_prompts(self, bucketed: bool, order: Optional[DataOrder] = None) -> PromptBatch:
        """`step_data.next_prompts` of this run's prompts and batch, from `order` (default the
        run's prompt order; advances it)."""
        order = self.prompt_order if order is None else order
        return step_data.next_prompts(self.prompts, order, self.prompt_columns,
                                  self.place, batch=self.cfg.ppo.batch_size,
                                  n=self.cfg.generation.samples_per_prompt, bucketed=bucketed)

    def greedy_baseline(self, actor: Model, prompt_ids, prompt_mask, key, prompts: list[str],
                        rows: Optional[list[dict]] = None):
        """ReMax: the `[B]` scores of the greedy responses to the prompts `[B, P]` (by the
        reward function, or the reward model), or None when the estimator needs none."""
        if self.settings.greedy_baseline is None:
            return None
        out = self.jit.sampler(actor, prompt_ids, prompt_mask, key, self.settings.greedy_baseline)
        resp, mask = out.response_ids, out.response_mask
        if self.reward_fn is None:
            reward = Model(self.models.reward.graphdef, self.place.onload(self.reward_params))
            return self.jit.reward_model_scores(reward,
                                                Rollout(prompt_ids, prompt_mask, resp, mask))
        return self.score_texts(prompts, resp, mask, rows).scores

    def decode(self, ids, mask) -> list[str]:
        """`rewards.decode_responses` with this run's tokenizer and `data.response_prefix`."""
        return rewards.decode_responses(self.tokenizer, self.cfg.data.response_prefix or "",
                                        ids, mask)

    def score_texts(self, prompts: list[str], ids, mask, rows=None) -> rewards.TextScores:
        """`rewards.text_scores` by this run's reward function, in the step under way.

        Raises:
          UserCodeError: the reward function failed, naming it and the step (`faults`).
        """
        with self._reward_faults(f"step {self.step_count + 1}"):
            return rewards.text_scores(self.reward_fn, self.decode, self.place, prompts, ids,
                                            mask, rows)

    def _reward_faults(self, when: str):
        """`rewards.reward_faults` of this run's reward function at `when`."""
        return rewards.reward_faults(self.cfg.reward.function, when,
                                    getattr(self, "checkpointer", None))

    @property
    def finite_hint(self) -> str:
        """The loop's advice on a non-finite step, a fork's formulas named first (`faults`)."""
        return rewards.finite_hint(self.cfg, StageTrainer.finite_hint)

    @property
    def last_samples(self) -> list[dict]:
        """This process's rows of the last step (`rewards.sample_records`)."""
        return rewards.sample_records(self._last_rollout, self.decode)

    def programs(self) -> list:
        """The step's jitted programs with abstract arguments (`step_programs.step_programs`)."""
        place, state = self.place, self.state
        critic = state["critic"]
        models = self.ppo_models(state["actor"].params, None if critic is None else critic.params,
                                 place.onload(self.ref_params), place.onload(self.reward_params))
        return step_programs.step_programs(
            self.jit, models, state, self.frozen, cfg=self.cfg, settings=self.settings,
            place=place,
            prompt_width=self.prompt_columns.full, scored_on_host=self.reward_fn is not None,
            model_shardings=self._model_shardings(), rollout_layout=self.rollout_layout,
            evaluator=self.evaluator, weights=self.rollout_weights, packer=self.packer)

    def resident(self) -> dict:
        """What stays in device memory between a step's programs (`step_programs.resident`;
        split: the rollout group's copy of the actor too)."""
        out = step_programs.resident(self.state, self.frozen, self.ref_params, self.reward_params,
                                     shared_base=self.shared_base, evaluator=self.evaluator)
        if self.split:
            out["rollout_weights"] = self.rollout_weights.params
        return out

    def transfers(self) -> list[dict]:
        """The step's transfers between device groups (`RolloutWeights.transfers`; none
        colocated), for `--compile-for`'s estimate."""
        return self.rollout_weights.transfers() if self.split else []

    # ----------------------------------------------------------------------------------------
    def export_actor(self, out_dir: Path | None = None) -> Path:
        """Save the current actor as an HF directory (loadable by transformers; a LoRA actor
        with its adapters merged into the weights, and its adapters alone in PEFT's format in
        `actor_adapter/` beside it); collective."""
        out_dir = Path(out_dir or self.out / "actor_hf")
        actor = self.models.actor
        params = full_params(self.frozen["actor"], self.state["actor"].params)
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
