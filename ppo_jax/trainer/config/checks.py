"""The cross-field checks of a run's config (`validate`): choices, finite numbers, sizes that
must be positive or divide each other, and settings that only make sense together. Each error
is a `ConfigError` naming the key and its value, raised before anything is loaded or compiled.
"""

from __future__ import annotations

import importlib.util
import math
import os
import typing
from typing import Literal

from ppo_jax.core.estimators import needs_greedy_baseline
from ppo_jax.core.gae import GAE_METHODS
from ppo_jax.core.registry import get_advantage_estimator
from ppo_jax.core.rollout_correction import check_rollout_correction
from ppo_jax.models.config import LORA_TARGETS
from ppo_jax.trainer.config.help import leaves
from ppo_jax.trainer.config.loss_checks import check_policy_loss
from ppo_jax.trainer.config.no_effect import check_no_effect
from ppo_jax.trainer.config.schema import (
    Config, ConfigError, EvalConfig, OptimConfig, PPOConfig, TrainConfig,
)
from ppo_jax.trainer.data.tasks import TASK_SOURCE
from ppo_jax.trainer.rewards.verifiers import TAG_MENTION
from ppo_jax.trainer.tracking.loggers import (
    DATABASE_MODULES, WANDB_HOST, database_uri, has_wandb_key,
)


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {list(allowed)}")


def _positive(name: str, value) -> None:
    if value is None or value <= 0:
        raise ConfigError(f"{name}={value!r} must be > 0")


def _validate_value_head_lr(cfg: Config) -> None:
    lr = cfg.optim.value_head_lr
    if lr is None:
        return
    if not (cfg.stage == "ppo" and cfg.model.shared_critic):
        raise ConfigError(f"optim.value_head_lr={lr!r} sets the learning rate of the value head "
                          "on the actor: it needs stage=ppo and model.shared_critic=true "
                          f"(stage={cfg.stage!r}, model.shared_critic={cfg.model.shared_critic});"
                          " a separate critic trains at optim.critic_lr")
    _positive("optim.value_head_lr", lr)


def _validate_model(m) -> None:
    """`model.logprob_chunk_size` >= 0; `model.router_aux_loss_coef` null or >= 0."""
    if m.logprob_chunk_size < 0:
        raise ConfigError(f"model.logprob_chunk_size={m.logprob_chunk_size!r} must be >= 0 "
                          "(0: full-vocabulary logits)")
    coef = m.router_aux_loss_coef
    if coef is not None and not (math.isfinite(coef) and coef >= 0):
        raise ConfigError(f"model.router_aux_loss_coef={coef!r} must be a finite number >= 0 "
                          "(null: the checkpoint's)")


def validate(cfg: Config) -> None:
    """Check the relations between fields, then refuse settings left without effect (`no_effect`).

    Raises:
      ConfigError: naming the field and its value.
    """
    p, g, o = cfg.ppo, cfg.generation, cfg.optim
    for key, value, kind in leaves(cfg):
        choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else None
        if choices:  # also for a Config built in Python (load_config's merge checks them too)
            _choice(key, value, choices)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value!r} must be a finite number")
    _validate_ppo(p)
    _positive("generation.max_new_tokens", g.max_new_tokens)
    _positive("generation.temperature", g.temperature)
    if g.top_k < 0 or not (0.0 < g.top_p <= 1.0):
        raise ConfigError(f"generation.top_k={g.top_k!r} must be >= 0 and generation.top_p="
                          f"{g.top_p!r} in (0, 1]")
    _positive("data.max_prompt_length", cfg.data.max_prompt_length)
    _validate_model(cfg.model)
    _positive("data.prompt_buckets", cfg.data.prompt_buckets)
    _positive("generation.response_buckets", g.response_buckets)
    if g.placement == "split" and g.rollout_devices < 1:
        raise ConfigError(f"generation.rollout_devices={g.rollout_devices!r}: "
                          "generation.placement=split needs a rollout group of at least one "
                          "device (e.g. --set generation.rollout_devices=4)")
    _validate_optim_train(o, cfg.train)
    _validate_reward(cfg)
    _validate_ppo_relations(cfg)
    _validate_env(cfg)
    _validate_async(cfg)
    _validate_stage(cfg)
    _validate_lora(cfg)
    _validate_eval(cfg.eval)
    _validate_task(cfg)
    _validate_plain_instruction(cfg)
    _validate_run(cfg)
    check_no_effect(cfg)  # last: a value out of range is named as such first


def _validate_ppo_relations(cfg: Config) -> None:
    """PPO's settings against generation's, the reward's and the critic's."""
    p, g = cfg.ppo, cfg.generation
    if p.critic_warmup_steps < 0:
        raise ConfigError(f"ppo.critic_warmup_steps={p.critic_warmup_steps!r} must be >= 0")
    _positive("generation.samples_per_prompt", g.samples_per_prompt)
    if p.batch_size % g.samples_per_prompt:
        raise ConfigError(f"ppo.batch_size={p.batch_size} is not a multiple of "
                          f"generation.samples_per_prompt={g.samples_per_prompt}")
    if not 0 <= p.overlong_buffer <= g.max_new_tokens or p.overlong_penalty_factor < 0:
        raise ConfigError(f"ppo.overlong_buffer={p.overlong_buffer} must lie in [0, "
                          f"generation.max_new_tokens={g.max_new_tokens}] and "
                          f"ppo.overlong_penalty_factor={p.overlong_penalty_factor} be >= 0")
    _positive("ppo.max_sampling_rounds", p.max_sampling_rounds)
    longest = cfg.data.max_prompt_length + g.max_new_tokens
    if p.micro_batch_tokens is not None and p.micro_batch_tokens < longest:
        raise ConfigError(
            f"ppo.micro_batch_tokens={p.micro_batch_tokens!r} is less than the longest sequence, "
            f"data.max_prompt_length + generation.max_new_tokens = {longest} tokens: a "
            f"micro-batch must hold one (raise it to at least {longest})")
    if p.dynamic_sampling and (g.samples_per_prompt < 2 or cfg.reward.kind != "function"):
        missing = [f"{k} (it is {v!r})" for k, v, ok in (
            ("generation.samples_per_prompt > 1", g.samples_per_prompt, g.samples_per_prompt > 1),
            ("reward.kind=function", cfg.reward.kind, cfg.reward.kind == "function")) if not ok]
        raise ConfigError("ppo.dynamic_sampling=true compares the rewards of a prompt's samples: "
                          f"it needs {' and '.join(missing)}")
    if cfg.stage == "ppo" and cfg.model.shared_critic and cfg.model.critic:
        raise ConfigError(f"model.critic={cfg.model.critic!r} cannot be used with "
                          "model.shared_critic=true (the value head sits on the actor)")
    _validate_value_head_lr(cfg)
    if p.critic_warmup_steps and cfg.model.shared_critic:
        raise ConfigError("ppo.critic_warmup_steps needs a separate critic (model.shared_critic="
                          "false): a shared backbone cannot train the values alone")


def _validate_run(cfg: Config) -> None:
    """`train.steps`, `train.max_minutes` and the mesh's sizes."""
    _positive("train.steps", cfg.train.steps)
    if cfg.train.max_minutes is not None and not cfg.train.max_minutes > 0:
        raise ConfigError(f"train.max_minutes={cfg.train.max_minutes!r} must be > 0 minutes "
                          "(or null: no wall-clock budget)")
    for name in ("data", "fsdp", "tensor"):
        size = getattr(cfg.mesh, name)
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{name}={size!r} must be a positive size or -1")


def _validate_reward(cfg: Config) -> None:
    """The reward's source: a reward model only with reward.kind=model, and its options."""
    if cfg.stage == "ppo" and cfg.reward.kind == "model" and not cfg.model.reward_model:
        raise ConfigError("reward.kind='model' needs model.reward_model (a local HF directory)")
    if cfg.stage == "ppo" and cfg.model.reward_model and cfg.reward.kind != "model":
        raise ConfigError(f"model.reward_model={cfg.model.reward_model!r} is read only with "
                          f"reward.kind='model' (reward.kind={cfg.reward.kind!r}): set "
                          "reward.kind=model to score with it, or model.critic to start the "
                          "critic from it")
    if cfg.reward.normalize and cfg.reward.kind != "model":
        raise ConfigError("reward.normalize=true applies to reward.kind='model' scores only")
    if cfg.reward.eos_at_end and cfg.reward.kind != "model":
        raise ConfigError("reward.eos_at_end=true applies to reward.kind='model' only")


def _validate_env(cfg: Config) -> None:
    """Multi-turn episodes (`env.*`): sizes, and the features they do not combine with yet."""
    e = cfg.env
    if not isinstance(e.kwargs, dict):
        raise ConfigError(f"env.kwargs={e.kwargs!r} must be a mapping")
    _positive("env.max_turns", e.max_turns)
    _positive("env.max_observation_tokens", e.max_observation_tokens)
    _positive("env.timeout_s", e.timeout_s)
    if isinstance(e.max_failed_steps, bool) or not isinstance(e.max_failed_steps, int) or \
            e.max_failed_steps < 1:
        raise ConfigError(f"env.max_failed_steps={e.max_failed_steps!r} must be an int >= 1 "
                          "(steps in a row whose every episode failed before the run stops)")
    if isinstance(e.concurrency, bool) or not isinstance(e.concurrency, int) or e.concurrency < 1:
        raise ConfigError(f"env.concurrency={e.concurrency!r} must be an int >= 1 (environment "
                          "calls a process runs at once)")
    if e.stop_strings is not None and not all(isinstance(x, str) and x for x in e.stop_strings):
        raise ConfigError(f"env.stop_strings={e.stop_strings!r} must be non-empty strings")
    if e.name is None or cfg.stage != "ppo":
        return
    if cfg.ppo.dynamic_sampling:
        raise ConfigError(f"env.name={e.name!r} cannot be used with ppo.dynamic_sampling=true "
                          "yet: its rounds sample single responses")
    if cfg.reward.kind != "function":
        raise ConfigError(f"env.name={e.name!r}: the environment gives the reward; "
                          f"reward.kind={cfg.reward.kind!r} must stay 'function'")


def _async_refusal(cfg: Config) -> str | None:
    """Why `ppo.max_staleness` > 0 cannot run with `cfg` (None: it can)."""
    g, p = cfg.generation, cfg.ppo
    if g.placement != "split" or g.engine != "paged":
        wanted = [f"{k}={v}" for k, v, now in (("generation.placement", "split", g.placement),
                                                ("generation.engine", "paged", g.engine))
                  if now != v]
        return (f"generation.placement={g.placement!r} and generation.engine={g.engine!r}: the "
                "rollouts stream on a rollout group of their own, through the engine that keeps "
                f"its slots full across batches (set {' and '.join(wanted)})")
    if p.rollout_correction == "none":
        return ("ppo.rollout_correction='none': a stale sample was drawn by an older policy "
                "than PPO's pi_old; set tis, mis or icepop, the decoupled PPO objective's weight "
                "pi_old / pi_rollout over the recorded log-probs (docs/async_rl.md)")
    if cfg.env.name is not None:
        return (f"env.name={cfg.env.name!r}: a multi-turn episode waits for its environment "
                "between turns; the stream generates single-turn responses only")
    if p.dynamic_sampling:
        return ("ppo.dynamic_sampling=true draws and scores rounds until a step's batch is "
                "full: the number of batches a step takes is not known when they are submitted")
    try:
        fn = get_advantage_estimator(p.advantage_estimator)
    except ValueError:  # an unknown name: `stages.ppo.load_checks` names it
        fn = None
    if fn is not None and needs_greedy_baseline(fn):
        return (f"ppo.advantage_estimator={p.advantage_estimator!r}: its baseline is a greedy "
                "response to each prompt under the weights that drew the batch, a second "
                "generation the stream does not run")
    if cfg.model.router_replay == "rollout" and g.partial_rollouts and \
            g.kv_on_switch == "recompute":
        return ("model.router_replay='rollout' with generation.partial_rollouts=true and "
                "generation.kv_on_switch='recompute': the recompute would route the fed tokens "
                "again while the recorded routes stay the old ones; set kv_on_switch=keep or "
                "partial_rollouts=false")
    return None


def _validate_async(cfg: Config) -> None:
    """`ppo.max_staleness`: an int >= 0; > 0 only where the asynchronous step can run
    (`_async_refusal`)."""
    s = cfg.ppo.max_staleness
    if isinstance(s, bool) or not isinstance(s, int) or s < 0:
        raise ConfigError(f"ppo.max_staleness={s!r} must be an int >= 0 (0: the synchronous "
                          "step)")
    why = _async_refusal(cfg) if s and cfg.stage == "ppo" else None
    if why is not None:
        raise ConfigError(f"ppo.max_staleness={s} (asynchronous rollouts) cannot run with {why}")


def _validate_ppo(p: PPOConfig) -> None:
    """The PPO algorithm's sizes, ranges, choices and kwargs."""
    for name in ("batch_size", "mini_batch_size", "micro_batch_size", "ppo_epochs", "horizon"):
        _positive(f"ppo.{name}", getattr(p, name))
    if p.batch_size % p.mini_batch_size:
        raise ConfigError(
            f"ppo.batch_size={p.batch_size} is not a multiple of ppo.mini_batch_size={p.mini_batch_size}")
    if p.mini_batch_size % p.micro_batch_size:
        raise ConfigError(
            f"ppo.mini_batch_size={p.mini_batch_size} is not a multiple of "
            f"ppo.micro_batch_size={p.micro_batch_size}")
    for name in ("cliprange", "cliprange_value", "target_kl"):
        _positive(f"ppo.{name}", getattr(p, name))
    if p.kl_coef < 0:
        raise ConfigError(f"ppo.kl_coef={p.kl_coef!r} must be >= 0")
    _validate_gae(p)
    for name in ("reward_shaping_kwargs", "advantage_kwargs", "policy_loss_kwargs", "value_loss_kwargs"):
        for key, value in getattr(p, name).items():
            if not isinstance(value, (bool, int, float, str, type(None))):
                raise ConfigError(f"ppo.{name}.{key}={value!r}: values must be scalars or strings")
    for name in ("cliprange_high", "reward_clip"):
        if getattr(p, name) is not None:
            _positive(f"ppo.{name}", getattr(p, name))
    if p.dual_clip is not None and not p.dual_clip > 1:
        raise ConfigError(f"ppo.dual_clip={p.dual_clip!r} must be > 1 (or null)")
    if p.score_scale == 0:  # negative is allowed: it turns a reward into a cost
        raise ConfigError("ppo.score_scale=0.0 would ignore the reward; use a non-zero scale")
    if p.vf_coef < 0:
        raise ConfigError(f"ppo.vf_coef={p.vf_coef!r} must be >= 0")
    _validate_loss_terms(p)


def _validate_gae(p: PPOConfig) -> None:
    """The discount and the GAE lambdas (the policy's, the critic's, VAPO's length-adaptive
    alpha) and the GAE method. With a critic-free estimator, ppo.critic_lam and
    ppo.lam_length_alpha are refused as settings with no effect (`config.no_effect`)."""
    if not (0.0 <= p.gamma <= 1.0) or not (0.0 <= p.lam <= 1.0):
        raise ConfigError(f"ppo.gamma={p.gamma!r} and ppo.lam={p.lam!r} must lie in [0, 1]")
    if p.critic_lam is not None and not 0.0 <= p.critic_lam <= 1.0:
        raise ConfigError(f"ppo.critic_lam={p.critic_lam!r} must lie in [0, 1] (or null: ppo.lam)")
    if p.lam_length_alpha < 0:
        raise ConfigError(f"ppo.lam_length_alpha={p.lam_length_alpha!r} must be >= 0 (0: off)")
    for key in ("critic_lam", "lam_length_alpha"):  # passed only when set: refused here always
        if key in p.advantage_kwargs:
            raise ConfigError(f"ppo.advantage_kwargs.{key}: the trainer passes {key} itself "
                              f"(set it through ppo.{key})")
    if p.advantage_estimator == "gae" and "method" in p.advantage_kwargs:
        _choice("ppo.advantage_kwargs.method", p.advantage_kwargs["method"], GAE_METHODS)


def _validate_optim_train(o: OptimConfig, t: TrainConfig) -> None:
    """The optimiser and outer-loop settings."""
    _positive("optim.actor_lr", o.actor_lr)
    _positive("optim.critic_lr", o.critic_lr)
    _positive("optim.eps", o.eps)
    for name in ("b1", "b2"):
        if not 0.0 <= getattr(o, name) < 1.0:
            raise ConfigError(f"optim.{name}={getattr(o, name)!r} must lie in [0, 1)")
    for name in ("warmup_steps", "weight_decay", "max_grad_norm"):  # max_grad_norm 0 = no clipping
        if getattr(o, name) < 0:
            raise ConfigError(f"optim.{name}={getattr(o, name)!r} must be >= 0")
    _positive("train.log_every", t.log_every)
    _positive("train.max_to_keep", t.max_to_keep)
    for name in ("seed", "sample_every", "num_samples", "save_every"):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name}={getattr(t, name)!r} must be >= 0")
    check_loggers(t.loggers)  # known names, their packages installed (nothing imported)
    check_tracker_setup(t)


def _validate_loss_terms(p: PPOConfig) -> None:
    """ppo.loss_aggregation, the built-in loss terms (entropy bonus, KL in the loss), the
    rollout correction, and the policy loss's kwargs (`config.loss_checks`)."""
    for name in ("entropy_coef", "kl_loss_coef"):
        if getattr(p, name) < 0:
            raise ConfigError(f"ppo.{name}={getattr(p, name)!r} must be >= 0")
    band = (p.rollout_correction_band_low, p.rollout_correction_band_high)
    try:
        check_rollout_correction(p.rollout_correction, p.rollout_correction_cap, band)
    except ValueError as e:
        setting = (f"ppo.rollout_correction_band_low={band[0]!r}, ppo.rollout_correction_band_high="
                   f"{band[1]!r}" if p.rollout_correction == "icepop" else
                   f"ppo.rollout_correction_cap={p.rollout_correction_cap!r}")
        raise ConfigError(f"ppo.rollout_correction={p.rollout_correction!r}, {setting}: {e}") from None
    check_policy_loss(p)


def _validate_lora(cfg: Config) -> None:
    """model.lora: a rank >= 0; with rank > 0 a positive alpha, known target names once each,
    and no setting that would leave it without effect."""
    lora = cfg.model.lora
    if lora.rank < 0:
        raise ConfigError(f"model.lora.rank={lora.rank!r} must be >= 0 (0: no LoRA)")
    if not lora.rank:
        for key in ("critic", "adapter"):
            if getattr(lora, key):
                raise ConfigError(f"model.lora.{key}={getattr(lora, key)!r} needs "
                                  "model.lora.rank > 0")
        return
    _positive("model.lora.alpha", lora.alpha)
    known = sorted({n for names in LORA_TARGETS.values() for n in names})
    bad = [t for t in lora.target_modules if t not in known]
    if bad or not lora.target_modules or len(set(lora.target_modules)) < len(lora.target_modules):
        what = ("unknown " + str(bad) if bad else "empty" if not lora.target_modules
                else "a name given twice")
        raise ConfigError(f"model.lora.target_modules={list(lora.target_modules)}: {what}; "
                          f"PEFT's names are {known}")
    if lora.critic and (cfg.stage != "ppo" or cfg.model.shared_critic):
        raise ConfigError("model.lora.critic=true applies to a separate PPO critic only "
                          f"(stage={cfg.stage!r}, model.shared_critic={cfg.model.shared_critic})")
    if cfg.stage == "reward_model" and cfg.reward_model.backbone_lr_scale == 0:
        raise ConfigError("reward_model.backbone_lr_scale=0 freezes the adapters of "
                          "model.lora.rank > 0 (they sit in the backbone): only the score head "
                          "would train; use model.lora.rank=0 for a linear probe, or a "
                          "backbone_lr_scale > 0")


def _validate_eval(e: EvalConfig) -> None:
    """The `eval` block's sizes (its prompt file is read by the PPO stage before loading)."""
    for name in ("num_prompts", "temperature", "samples_per_prompt"):
        _positive(f"eval.{name}", getattr(e, name))
    if e.max_new_tokens is not None:
        _positive("eval.max_new_tokens", e.max_new_tokens)
    for name in ("every", "seed", "num_samples"):
        if getattr(e, name) < 0:
            raise ConfigError(f"eval.{name}={getattr(e, name)!r} must be >= 0")
    if e.prompts is not None and not e.prompts.strip():
        raise ConfigError("eval.prompts='' must be a prompt file (or null for no evaluation)")


def _validate_task(cfg: Config) -> None:
    """`data.task` (a reasoning-gym task) and the prompt sources that name it ('task')."""
    task, uses = cfg.data.task, [k for k, v in (("data.prompts", cfg.data.prompts),
                                                ("eval.prompts", cfg.eval.prompts)) if v == "task"]
    if uses and not task.name:
        raise ConfigError(f"{uses[0]}='task' needs data.task.name (a reasoning-gym dataset)")
    if task.name and not uses:
        raise ConfigError(f"data.task.name={task.name!r} is set but no prompts come from it: set "
                          "data.prompts: task (and eval.prompts: task for held-out problems)")
    if task.name:
        _positive("data.task.size", task.size)
        if cfg.eval.prompts == "task" and cfg.eval.task_seed == task.seed:
            raise ConfigError(f"eval.task_seed={cfg.eval.task_seed} equals data.task.seed: the "
                              "held-out problems must come from another seed")
    if not isinstance(cfg.reward.function_kwargs, dict):
        raise ConfigError(f"reward.function_kwargs={cfg.reward.function_kwargs!r} must be a mapping")


def _validate_plain_instruction(cfg: Config) -> None:
    """`eval.plain_instruction`: the held-out task problems asked again without the tag, scored
    by the reward function's `accuracy_format_free` (docs/rlvr.md)."""
    text, e = cfg.eval.plain_instruction, cfg.eval
    if text is None:
        return
    if not text.strip() or TAG_MENTION.search(text):
        raise ConfigError(f"eval.plain_instruction={text!r} must be a non-empty instruction "
                          "that never mentions the <answer> tag")
    if e.prompts != TASK_SOURCE or cfg.reward.kind != "function" or cfg.env.name:
        raise ConfigError(f"eval.plain_instruction={text!r} re-asks the held-out problems of "
                          f"data.task: it needs eval.prompts: task (it is {e.prompts!r}), "
                          f"reward.kind: function (it is {cfg.reward.kind!r}) and no env.name "
                          f"(it is {cfg.env.name!r})")


def _validate_stage(cfg: Config) -> None:
    """The settings of the stage that runs (sft / reward_model): data, sizes, model source."""
    if cfg.stage == "ppo":
        return
    sec = getattr(cfg, cfg.stage)
    name = cfg.stage
    if not sec.data:
        raise ConfigError(f"stage={name!r} needs {name}.data (a .jsonl / .json / .parquet file)")
    for key in ("max_length", "batch_size", "micro_batch_size", "lr"):
        _positive(f"{name}.{key}", getattr(sec, key))
    if sec.batch_size % sec.micro_batch_size:
        raise ConfigError(f"{name}.batch_size={sec.batch_size} is not a multiple of "
                          f"{name}.micro_batch_size={sec.micro_batch_size}")
    if not 0.0 <= sec.eval_fraction < 1.0:
        raise ConfigError(f"{name}.eval_fraction={sec.eval_fraction!r} must lie in [0, 1)")
    if sec.eval_every < 0:
        raise ConfigError(f"{name}.eval_every={sec.eval_every!r} must be >= 0")
    if sec.backbone_lr_scale < 0 or (name == "sft" and sec.backbone_lr_scale != 1.0):
        raise ConfigError(f"{name}.backbone_lr_scale={sec.backbone_lr_scale!r}: "
                          + ("a causal LM has no separate head; it must be 1" if name == "sft"
                             else "must be >= 0 (0 freezes the backbone)"))
    if cfg.data.max_prompt_length >= sec.max_length:
        raise ConfigError(f"data.max_prompt_length={cfg.data.max_prompt_length} leaves no room for "
                          f"a response in {name}.max_length={sec.max_length}")
    if name == "reward_model" and not cfg.model.reward_model:
        raise ConfigError("stage='reward_model' needs model.reward_model: the model to start from "
                          "(a causal LM such as 'smollm2' or an SFT output gets a fresh score head)")


# name in `train.loggers` -> (module imported, pip package that provides it); the trackers
# themselves: `trainer.tracking.loggers`
LOGGERS = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny (or mlflow)")}


def check_loggers(names, key: str = "train.loggers") -> None:
    """Refuse unknown, repeated or uninstalled tracker names (reads no file, imports nothing).

    Raises:
      ConfigError: naming `key`, the value, and the known names or the pip package to install.
    """
    names = list(names)
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(f"{key}={names!r}: {name!r} is not one of {list(LOGGERS)} "
                              "(metrics.jsonl is always written; TensorBoard: train.tensorboard)")
        module, package = LOGGERS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{key}={names!r}: {name!r} needs the {module} package, which is "
                              f"not installed: pip install {package}")
    if len(set(names)) < len(names):
        raise ConfigError(f"{key}={names!r}: a name given twice")


def check_tracker_setup(t: TrainConfig, environ=os.environ) -> None:
    """What a named tracker could only refuse at start: an MLflow database store (sqlite, ...)
    that the installed client cannot open (mlflow-skinny has no SQL stores), and W&B's online
    mode (`WANDB_MODE=online`) without an API key, which W&B itself refuses.

    Raises:
      ConfigError: naming the key or variable and what to install or set.
    """
    uri, key = t.mlflow_tracking_uri, "train.mlflow_tracking_uri"
    if not uri:
        uri, key = environ.get("MLFLOW_TRACKING_URI"), "MLFLOW_TRACKING_URI"
    if ("mlflow" in t.loggers and uri and database_uri(uri)
            and not all(importlib.util.find_spec(m) for m in DATABASE_MODULES)):
        raise ConfigError(f"{key}={uri!r}: a database store, which the installed MLflow client "
                          "(mlflow-skinny) cannot open: pip install mlflow (the full package) "
                          "for database stores, or use file:DIR or http://HOST:PORT")
    host = environ.get("WANDB_BASE_URL") or WANDB_HOST
    if ("wandb" in t.loggers and environ.get("WANDB_MODE") == "online"
            and not has_wandb_key(environ, host)):
        raise ConfigError(f"train.loggers={list(t.loggers)!r} with WANDB_MODE=online: W&B has no "
                          f"API key for {host}: set WANDB_API_KEY or run `wandb login` (or unset "
                          "WANDB_MODE: without a key the run's W&B logs stay offline)")
