"""Settings refused where they have no effect: one table (`NO_EFFECT`) of the keys that another
setting leaves unread, each with the condition under which nothing reads it and why.

A key counts as set when its value differs from the schema's default. So a file that spells
out a default is never refused for it, and neither is the config.json a run writes, which
holds every key. `check_no_effect` runs last in `validate`, at load: before anything is
compiled or written, after the checks that name a value out of range. docs/config.md renders
the table (scripts/config_reference.py), so the page lists exactly what is refused.

A condition of the PPO sections holds in stage=ppo only: stage=sft and stage=reward_model read
none of them, and a PPO config run as another stage (its sections kept) is not refused for it.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ppo_jax.core import estimators as _estimators
from ppo_jax.core.loss_kwargs import reads_cliprange
from ppo_jax.core.registry import get_advantage_estimator, get_policy_loss, registered_names
from ppo_jax.trainer.config.fields import ConfigError
from ppo_jax.trainer.config.help import leaves
from ppo_jax.trainer.config.schema import Config, SupervisedConfig


@dataclass(frozen=True)
class Condition:
    """A state of the config in which some settings are never read.

    name: the state in words (docs/config.md's "refused when"); keys: the settings that decide
    it, shown with their values in the error; holds: whether `cfg` is in it; means: what the
    run does instead, after those values; fix: what to set instead of dropping the setting."""

    name: str
    keys: tuple[str, ...]
    holds: Callable[[Config], bool]
    means: str
    fix: str


@dataclass(frozen=True)
class NoEffect:
    """`key` is not read when `when` holds; `why` says what it would have done."""

    key: str
    when: Condition
    why: str

    def message(self, cfg: Config, value: Any) -> str:
        """The one error line: the setting and its value, the state, why, what to do."""
        state = ", ".join(f"{k}={value_of(cfg, k)!r}" for k in self.when.keys)
        return (f"{self.key}={value!r} has no effect: {state} {self.when.means} ({self.why}); "
                f"drop it or {self.when.fix}")


def value_of(cfg: Config, key: str) -> Any:
    """The value of the dotted `key` in `cfg` (`ppo.vf_coef` -> `cfg.ppo.vf_coef`)."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _estimator(cfg: Config) -> Optional[Callable]:
    """The configured advantage estimator, or None for an unknown name (`stages.ppo.load_checks`
    names it, with the known ones)."""
    try:
        return get_advantage_estimator(cfg.ppo.advantage_estimator)
    except ValueError:
        return None


def _trains_critic(cfg: Config) -> Optional[bool]:
    """Whether a PPO run's estimator trains a critic (None: not a PPO run, or an unknown
    estimator)."""
    fn = _estimator(cfg) if cfg.stage == "ppo" else None
    return None if fn is None else _estimators.uses_critic(fn)


def _builtin_ignores(arg: str) -> Callable[[Callable], bool]:
    """Whether an estimator is one of `core.estimators` and takes no parameter `arg` (it lands
    in its `**unused`)."""
    return lambda fn: (fn.__module__ == _estimators.__name__
                       and arg not in inspect.signature(fn).parameters)


def _builtins_where(pred: Callable[[Callable], bool]) -> str:
    """The built-in estimators (`core.estimators`) `pred` holds for, by name (the text of a
    condition)."""
    fns = {n: get_advantage_estimator(n) for n in registered_names()["advantage estimator"]}
    return ", ".join(n for n, fn in fns.items()
                     if fn.__module__ == _estimators.__name__ and pred(fn))


def _estimator_ignores(arg: str) -> Condition:
    """The built-in estimators that never read the trainer's `gamma` / `lam`."""
    ignores = _builtin_ignores(arg)
    readers = _builtins_where(lambda fn: not ignores(fn))
    return Condition(
        f"a built-in ppo.advantage_estimator that reads no {arg} "
        f"({_builtins_where(ignores)})", ("ppo.advantage_estimator",),
        lambda cfg: cfg.stage == "ppo" and (fn := _estimator(cfg)) is not None and ignores(fn),
        f"reads no {arg}", f"use an estimator that does ({readers})")


def _ppo(pred: Callable[[Config], bool]) -> Callable[[Config], bool]:
    return lambda cfg: cfg.stage == "ppo" and pred(cfg)


CRITIC_FREE = Condition(
    "a critic-free ppo.advantage_estimator "
    f"({_builtins_where(lambda fn: not _estimators.uses_critic(fn))}, or a fork's with "
    "uses_critic = False)", ("ppo.advantage_estimator",),
    lambda cfg: _trains_critic(cfg) is False, "trains no critic", "use 'gae'")
SEPARATE_CRITIC = Condition(
    "model.shared_critic=false with an estimator that trains a critic (gae)",
    ("model.shared_critic",),
    lambda cfg: not cfg.model.shared_critic and _trains_critic(cfg) is True,
    "trains a separate critic on the value loss alone, with its own optimiser",
    "set model.shared_critic=true")
FIXED_KL = Condition("ppo.kl_controller=fixed", ("ppo.kl_controller",),
                     _ppo(lambda cfg: cfg.ppo.kl_controller == "fixed"),
                     "keeps ppo.kl_coef constant", "set ppo.kl_controller=adaptive")
NO_DYNAMIC_SAMPLING = Condition("ppo.dynamic_sampling=false", ("ppo.dynamic_sampling",),
                                _ppo(lambda cfg: not cfg.ppo.dynamic_sampling),
                                "draws one batch per step", "set ppo.dynamic_sampling=true")
NO_OVERLONG = Condition("ppo.overlong_buffer=0", ("ppo.overlong_buffer",),
                        _ppo(lambda cfg: cfg.ppo.overlong_buffer == 0),
                        "turns DAPO's overlong shaping off", "set ppo.overlong_buffer > 0")
NO_CORRECTION = Condition("ppo.rollout_correction=none", ("ppo.rollout_correction",),
                          _ppo(lambda cfg: cfg.ppo.rollout_correction == "none"),
                          "weights no policy-loss token", "set ppo.rollout_correction=tis or mis")
CAPLESS_CORRECTION = Condition(
    "ppo.rollout_correction=icepop", ("ppo.rollout_correction",),
    _ppo(lambda cfg: cfg.ppo.rollout_correction == "icepop"),
    "keeps a token's weight inside its band and drops it outside", "set ppo.rollout_correction=tis "
    "or mis")
NOT_ICEPOP = Condition(
    "ppo.rollout_correction is not icepop", ("ppo.rollout_correction",),
    _ppo(lambda cfg: cfg.ppo.rollout_correction != "icepop"), "masks no token by a band",
    "set ppo.rollout_correction=icepop")


def _policy_loss(cfg: Config) -> Optional[Callable]:
    """The configured policy loss, or None for a name not registered (yet)."""
    try:
        return get_policy_loss(cfg.ppo.policy_loss)
    except ValueError:
        return None


_NO_CLIP_BUILTINS = ", ".join(n for n in registered_names()["policy loss"]
                              if not reads_cliprange(get_policy_loss(n)))
NO_CLIP = Condition(
    f"a ppo.policy_loss that reads no cliprange ({_NO_CLIP_BUILTINS}, or a fork's with "
    "reads_cliprange = False)", ("ppo.policy_loss",),
    _ppo(lambda cfg: (fn := _policy_loss(cfg)) is not None and not reads_cliprange(fn)),
    "clips no ratio", "use a loss that clips (ppo_clip, gspo, cispo, ...)")
NO_KL_LOSS = Condition("ppo.kl_loss_coef=0", ("ppo.kl_loss_coef",),
                       _ppo(lambda cfg: cfg.ppo.kl_loss_coef == 0),
                       "adds no KL term to the policy loss", "set ppo.kl_loss_coef > 0")
STATIC_ENGINE = Condition("generation.engine=static", ("generation.engine",),
                          _ppo(lambda cfg: cfg.generation.engine == "static"),
                          "samples with the static batch sampler",
                          "set generation.engine=paged")
COLOCATED = Condition("generation.placement=colocated", ("generation.placement",),
                      _ppo(lambda cfg: cfg.generation.placement == "colocated"),
                      "samples on the trainer's own devices", "set generation.placement=split")
SPLIT = Condition("generation.placement=split", ("generation.placement",),
                  _ppo(lambda cfg: cfg.generation.placement == "split"),
                  "lays the rollout copy out over the rollout mesh's tensor axis (it has no "
                  "fsdp axis)", "set generation.placement=colocated")
SYNCHRONOUS = Condition("ppo.max_staleness=0", ("ppo.max_staleness",),
                        _ppo(lambda cfg: cfg.ppo.max_staleness == 0),
                        "samples each batch under the weights of the step that takes it",
                        "set ppo.max_staleness > 0 (docs/async_rl.md)")
CONSISTENT = Condition("generation.partial_rollouts=false", ("generation.partial_rollouts",),
                       _ppo(lambda cfg: cfg.generation.partial_rollouts is False),
                       "lets the live responses finish under the old weights before a switch",
                       "set generation.partial_rollouts=true")
NO_ENV = Condition("env.name=null", ("env.name",), _ppo(lambda cfg: cfg.env.name is None),
                   "runs no environment: one response per prompt, scored by reward.*",
                   "set env.name")
REWARD_MODEL = Condition("reward.kind=model", ("reward.kind",),
                         _ppo(lambda cfg: cfg.reward.kind == "model"),
                         "scores with model.reward_model", "set reward.kind=function")
NO_TASK = Condition("data.task.name=null", ("data.task.name",),
                    lambda cfg: cfg.data.task.name is None, "draws no reasoning-gym problems",
                    "set data.task.name (with data.prompts: task)")
NOT_DISTRIBUTED = Condition("distributed.enabled=false", ("distributed.enabled",),
                            lambda cfg: not cfg.distributed.enabled,
                            "never calls jax.distributed.initialize",
                            "set distributed.enabled=true")
ONE_SEQUENCE = Condition("stage=sft with sft.micro_batch_size=1", ("sft.micro_batch_size",),
                         lambda cfg: cfg.stage == "sft" and cfg.sft.micro_batch_size == 1,
                         "runs one sequence a forward pass, alone in its row",
                         "raise sft.micro_batch_size")
ONE_ROLLOUT = Condition("stage=ppo with ppo.micro_batch_size=1 and no ppo.micro_batch_tokens",
                        ("ppo.micro_batch_size", "ppo.micro_batch_tokens"),
                        lambda cfg: cfg.stage == "ppo" and cfg.ppo.micro_batch_size == 1
                        and cfg.ppo.micro_batch_tokens is None,
                        "runs one sequence a forward pass, alone in its row",
                        "raise ppo.micro_batch_size or set ppo.micro_batch_tokens")
UNPACKED = Condition("ppo.packing=false", ("ppo.packing",), lambda cfg: not cfg.ppo.packing,
                     "runs padded rows", "set ppo.packing=true")


def _other_stage(stage: str, what: str) -> Condition:
    return Condition(f"stage is not {stage}", ("stage",), lambda cfg: cfg.stage != stage,
                     f"does not run {what}", f"set stage={stage}")


def _section(stage: str, what: str) -> list[NoEffect]:
    """Every key of the `sft` / `reward_model` section: read by its own stage only."""
    when = _other_stage(stage, what)
    return [NoEffect(f"{stage}.{f.name}", when, f"the {stage} section is read by stage={stage} "
                     "only") for f in dataclasses.fields(SupervisedConfig)]


_NEEDS_CRITIC = "it needs a critic: "
_NO_VALUE_LOSS = "the value loss is not computed"
_ENGINE = "a setting of the paged engine: "
_EPISODES = "a setting of the multi-turn episodes: "
_TASK = "a setting of data.task's problems: "
_PROCESSES = "it is an argument of that call only"

NO_EFFECT: tuple[NoEffect, ...] = (
    NoEffect("model.shared_critic", CRITIC_FREE, _NEEDS_CRITIC + "the value head on the actor"),
    NoEffect("ppo.critic_warmup_steps", CRITIC_FREE,
             _NEEDS_CRITIC + "the first steps train it alone"),
    NoEffect("model.critic", CRITIC_FREE, _NEEDS_CRITIC + "the model it starts from"),
    NoEffect("model.lora.critic", CRITIC_FREE, _NEEDS_CRITIC + "LoRA adapters on it"),
    NoEffect("ppo.critic_lam", CRITIC_FREE, _NEEDS_CRITIC + "the lambda of its GAE targets"),
    NoEffect("ppo.lam_length_alpha", CRITIC_FREE,
             _NEEDS_CRITIC + "VAPO's length-adaptive lambda is one of GAE on its values"),
    NoEffect("ppo.vf_coef", CRITIC_FREE, _NO_VALUE_LOSS),
    NoEffect("ppo.value_loss", CRITIC_FREE, _NO_VALUE_LOSS),
    NoEffect("ppo.value_loss_kwargs", CRITIC_FREE, _NO_VALUE_LOSS),
    NoEffect("ppo.cliprange_value", CRITIC_FREE,
             "it clips the values in the value loss, which is not computed"),
    NoEffect("optim.critic_lr", CRITIC_FREE, "no critic optimiser is built"),
    NoEffect("ppo.lam", _estimator_ignores("lam"), "GAE's lambda"),
    NoEffect("ppo.gamma", _estimator_ignores("gamma"), "the discount of the returns"),
    NoEffect("ppo.vf_coef", SEPARATE_CRITIC,
             "it weighs the value loss in the loss pg + vf_coef * vf of a value head on the "
             "actor"),
    NoEffect("ppo.target_kl", FIXED_KL, "the adaptive controller's KL target"),
    NoEffect("ppo.horizon", FIXED_KL, "the adaptive controller's horizon"),
    NoEffect("ppo.max_sampling_rounds", NO_DYNAMIC_SAMPLING,
             "it caps the batches dynamic sampling draws per step"),
    NoEffect("ppo.overlong_penalty_factor", NO_OVERLONG, "it scales the overlong penalty"),
    NoEffect("ppo.rollout_correction_cap", NO_CORRECTION, "the cap C of the tis / mis weights"),
    NoEffect("ppo.rollout_correction_cap", CAPLESS_CORRECTION,
             "the cap C of the tis / mis weights"),
    NoEffect("ppo.rollout_correction_band_low", NOT_ICEPOP, "the low end of icepop's band"),
    NoEffect("ppo.rollout_correction_band_high", NOT_ICEPOP, "the high end of icepop's band"),
    NoEffect("ppo.cliprange", NO_CLIP, "the clip range of the importance ratio"),
    NoEffect("ppo.kl_loss_estimator", NO_KL_LOSS, "the estimator of that KL term"),
    *(NoEffect(f"generation.{k}", STATIC_ENGINE, _ENGINE + what) for k, what in (
        ("page_size", "tokens per KV page"), ("num_pages", "the KV page pool"),
        ("max_concurrent", "decode slots"), ("decode_chunk", "tokens per decode chunk"),
        ("decode_buckets", "page-table widths"), ("attention", "attention over the pages"))),
    *(NoEffect(f"env.{k}", NO_ENV, _EPISODES + what) for k, what in (
        ("kwargs", "the environment's factory arguments"), ("max_turns", "turns per episode"),
        ("max_observation_tokens", "the length of an observation"),
        ("timeout_s", "the time an environment step may take"),
        ("concurrency", "the environment calls run at once"),
        ("max_failed_steps", "failed steps before the run stops"),
        ("stop_strings", "the text that ends a turn"),
        ("observation_role", "the chat role of an observation"))),
    NoEffect("generation.rollout_devices", COLOCATED, "the size of a separate rollout group"),
    NoEffect("generation.rollout_layout", SPLIT,
             "it picks between the training layout and one without fsdp on the trainer's mesh"),
    NoEffect("generation.partial_rollouts", SYNCHRONOUS,
             "it says when new weights reach responses already decoding"),
    NoEffect("generation.kv_on_switch", SYNCHRONOUS, "what a weight switch does to the KV cache"),
    NoEffect("generation.kv_on_switch", CONSISTENT,
             "no response is decoding when new weights come in"),
    NoEffect("reward.function", REWARD_MODEL, "no reward function is built"),
    NoEffect("reward.function_kwargs", REWARD_MODEL, "no reward function is built"),
    NoEffect("reward.timeout_s", REWARD_MODEL, "no reward function is called"),
    *(NoEffect(f"data.task.{k}", NO_TASK, _TASK + what) for k, what in (
        ("kwargs", "the dataset's arguments"), ("size", "how many are drawn"),
        ("seed", "the seed they are drawn from"), ("instruction", "the text after a question"))),
    *(NoEffect(f"distributed.{k}", NOT_DISTRIBUTED, _PROCESSES)
      for k in ("coordinator_address", "num_processes", "process_id")),
    NoEffect("sft.packing", ONE_SEQUENCE,
             "it packs the sequences of a micro-batch several to a row"),
    NoEffect("ppo.packing", ONE_ROLLOUT,
             "it packs the sequences of a micro-batch several to a row"),
    NoEffect("ppo.micro_batch_tokens", UNPACKED,
             "it sizes the update's micro-batches of packed rows"),
    *_section("sft", "stage 1"),
    *_section("reward_model", "stage 2"),
)

DEFAULTS = {key: value for key, value, _ in leaves(Config())}


def check_no_effect(cfg: Config) -> None:
    """Refuse a setting that differs from its default where nothing reads it (`NO_EFFECT`).

    Raises:
      ConfigError: naming the setting and its value, the settings that leave it unread with
        theirs, why it does nothing, and what to set instead.
    """
    for row in NO_EFFECT:
        value = value_of(cfg, row.key)
        if value != DEFAULTS[row.key] and row.when.holds(cfg):
            raise ConfigError(row.message(cfg, value))
