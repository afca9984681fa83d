"""The PPO training loop: rollout -> experience -> update, with metrics and checkpoints.

Each step: take the next batch of prompts; the actor samples responses (one jitted call); the
reward function scores the decoded text (or the reward model scores the tokens); one jitted
call computes log-probs, reference log-probs, values, rewards, advantages and returns; one
jitted call runs every PPO epoch and minibatch. The jitted functions receive every array as an
argument; graph definitions, optimisers and settings are static.
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppo_jax.core import KL_ESTIMATORS, get_advantage_estimator, get_policy_loss, get_value_loss, init_kl_controller
from ppo_jax.parallel.host import local_rows, to_host
from ppo_jax.rollout.experience import ExperienceSettings, make_experience
from ppo_jax.rollout.sampler import generate
from ppo_jax.rollout.scoring import init_value_head
from ppo_jax.trainer.checkpoint import Checkpointer, finished_steps
from ppo_jax.trainer.config import Config, ConfigError, static_kwargs, to_dict
from ppo_jax.trainer.data import PromptSampler, read_prompts
from ppo_jax.trainer.host_memory import release_host_memory
from ppo_jax.trainer.metrics import MetricsWriter
from ppo_jax.trainer.optim import make_optimizer
from ppo_jax.trainer.placement import Placement
from ppo_jax.trainer.reward_functions import get_reward_function
from ppo_jax.trainer.run_dir import (
    SUPERSEDED, RunLock, check_writable, logged_steps, supersede_metrics,
)
from ppo_jax.trainer.setup import build_models, build_prompts, pad_token_id, stop_token_ids
from ppo_jax.trainer.state import TrainState
from ppo_jax.trainer.update import UpdateSettings, ppo_update


def check_names(cfg: Config) -> None:
    """Registered names in the config exist and take the arguments the trainer will pass
    (before anything is loaded).

    Raises:
      ConfigError: naming the key, listing the known names or the call that would fail.
    """
    p = cfg.ppo
    upd = UpdateSettings(cliprange=p.cliprange, cliprange_high=p.cliprange_high,
                         dual_clip=p.dual_clip, cliprange_value=p.cliprange_value)
    calls = (  # key, getter, positional names, the trainer's own keywords, the config's extras
        ("ppo.advantage_estimator", get_advantage_estimator, ("values", "rewards", "mask"),
         {"gamma": p.gamma, "lam": p.lam}, ("advantage_kwargs", p.advantage_kwargs)),
        ("ppo.policy_loss", get_policy_loss, ("logprobs", "old_logprobs", "advantages", "mask"),
         {"loss_normalizer": 1.0, **upd.policy_fixed_kwargs()},
         ("policy_loss_kwargs", p.policy_loss_kwargs)),
        ("ppo.value_loss", get_value_loss, ("values", "old_values", "returns", "mask"),
         {"loss_normalizer": 1.0, "cliprange_value": p.cliprange_value},
         ("value_loss_kwargs", p.value_loss_kwargs)))
    for key, getter, positional, fixed, (extra_name, extra) in calls:
        shadowed = sorted(set(fixed) & set(extra))
        if shadowed:
            raise ConfigError(f"ppo.{extra_name}.{shadowed[0]}: the trainer passes {shadowed[0]} "
                              "itself (set it through its own ppo.* field)")
        kwargs = {**fixed, **extra}
        name = getattr(p, key.split(".")[1])
        try:
            fn = getter(name)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
        try:
            inspect.signature(fn).bind(*positional, **kwargs)
        except TypeError as e:
            raise ConfigError(
                f"{key}={name!r}: {getattr(fn, '__name__', fn)}{inspect.signature(fn)} cannot be "
                f"called as the trainer calls it, fn({', '.join(positional)}, "
                f"{', '.join(f'{k}=' for k in kwargs)}): {e}") from None
        try:  # and runs with the configured arguments (a bad method or clip fails here, not mid-step)
            fn(*(jnp.ones((1, 2), jnp.float32) for _ in positional), **kwargs)
        except Exception as e:  # noqa: BLE001 - any failure of the user's function is reported
            raise ConfigError(f"{key}={name!r} fails on a 1x2 test batch with the configured "
                              f"arguments {kwargs}: {type(e).__name__}: {e}") from None
    if cfg.ppo.kl_estimator not in KL_ESTIMATORS:
        raise ConfigError(f"ppo.kl_estimator={cfg.ppo.kl_estimator!r}; known: {list(KL_ESTIMATORS)}")
    if cfg.reward.kind == "function":
        try:
            get_reward_function(cfg.reward.function)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _mean_stats(stats: dict) -> dict:
    """Means over epochs x minibatches; the first minibatch's ratio and approxkl (the PPO
    invariant: 1 and 0) when the policy loss reports them."""
    out = {k: float(np.mean(np.asarray(v))) for k, v in stats.items()}
    for key in ("ratio", "approxkl"):
        if key in stats:
            out[f"{key}_first_minibatch"] = float(np.asarray(stats[key])[0, 0])
    return out


class PPOTrainer:
    """Owns the models, states and jitted steps of one run.

    `PPOTrainer(cfg, resume=False, devices=None)` loads everything (raising ConfigError /
    FileNotFoundError / ValueError before any compile); `train()` runs the remaining steps;
    `step()` runs one.

    Every array lives on the device mesh of `cfg.mesh` (over `devices`, default all devices of
    all processes; `trainer.placement`): params and optimiser states sharded by the named rules
    of `ppo_jax.parallel.rules`, batches split over ("data", "fsdp"), the KL controller and RNG
    replicated. Each process feeds and reads only its own rows of every batch.
    """

    def __init__(self, cfg: Config, *, resume: bool = False, devices=None):
        check_names(cfg)
        read_prompts(cfg.data.prompts, cfg.data.prompt_field)  # a bad file fails before loading
        self.cfg = cfg
        self.out = Path(cfg.train.output_dir)
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"train.output_dir={cfg.train.output_dir!r} is a file, not a directory")
        done, logged = finished_steps(self.out / "checkpoints"), logged_steps(self.out)
        if not resume and (done or logged):
            held = f"checkpoints (steps {done})" if done else f"metrics of {len(logged)} steps"
            raise ConfigError(
                f"train.output_dir={cfg.train.output_dir!r} already holds {held}; pass --resume to "
                "continue that run, or choose a new train.output_dir (nothing was written)")
        if resume and not done and logged:
            raise ConfigError(
                f"--resume: train.output_dir={cfg.train.output_dir!r} holds metrics of "
                f"{len(logged)} steps but no checkpoint to continue them from; choose a new "
                "train.output_dir (nothing was written)")
        self.process_index = jax.process_index()
        self._lock = None
        if self.process_index == 0:
            check_writable(self.out)
            self._lock = RunLock(self.out)
        try:
            self.place = Placement.from_config(cfg.mesh, devices)
        except ValueError as e:
            raise ConfigError(f"mesh: {e}") from None
        if cfg.ppo.batch_size % self.place.batch_shards:
            raise ConfigError(f"ppo.batch_size={cfg.ppo.batch_size} is not a multiple of mesh "
                              f"data x fsdp = {self.place.batch_shards}")
        models = build_models(cfg, sharding_fn=self.place.sharding_fn)
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
        place = self.place
        self.shared_critic = cfg.model.shared_critic
        actor_params = models.actor.params
        if self.shared_critic:  # TRL: value head on the actor's backbone, one joint loss
            head = place.replicate(init_value_head(models.actor.cfg.hidden_size))
            actor_params = {"policy": actor_params, "value_head": head}
        self.state = {  # the train states take over (donate) the loaded param buffers
            "actor": place.create_state(actor_params, self.actor_tx),
            "critic": (None if self.shared_critic
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
        self.step_count = 0
        self._build_functions()

        self.checkpointer = Checkpointer(self.out / "checkpoints", max_to_keep=cfg.train.max_to_keep)
        if resume:
            self._restore()
            moved = supersede_metrics(self.out, self.step_count) if self.process_index == 0 else 0
            if moved:
                print(f"--resume: {moved} logged steps after step {self.step_count} (past the last "
                      f"checkpoint) moved to {self.out / SUPERSEDED}; they run again")
        self.writer = MetricsWriter(self.out, tensorboard=cfg.train.tensorboard,
                                    enabled=self.process_index == 0)
        if self.process_index == 0 and self.step_count < cfg.train.steps:
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
            gamma=p.gamma, lam=p.lam, advantage_kwargs=static_kwargs(p.advantage_kwargs),
            shared_critic=self.shared_critic, mesh=self.place.constraint_mesh)
        upd_settings = UpdateSettings(
            ppo_epochs=p.ppo_epochs, mini_batch_size=p.mini_batch_size,
            micro_batch_size=p.micro_batch_size, temperature=g.temperature,
            policy_loss=p.policy_loss, value_loss=p.value_loss, cliprange=p.cliprange,
            cliprange_high=p.cliprange_high, dual_clip=p.dual_clip,
            cliprange_value=p.cliprange_value, policy_loss_kwargs=static_kwargs(p.policy_loss_kwargs),
            value_loss_kwargs=static_kwargs(p.value_loss_kwargs), shared_critic=self.shared_critic,
            vf_coef=p.vf_coef, mesh=self.place.constraint_mesh)
        critic_graphdef = m.critic.graphdef if m.critic is not None else None
        reward_graphdef = m.reward.graphdef if m.reward else None
        stops = jnp.asarray(self.stop_ids or (-1,), jnp.int32)

        def experience(actor_params, ref_params, critic_params, reward_params, kl_state, q, qm, r,
                       rm, scores):
            ended = jnp.isin(r, stops).any(axis=1) & (rm.sum(axis=1) > 0)
            exp, kl_state, stats = make_experience(
                m.actor.graphdef, actor_params, m.reference.graphdef, ref_params,
                critic_graphdef, critic_params, reward_graphdef, reward_params, kl_state, q, qm,
                r, rm, scores, ended, settings=exp_settings)
            tokens = {"prompt": jnp.sum(qm), "response": jnp.sum(rm)}
            return exp, kl_state, stats, tokens

        def update(actor_state, critic_state, exp, rng):
            return ppo_update(actor_state, critic_state, exp, rng, actor_graphdef=m.actor.graphdef,
                              critic_graphdef=critic_graphdef, actor_tx=self.actor_tx,
                              critic_tx=self.critic_tx, settings=upd_settings)

        def sample(params, q, qm, key):
            if self.shared_critic:
                params = params["policy"]
            return generate(m.actor.graphdef, params, q, qm, key,
                            max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                            top_k=g.top_k, top_p=g.top_p, greedy=g.greedy,
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
        self._experience = jax.jit(
            experience, in_shardings=(actor_sh.params, frozen_sh[0], critic_params_sh, frozen_sh[1],
                                      rep, rows, rows, rows, rows, rows),
            out_shardings=(rows, rep, rep, rep))
        self._update = jax.jit(update, in_shardings=(actor_sh, critic_sh, rows, rep),
                               out_shardings=(actor_sh, critic_sh, rep), donate_argnums=(0, 1))

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
        """
        cfg, place = self.cfg, self.place
        batch, width = cfg.ppo.batch_size, self.prompts.ids.shape[1]
        t0 = time.perf_counter()
        lo, hi = place.row_range(batch)
        idx = self.sampler.next_indices(batch)[lo:hi]  # this process's rows of the global batch
        q = place.put_rows(self.prompts.ids[idx], (batch, width))
        qm = place.put_rows(self.prompts.mask[idx], (batch, width))
        rng, gen_key, upd_key = self._split(self.state["rng"])
        actor, critic = self.state["actor"], self.state["critic"]

        resp, resp_mask = jax.block_until_ready(self._generate(actor.params, q, qm, gen_key))
        t_gen = time.perf_counter()
        prompts = [self.prompts.texts[i] for i in idx]
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
            scores)
        del ref, reward  # offloaded frozen params: the device copy lives for this pass only
        exp_stats = jax.device_get(exp_stats)  # replicated scalars: readable on every process
        release_host_memory()
        t_score = time.perf_counter()
        actor, critic, upd_stats = self._update(actor, critic, exp, upd_key)
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
            "data_position": self.sampler.position,
        })
        self._last_rollout = (prompts, responses, resp, resp_mask, exp.scores)
        return metrics

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
    def save(self) -> None:
        """Write an orbax checkpoint of the current step (collective over processes)."""
        meta = {"step": self.step_count, "data_position": self.sampler.position}
        self.checkpointer.save(self.step_count, self.state, meta)
        release_host_memory()  # orbax's write buffers, freed on its threads

    def _restore(self) -> None:
        step = self.checkpointer.latest_step()
        if step is None:
            print(f"--resume: no checkpoint under {self.checkpointer.directory}; starting at step 0")
            return
        try:
            self.state, meta = self.checkpointer.restore(step, self.state)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"checkpoint {self.checkpointer.directory / str(step)} does not fit this run's "
                "train state: was it written with other model.* settings (shared_critic, actor, "
                f"critic, param_dtype)? ({type(e).__name__}: {str(e)[:300]})") from None
        self.step_count = int(meta["step"])
        self.sampler.position = int(meta["data_position"])
        print(f"resumed from step {self.step_count} ({self.checkpointer.directory / str(step)})")

    def export_actor(self, out_dir: Path | None = None) -> Path:
        """Save the current actor as an HF directory (loadable by transformers).

        Collective: every process gathers the sharded params to host memory (one tensor at a
        time is replicated for the gather); process 0 writes."""
        from ppo_jax.models import save_pretrained

        out_dir = Path(out_dir or self.out / "actor_hf")
        params = to_host(self.state["actor"].params)
        if self.shared_critic:
            params = params["policy"]
        if self.process_index != 0:
            return out_dir
        model = nnx.merge(self.models.actor.graphdef, params)
        return save_pretrained(model, self.models.actor.cfg, out_dir, self.tokenizer)

    def train(self, progress: bool | None = None) -> list[dict]:
        """Run steps until `train.steps`; log, sample, checkpoint; export the actor at the end."""
        cfg = self.cfg.train
        if self.step_count >= cfg.steps:
            if self.process_index == 0:
                print(f"nothing to do: the run is at step {self.step_count} and train.steps="
                      f"{cfg.steps}; raise train.steps to continue it")
            if self._lock is not None:
                self._lock.release()
            return []
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
                bad = sorted(k for k, v in metrics.items()
                             if (k.endswith("loss") or k == "kl") and not np.isfinite(v))
                if n % cfg.log_every == 0 or n == cfg.steps or bad:
                    self.writer.write(n, metrics)
                if bad:
                    last = self.checkpointer.latest_step()
                    raise FloatingPointError(
                        f"step {n}: {', '.join(bad)} not finite; stopped before saving (the last "
                        f"checkpoint, step {last}, is kept). Check learning rates, kl_coef and the "
                        "reward scale")
                if self.writer.enabled and cfg.sample_every and (n % cfg.sample_every == 0 or n == 1):
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
            if self._lock is not None:
                self._lock.release()
        if cfg.export_hf:
            self.export_actor()  # collective; process 0 writes
        return history
