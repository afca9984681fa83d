"""The PPO training loop: rollout -> experience -> update, with metrics and checkpoints.

Each step: take the next batch of prompts; the actor samples responses (one jitted call); the
reward function scores the decoded text (or the reward model scores the tokens); one jitted
call computes log-probs, reference log-probs, values, rewards, advantages and returns; one
jitted call runs every PPO epoch and minibatch. The jitted functions receive every array as an
argument; graph definitions, optimisers and settings are static.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppo_jax.core import KL_ESTIMATORS, get_advantage_estimator, get_policy_loss, get_value_loss, init_kl_controller
from ppo_jax.rollout.experience import ExperienceSettings, make_experience
from ppo_jax.rollout.sampler import generate
from ppo_jax.trainer.checkpoint import Checkpointer
from ppo_jax.trainer.config import Config, ConfigError, to_dict
from ppo_jax.trainer.metrics import MetricsWriter
from ppo_jax.trainer.optim import make_optimizer
from ppo_jax.trainer.reward_functions import get_reward_function
from ppo_jax.trainer.setup import build_models, build_prompts, pad_token_id, stop_token_ids
from ppo_jax.trainer.state import TrainState
from ppo_jax.trainer.update import UpdateSettings, ppo_update
from ppo_jax.trainer.data import PromptSampler


def check_names(cfg: Config) -> None:
    """Registered names in the config exist (before anything is loaded).

    Raises:
      ConfigError: naming the key and listing the known names.
    """
    for key, getter in (("ppo.advantage_estimator", get_advantage_estimator),
                        ("ppo.policy_loss", get_policy_loss), ("ppo.value_loss", get_value_loss)):
        try:
            getter(getattr(cfg.ppo, key.split(".")[1]))
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
    if cfg.ppo.kl_estimator not in KL_ESTIMATORS:
        raise ConfigError(f"ppo.kl_estimator={cfg.ppo.kl_estimator!r}; known: {list(KL_ESTIMATORS)}")
    if cfg.reward.kind == "function":
        try:
            get_reward_function(cfg.reward.function)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _mean_stats(stats: dict) -> dict:
    out = {k: float(np.mean(np.asarray(v))) for k, v in stats.items()}
    out["ratio_first_minibatch"] = float(np.asarray(stats["ratio"])[0, 0])
    out["approxkl_first_minibatch"] = float(np.asarray(stats["approxkl"])[0, 0])
    return out


class PPOTrainer:
    """Owns the models, states and jitted steps of one run.

    `PPOTrainer(cfg, resume=False)` loads everything (raising ConfigError / FileNotFoundError /
    ValueError before any compile); `train()` runs the remaining steps; `step()` runs one.
    """

    def __init__(self, cfg: Config, *, resume: bool = False):
        check_names(cfg)
        self.cfg = cfg
        self.out = Path(cfg.train.output_dir)
        self.process_index = jax.process_index()
        models = build_models(cfg)
        self.models, self.tokenizer = models, models.tokenizer
        self.prompts = build_prompts(cfg, self.tokenizer, models.actor.cfg)
        self.stop_ids = stop_token_ids(cfg, self.tokenizer, models.actor.cfg)
        self.pad_id = pad_token_id(self.tokenizer)
        self.reward_fn = get_reward_function(cfg.reward.function) if cfg.reward.kind == "function" else None

        p, o = cfg.ppo, cfg.optim
        opt_steps = cfg.train.steps * p.ppo_epochs * (p.batch_size // p.mini_batch_size)
        common = dict(schedule=o.schedule, warmup_steps=o.warmup_steps, total_steps=opt_steps,
                      weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps,
                      max_grad_norm=o.max_grad_norm)
        self.actor_tx = make_optimizer(o.actor_lr, **common)
        self.critic_tx = make_optimizer(o.critic_lr, **common)
        self.state = {
            "actor": TrainState.create(models.actor.params, self.actor_tx),
            "critic": TrainState.create(models.critic.params, self.critic_tx),
            "kl": init_kl_controller(p.kl_controller, p.kl_coef, p.target_kl, p.horizon),
            "rng": jax.random.PRNGKey(cfg.train.seed),
        }
        self.ref_params = models.reference.params
        self.reward_params = models.reward.params if models.reward else None
        self.sampler = PromptSampler(len(self.prompts), cfg.train.seed, cfg.data.shuffle)
        self.step_count = 0
        self._build_functions()

        self.checkpointer = Checkpointer(self.out / "checkpoints", max_to_keep=cfg.train.max_to_keep)
        if resume:
            self._restore()
        self.writer = MetricsWriter(self.out, tensorboard=cfg.train.tensorboard,
                                    enabled=self.process_index == 0)
        if self.process_index == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))

    # ----------------------------------------------------------------------------------------
    def _build_functions(self) -> None:
        cfg, m = self.cfg, self.models
        p, g = cfg.ppo, cfg.generation
        exp_settings = ExperienceSettings(
            temperature=g.temperature, micro_batch_size=p.micro_batch_size,
            kl_estimator=p.kl_estimator, reward_clip=p.reward_clip, score_scale=p.score_scale,
            missing_eos_penalty=p.missing_eos_penalty, whiten_rewards=p.whiten_rewards,
            whiten_advantages=p.whiten_advantages, advantage_estimator=p.advantage_estimator,
            gamma=p.gamma, lam=p.lam)
        upd_settings = UpdateSettings(
            ppo_epochs=p.ppo_epochs, mini_batch_size=p.mini_batch_size,
            micro_batch_size=p.micro_batch_size, temperature=g.temperature,
            policy_loss=p.policy_loss, value_loss=p.value_loss, cliprange=p.cliprange,
            cliprange_high=p.cliprange_high, dual_clip=p.dual_clip,
            cliprange_value=p.cliprange_value)
        reward_graphdef = m.reward.graphdef if m.reward else None

        def experience(actor_params, ref_params, critic_params, reward_params, kl_state, q, qm, r,
                       rm, scores, ended):
            return make_experience(m.actor.graphdef, actor_params, m.reference.graphdef, ref_params,
                                   m.critic.graphdef, critic_params, reward_graphdef, reward_params,
                                   kl_state, q, qm, r, rm, scores, ended, settings=exp_settings)

        def update(actor_state, critic_state, exp, rng):
            return ppo_update(actor_state, critic_state, exp, rng, actor_graphdef=m.actor.graphdef,
                              critic_graphdef=m.critic.graphdef, actor_tx=self.actor_tx,
                              critic_tx=self.critic_tx, settings=upd_settings)

        self._experience = jax.jit(experience)
        self._update = jax.jit(update, donate_argnums=(0, 1))

    def _generate(self, params, q, qm, key):
        g = self.cfg.generation
        return generate(self.models.actor.graphdef, params, q, qm, key,
                        max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_k=g.top_k,
                        top_p=g.top_p, greedy=g.greedy, stop_token_ids=self.stop_ids,
                        pad_token_id=self.pad_id)

    # ----------------------------------------------------------------------------------------
    def _decode(self, ids: np.ndarray, mask: np.ndarray) -> list[str]:
        return [self.tokenizer.decode(row[m > 0].tolist(), skip_special_tokens=True)
                for row, m in zip(ids, mask)]

    def step(self) -> dict:
        """One PPO step; returns its metrics (floats)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        idx = self.sampler.next_indices(cfg.ppo.batch_size)
        q, qm = jnp.asarray(self.prompts.ids[idx]), jnp.asarray(self.prompts.mask[idx])
        rng, gen_key, upd_key = jax.random.split(self.state["rng"], 3)
        actor, critic = self.state["actor"], self.state["critic"]

        resp, resp_mask = jax.block_until_ready(self._generate(actor.params, q, qm, gen_key))
        t_gen = time.perf_counter()
        resp_np, mask_np = np.asarray(resp), np.asarray(resp_mask)
        ended = np.isin(resp_np, self.stop_ids).any(axis=1) & (mask_np.sum(1) > 0)
        responses = self._decode(resp_np, mask_np)
        prompts = [self.prompts.texts[i] for i in idx]
        scores = None
        if self.reward_fn is not None:
            scores = jnp.asarray(self.reward_fn(prompts, responses), jnp.float32)
        exp, kl_state, exp_stats = self._experience(
            actor.params, self.ref_params, critic.params, self.reward_params, self.state["kl"], q,
            qm, resp, resp_mask, scores, jnp.asarray(ended))
        exp_stats = jax.device_get(exp_stats)
        t_score = time.perf_counter()
        actor, critic, upd_stats = self._update(actor, critic, exp, upd_key)
        upd_stats = jax.device_get(upd_stats)
        t_update = time.perf_counter()

        self.state = {"actor": actor, "critic": critic, "kl": kl_state, "rng": rng}
        self.step_count += 1
        gen_tokens = float(mask_np.sum())
        total_tokens = float(np.asarray(qm).sum()) + gen_tokens
        metrics = {k: float(v) for k, v in exp_stats.items()}
        metrics.update(_mean_stats(upd_stats))
        metrics.update({
            "time/generation": t_gen - t0, "time/scoring": t_score - t_gen,
            "time/update": t_update - t_score, "time/step": t_update - t0,
            "tokens_per_s/generation": gen_tokens / max(t_gen - t0, 1e-9),
            "tokens_per_s/step": total_tokens / max(t_update - t0, 1e-9),
            "data_position": self.sampler.position,
        })
        self.last_samples = [{"prompt": p_, "response": r_, "score": float(s_)} for p_, r_, s_ in
                             zip(prompts, responses, np.asarray(exp.scores))]
        return metrics

    # ----------------------------------------------------------------------------------------
    def save(self) -> None:
        """Write an orbax checkpoint of the current step (collective over processes)."""
        meta = {"step": self.step_count, "data_position": self.sampler.position}
        self.checkpointer.save(self.step_count, self.state, meta)

    def _restore(self) -> None:
        step = self.checkpointer.latest_step()
        if step is None:
            print(f"--resume: no checkpoint under {self.checkpointer.directory}; starting at step 0")
            return
        self.state, meta = self.checkpointer.restore(step, self.state)
        self.step_count = int(meta["step"])
        self.sampler.position = int(meta["data_position"])
        print(f"resumed from step {self.step_count} ({self.checkpointer.directory / str(step)})")

    def export_actor(self, out_dir: Path | None = None) -> Path:
        """Save the current actor as an HF directory (loadable by transformers)."""
        from ppo_jax.models import save_pretrained

        out_dir = Path(out_dir or self.out / "actor_hf")
        model = nnx.merge(self.models.actor.graphdef, self.state["actor"].params)
        return save_pretrained(model, self.models.actor.cfg, out_dir, self.tokenizer)

    def train(self, progress: bool | None = None) -> list[dict]:
        """Run steps until `train.steps`; log, sample, checkpoint; export the actor at the end."""
        cfg = self.cfg.train
        show = cfg.progress if progress is None else progress
        history = []
        bar = None
        if show and self.process_index == 0:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=self.step_count, desc="ppo", unit="step",
                       dynamic_ncols=True)
        try:
            while self.step_count < cfg.steps:
                metrics = self.step()
                history.append(metrics)
                n = self.step_count
                if n % cfg.log_every == 0 or n == cfg.steps:
                    self.writer.write(n, metrics)
                if cfg.sample_every and (n % cfg.sample_every == 0 or n == 1):
                    self.writer.write_samples(n, self.last_samples[:cfg.num_samples])
                if (cfg.save_every and n % cfg.save_every == 0) or n == cfg.steps:
                    self.save()
                if bar is not None:
                    bar.set_postfix(reward=f"{metrics['score_mean']:.3f}", kl=f"{metrics['kl']:.3f}",
                                    s_per_step=f"{metrics['time/step']:.1f}")
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            self.writer.close()
        if cfg.export_hf and self.process_index == 0:
            self.export_actor()
        return history
