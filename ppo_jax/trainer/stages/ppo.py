"""Stage 3, PPO: rollout -> experience -> update, on the shared loop of `trainer.base`.

Each step: take the next batch of prompts (left-padded to the batch's own widest prompt, rounded
up to a bucket: `trainer.columns`); the actor samples responses (one jitted call), cut to the
batch's longest response (rounded up to a bucket); the reward function scores the decoded text
(or the reward model scores the tokens); one jitted call computes log-probs, reference
log-probs, values, rewards, advantages and returns; one jitted call runs every PPO epoch and
minibatch. The jitted functions receive every array as an argument; graph definitions,
optimisers and settings are static. With `eval.*`, the actor is evaluated on held-out prompts
at step 0 and every `eval.every` steps (`trainer.evaluation`).
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.core import get_advantage_estimator, init_kl_controller, needs_greedy_baseline
from ppo_jax.parallel.host import local_rows
from ppo_jax.rollout.experience import make_experience
from ppo_jax.rollout.sampler import generate
from ppo_jax.rollout.scoring import init_value_head, map_in_chunks, reward_model_scores
from ppo_jax.trainer.base import StageTrainer
from ppo_jax.trainer.columns import PromptColumns, ResponseColumns
from ppo_jax.trainer.config import ConfigError, eval_enabled
from ppo_jax.trainer.data import PromptSampler, read_prompts
from ppo_jax.trainer.evaluation import EvalSettings, Evaluator, eval_batch, eval_rows_multiple
from ppo_jax.trainer.host_memory import release_host_memory
from ppo_jax.trainer.optim import optimizer_from_config
from ppo_jax.trainer.reward_functions import get_reward_function
from ppo_jax.trainer.setup import (
    abstract_models, abstract_prompts, build_models, build_prompts, pad_token_id, stop_token_ids,
)
from ppo_jax.trainer.stages.ppo_checks import check_names, experience_settings, update_settings
from ppo_jax.trainer.stages.ppo_programs import PPOPrograms
from ppo_jax.trainer.update import ppo_update


def _mean_stats(stats: dict) -> dict:
    """Means over epochs x minibatches; the first minibatch's ratio and approxkl (the PPO
    invariant: 1 and 0) when the policy loss reports them."""
    out = {k: float(np.mean(np.asarray(v))) for k, v in stats.items()}
    for key in ("ratio", "approxkl"):
        if key in stats:
            out[f"{key}_first_minibatch"] = float(np.asarray(stats[key])[0, 0])
    return out


class PPOTrainer(PPOPrograms, StageTrainer):
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
        read_prompts(self.cfg.data.prompts, self.cfg.data.prompt_field)  # fails before loading
        if eval_enabled(self.cfg.eval):
            read_prompts(self.cfg.eval.prompts, self.cfg.data.prompt_field, "eval.prompts")

    def _build(self) -> None:
        cfg, place = self.cfg, self.place
        if cfg.ppo.batch_size % place.batch_shards:
            raise ConfigError(f"ppo.batch_size={cfg.ppo.batch_size} is not a multiple of mesh "
                              f"data x fsdp = {place.batch_shards}")
        build = abstract_models if self.is_abstract else build_models
        models = build(cfg, sharding_fn=place.sharding_fn)
        self.models, self.tokenizer = models, models.tokenizer
        self.prompts = self._prompt_set(cfg.data.prompts, "data.prompts")
        self.prompt_columns = PromptColumns(self.prompts.mask, cfg.data.prompt_buckets)
        self.stop_ids = stop_token_ids(cfg, self.tokenizer, models.actor.cfg)
        self.pad_id = pad_token_id(self.tokenizer, models.actor.cfg)
        self.reward_fn = get_reward_function(cfg.reward.function) if cfg.reward.kind == "function" else None

        p = cfg.ppo
        opt_steps = cfg.train.steps * p.ppo_epochs * (p.batch_size // p.mini_batch_size)
        self.actor_tx = optimizer_from_config(cfg.optim, cfg.optim.actor_lr, opt_steps)
        self.critic_tx = optimizer_from_config(cfg.optim, cfg.optim.critic_lr, opt_steps)
        self.shared_critic = cfg.model.shared_critic
        actor_params = models.actor.params
        if self.shared_critic:  # TRL: value head on the actor's backbone, one joint loss
            head = place.replicate(init_value_head(models.actor.cfg.hidden_size))
            actor_params = {"policy": actor_params, "value_head": head}
        self.state = {  # the train states take over (donate) the loaded param buffers
            "actor": place.create_state(actor_params, self.actor_tx),
            "critic": (None if models.critic is None  # shared critic, or a critic-free estimator
                       else place.create_state(models.critic.params, self.critic_tx)),
            "kl": place.replicate(init_kl_controller(p.kl_controller, p.kl_coef, p.target_kl, p.horizon)),
            "rng": place.replicate(jax.random.PRNGKey(cfg.train.seed)),
        }
        models.actor.params = None
        if models.critic is not None:
            models.critic.params = None
        self.ref_params = models.reference.params
        self.reward_params = models.reward.params if models.reward else None
        if cfg.model.offload_frozen:  # host memory between experience passes
            self.ref_params = place.offload(self.ref_params)
            self.reward_params = place.offload(self.reward_params)
        self.sampler = PromptSampler(len(self.prompts), cfg.train.seed, cfg.data.shuffle)
        self._build_functions()
        self.evaluator = self._build_evaluator() if eval_enabled(cfg.eval) else None
        self._eval_samples: list[dict] = []

    # ----------------------------------------------------------------------------------------
    def _build_functions(self) -> None:
        cfg, m = self.cfg, self.models
        g = cfg.generation
        mesh = self.place.constraint_mesh
        exp_settings = experience_settings(
            cfg, shared_critic=self.shared_critic, mesh=mesh,
            score_normalizer=m.score_normalizer if cfg.reward.normalize else None,
            reward_eos_id=self.reward_eos_id())
        upd_settings = update_settings(cfg, shared_critic=self.shared_critic, mesh=mesh)
        critic_graphdef = m.critic.graphdef if m.critic is not None else None
        reward_graphdef = m.reward.graphdef if m.reward else None
        stops = jnp.asarray(self.stop_ids or (-1,), jnp.int32)

        def experience(actor_params, ref_params, critic_params, reward_params, kl_state, q, qm, r,
                       rm, scores, group_ids, baseline_scores):
            ended = jnp.isin(r, stops).any(axis=1) & (rm.sum(axis=1) > 0)
            exp, kl_state, stats = make_experience(
                m.actor.graphdef, actor_params, m.reference.graphdef, ref_params,
                critic_graphdef, critic_params, reward_graphdef, reward_params, kl_state, q, qm,
                r, rm, scores, ended, settings=exp_settings, group_ids=group_ids,
                baseline_scores=baseline_scores)
            tokens = {"prompt": jnp.sum(qm), "response": jnp.sum(rm)}
            return exp, kl_state, stats, tokens

        def update(actor_state, critic_state, exp, rng, settings=upd_settings):
            return ppo_update(actor_state, critic_state, exp, rng, actor_graphdef=m.actor.graphdef,
                              critic_graphdef=critic_graphdef, actor_tx=self.actor_tx,
                              critic_tx=self.critic_tx, settings=settings)

        def sample(params, q, qm, key, greedy=g.greedy):
            if self.shared_critic:
                params = params["policy"]
            return generate(m.actor.graphdef, params, q, qm, key,
                            max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                            top_k=g.top_k, top_p=g.top_p, greedy=greedy,
                            stop_token_ids=() if g.ignore_eos else self.stop_ids,
                            pad_token_id=self.pad_id, mesh=self.place.constraint_mesh)

        # explicit layouts: params by the rules, batches by rows, the rest replicated
        place, rows, rep = self.place, self.place.rows, self.place.replicated
        actor_sh, critic_sh = place.shardings(self.state["actor"]), place.shardings(self.state["critic"])
        critic_params_sh = None if critic_sh is None else critic_sh.params
        frozen_sh = place.shardings(self.ref_params), place.shardings(self.reward_params)
        self._split = jax.jit(lambda key: tuple(jax.random.split(key, 3)), out_shardings=rep)
        self._generate = jax.jit(sample, in_shardings=(actor_sh.params, rows, rows, rep),
                                 out_shardings=(rows, rows))
        self._generate_greedy = jax.jit(partial(sample, greedy=True),
                                        in_shardings=(actor_sh.params, rows, rows, rep),
                                        out_shardings=(rows, rows))
        self._build_baseline_scoring(reward_graphdef, exp_settings, frozen_sh[1])
        # experience making and the update compile once per (prompt, response) bucket width
        self.response_columns = ResponseColumns(g.max_new_tokens, g.response_buckets, rows, rep)
        self._experience = jax.jit(
            experience, in_shardings=(actor_sh.params, frozen_sh[0], critic_params_sh, frozen_sh[1],
                                      rep, rows, rows, rows, rows, rows, rows, rows),
            out_shardings=(rows, rep, rep, rep))
        jit_update = partial(jax.jit, in_shardings=(actor_sh, critic_sh, rows, rep),
                             out_shardings=(actor_sh, critic_sh, rep), donate_argnums=(0, 1))
        self._update = jit_update(update)
        # ppo.critic_warmup_steps: the same update with the actor left out (compiled when used)
        critic_only = dataclasses.replace(upd_settings, train_actor=False)
        self._update_critic_only = jit_update(partial(update, settings=critic_only))

    def _build_baseline_scoring(self, reward_graphdef, exp_settings, reward_sh) -> None:
        """`self._rm_scores`: the reward model's scores of ReMax's greedy responses, normalised
        as in training (`reward.normalize`)."""
        micro, mesh, norm = self.cfg.ppo.micro_batch_size, self.place.constraint_mesh, \
            exp_settings.score_normalizer
        eos_id = exp_settings.reward_eos_id

        def rm_scores(reward_params, q, qm, r, rm):
            out = map_in_chunks(lambda *x: reward_model_scores(reward_graphdef, reward_params, *x,
                                                                eos_id=eos_id),
                                micro, q, qm, r, rm, mesh=mesh)
            return out if norm is None else (out - norm[0]) / norm[1]

        rows = self.place.rows
        self._rm_scores = jax.jit(rm_scores, in_shardings=(reward_sh, rows, rows, rows, rows),
                                  out_shardings=rows)

    def _build_evaluator(self) -> Evaluator:
        """The held-out evaluation (`eval.*`): its prompts tokenised like the training prompts,
        sampled with the eval settings, scored by the run's reward.

        Raises:
          FileNotFoundError / ValueError / ConfigError: a bad eval prompt file, or prompts too
            long for the context (see `build_prompts`).
        """
        cfg, e, g, m, place = self.cfg, self.cfg.eval, self.cfg.generation, self.models, self.place
        new_tokens = e.max_new_tokens or g.max_new_tokens
        prompts = self._prompt_set(e.prompts, "eval.prompts", new_tokens, e.num_prompts,
                                   "eval.max_new_tokens" if e.max_new_tokens
                                   else "generation.max_new_tokens")
        batch = eval_batch(prompts, e.num_prompts,
                           eval_rows_multiple(place.batch_shards, cfg.ppo.micro_batch_size))
        settings = EvalSettings(
            max_new_tokens=new_tokens, temperature=e.temperature, greedy=e.greedy, top_k=g.top_k,
            top_p=g.top_p, stop_token_ids=() if g.ignore_eos else self.stop_ids,
            pad_token_id=self.pad_id, micro_batch_size=cfg.ppo.micro_batch_size,
            mesh=place.constraint_mesh,
            score_normalizer=m.score_normalizer if cfg.reward.normalize else None,
            reward_eos_id=self.reward_eos_id(), logprob_chunk_size=cfg.model.logprob_chunk_size)
        actor_sh = place.shardings(self._policy_params(self.state["actor"].params))
        shardings = (actor_sh, place.shardings(self.ref_params), place.shardings(self.reward_params))
        graphdefs = (m.actor.graphdef, m.reference.graphdef, m.reward.graphdef if m.reward else None)
        return Evaluator(batch, settings, place, graphdefs, shardings, seed=e.seed,
                         reward_fn=self.reward_fn, decode=self._decode)

    def _prompt_set(self, path: str, key: str, new_tokens: int | None = None, rows: int = 0,
                    new_tokens_key: str = "generation.max_new_tokens"):
        """The tokenised prompt file `path` (`build_prompts`); in an abstract build, `rows`
        (default a batch) prompts `data.max_prompt_length` wide, checked against the context.

        Raises:
          ConfigError / FileNotFoundError / ValueError: see `build_prompts`.
        """
        cfg, model_cfg = self.cfg, self.models.actor.cfg
        if not self.is_abstract:
            return build_prompts(cfg, self.tokenizer, model_cfg, path=path, key=key,
                                 max_new_tokens=new_tokens, new_tokens_key=new_tokens_key)
        width, new = cfg.data.max_prompt_length, new_tokens or cfg.generation.max_new_tokens
        if width + new > model_cfg.max_position_embeddings:
            raise ConfigError(f"{key}: data.max_prompt_length={width} + {new_tokens_key}={new} "
                              f"exceeds the model context {model_cfg.max_position_embeddings}")
        return abstract_prompts(rows or cfg.ppo.batch_size, width)

    def reward_eos_id(self) -> int | None:
        """The tokenizer's EOS id (the actor config's first, in an abstract build) when
        `reward.eos_at_end` (the reward model reads every response at an EOS), else None."""
        if not self.cfg.reward.eos_at_end:
            return None
        if self.tokenizer is None:
            return int(self.stop_ids[0]) if self.stop_ids else 0
        return int(self.tokenizer.eos_token_id)

    def _policy_params(self, params):
        """The actor's CausalLM params (without the shared critic's value head)."""
        return params["policy"] if self.shared_critic else params

    def evaluate(self) -> dict:
        """Evaluate the current actor on the held-out prompts (`eval.*`); keeps its first
        `eval.num_samples` decoded responses for `after_log`. Returns `eval/*` metrics and
        `time/eval` ({} when evaluation is off)."""
        if self.evaluator is None:
            return {}
        ref, reward = self.place.onload(self.ref_params), self.place.onload(self.reward_params)
        metrics, self._eval_samples = self.evaluator(
            self._policy_params(self.state["actor"].params), ref, reward, self.cfg.eval.num_samples)
        del ref, reward
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
    def _decode(self, ids: np.ndarray, mask: np.ndarray) -> list[str]:
        return [self.tokenizer.decode(row[m > 0].tolist(), skip_special_tokens=True)
                for row, m in zip(ids, mask)]

    def step(self) -> dict:
        """One PPO step; returns its metrics (floats).

        Host work inside the step is limited to this process's rows: their prompt ids go in,
        and with a reward function their response tokens come out, are decoded and scored, and
        the scores go back in (`jax.make_array_from_process_local_data` with several
        processes). Everything else stays on the devices until the step's scalars are read.

        Column buckets (`trainer.columns`): the prompts keep the batch's widest prompt (rounded
        up), read from the whole batch's indices that every process knows; the responses are
        cut after sampling to the batch's longest response (rounded up; a global max over the
        row-sharded mask). Both widths are logged (`prompt_width`, `response_width`).
        """
        cfg, place = self.cfg, self.place
        batch = cfg.ppo.batch_size
        t0 = time.perf_counter()
        lo, hi = place.row_range(batch)
        n = cfg.generation.samples_per_prompt  # rows of one prompt are adjacent: one group
        whole = np.repeat(self.sampler.next_indices(batch // n), n)  # the whole batch's prompts
        idx, width = whole[lo:hi], self.prompt_columns.width(whole)  # this process's rows
        cut = self.prompt_columns.cut
        q = place.put_rows(cut(self.prompts.ids[idx], width), (batch, width))
        qm = place.put_rows(cut(self.prompts.mask[idx], width), (batch, width))
        groups = place.put_rows((np.arange(batch, dtype=np.int32) // n)[lo:hi], (batch,))
        rng, gen_key, upd_key = self._split(self.state["rng"])
        actor, critic = self.state["actor"], self.state["critic"]

        resp, resp_mask = jax.block_until_ready(self._generate(actor.params, q, qm, gen_key))
        prompts = [self.prompts.texts[i] for i in idx]
        baseline = self._greedy_baseline(actor.params, q, qm, gen_key, prompts)
        resp, resp_mask, resp_width = self.response_columns(resp, resp_mask)
        t_gen = time.perf_counter()
        responses, scores = None, None
        if self.reward_fn is not None:
            responses = self._decode(local_rows(resp), local_rows(resp_mask))
            local_scores = np.asarray(self.reward_fn(prompts, responses), np.float32)
            scores = place.put_rows(local_scores, (batch,))
        release_host_memory()  # the freed buffers of a phase are not reusable by the next one
        ref, reward = place.onload(self.ref_params), place.onload(self.reward_params)
        critic_params = None if critic is None else critic.params
        exp, kl_state, exp_stats, tokens = self._experience(
            actor.params, ref, critic_params, reward, self.state["kl"], q, qm, resp, resp_mask,
            scores, groups, baseline)
        del ref, reward  # offloaded frozen params: the device copy lives for this pass only
        exp_stats = jax.device_get(exp_stats)  # replicated scalars: readable on every process
        release_host_memory()
        t_score = time.perf_counter()
        warmup = self.step_count < cfg.ppo.critic_warmup_steps
        update = self._update_critic_only if warmup else self._update
        actor, critic, upd_stats = update(actor, critic, exp, upd_key)
        upd_stats = jax.device_get(upd_stats)
        t_update = time.perf_counter()

        self.state = {"actor": actor, "critic": critic, "kl": kl_state, "rng": rng}
        self.step_count += 1
        gen_tokens = float(tokens["response"])
        total_tokens = float(tokens["prompt"]) + gen_tokens
        metrics = {k: float(v) for k, v in exp_stats.items()}
        metrics.update(_mean_stats(upd_stats))
        metrics.update({
            "time/generation": t_gen - t0, "time/scoring": t_score - t_gen,
            "time/update": t_update - t_score, "time/step": t_update - t0,
            "tokens_per_s/generation": gen_tokens / max(t_gen - t0, 1e-9),
            "tokens_per_s/step": total_tokens / max(t_update - t0, 1e-9),
            "data_position": self.sampler.position, "critic_warmup": float(warmup),
            "prompt_width": float(width), "response_width": float(resp_width),
        })
        self._last_rollout = (prompts, responses, resp, resp_mask, exp.scores)
        return metrics

    def _greedy_baseline(self, actor_params, q, qm, key, prompts: list[str]):
        """ReMax: the score of the greedy response to each row's prompt (`[B]` rows), or None
        when the advantage estimator does not need it."""
        if not needs_greedy_baseline(get_advantage_estimator(self.cfg.ppo.advantage_estimator)):
            return None
        g_resp, g_mask = self._generate_greedy(actor_params, q, qm, key)
        if self.reward_fn is None:
            return self._rm_scores(self.place.onload(self.reward_params), q, qm, g_resp, g_mask)
        texts = self._decode(local_rows(g_resp), local_rows(g_mask))
        local = np.asarray(self.reward_fn(prompts, texts), np.float32)
        return self.place.put_rows(local, (self.cfg.ppo.batch_size,))

    @property
    def last_samples(self) -> list[dict]:
        """This process's rows of the last step as `{"prompt", "response", "score"}` dicts
        (decoded on demand when the reward came from a reward model)."""
        if getattr(self, "_last_rollout", None) is None:
            return []
        prompts, responses, resp, resp_mask, scores = self._last_rollout
        if responses is None:
            responses = self._decode(local_rows(resp), local_rows(resp_mask))
        return [{"prompt": p_, "response": r_, "score": float(s_)}
                for p_, r_, s_ in zip(prompts, responses, local_rows(scores))]

    # ----------------------------------------------------------------------------------------
    def export_actor(self, out_dir: Path | None = None) -> Path:
        """Save the current actor as an HF directory (loadable by transformers); collective."""
        select = (lambda p: p["policy"]) if self.shared_critic else None
        return self.write_hf(self.models.actor.graphdef, self.state["actor"].params,
                             self.models.actor.cfg, Path(out_dir or self.out / "actor_hf"), select)

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
