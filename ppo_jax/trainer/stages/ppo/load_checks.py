"""The start-up checks of a PPO run that need more than the config (the registry, the prompt
files, the mesh, the model's config); what the config alone decides is checked when it loads
(`trainer.config.checks`). In the order the trainer makes them:

- `check_names` and `check_prompt_files` (`PPOTrainer._check_inputs`, nothing loaded): the
  registered functions the config names, and the prompt files' rows against the reward
  function's fields, then the reward function called once on placeholder responses to their
  first records (`probe_reward`);
- `check_placement` (the mesh known, no model loaded): the batch on the mesh, the paged
  engine's sizes;
- `check_kernel` (the actor's config.json read): the TPU attention kernel against its shapes.

The registered functions are checked with the settings the trainer builds
(`stages.ppo.settings`), so the check makes exactly the trainer's call.

Each registered function named by the config (reward shaping, advantage estimator, policy loss,
value loss) is looked up, its signature is bound to the exact call the trainer will make, and it
is run on two tiny batches of ones (B = 1, T = 2, then B = 2, T = 3: a slice or a fixed size
that fits one shape does not fit both) with the configured arguments; its outputs must have
the shapes the trainer reduces. A formula that cannot run fails here with a `ConfigError`
naming the key, not in the middle of the first step.
"""

from __future__ import annotations

import inspect
import math
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ppo_jax.core import (
    KL_ESTIMATORS,
    LossInputs,
    get_advantage_estimator,
    get_policy_loss,
    get_reward_shaping,
    get_value_loss,
    needs_greedy_baseline,
    needs_groups,
)
from ppo_jax.parallel.transfer import uncovered
from ppo_jax.rollout.engine_layout import check_page_size, engine_layout
from ppo_jax.trainer.config import Config, ConfigError, eval_enabled
from ppo_jax.trainer.data.prompts import prompt_records
from ppo_jax.trainer.environments import Environment, build_environment, episode_prompts
from ppo_jax.trainer.rewards.calls import (
    RewardFunction, RewardFunctionError, probe_reward_function, with_timeout,
)
from ppo_jax.trainer.rewards.deadline import Expired, call_with_deadline
from ppo_jax.trainer.rewards.functions import check_prompt_rows, get_reward_function, probes
from ppo_jax.trainer.stages.packing import check_packing
from ppo_jax.trainer.stages.ppo.evaluation import eval_rows_multiple
from ppo_jax.trainer.stages.ppo.settings import engine_settings, settings_for

SHAPES = ((1, 2), (2, 3))  # (B, T) of the test batches: B != T, and both unlike the first's
_TOKENS = "[B, T]"
_OLD_LOSS_HINT = (" (a registered loss takes one LossInputs batch and returns a per-token loss "
                  "[B, T] and per-token stats; docs/forks.md)")


def _test_batch(B: int, T: int) -> LossInputs:
    ones = jnp.ones((B, T), jnp.float32)
    fields = {f: ones for f in LossInputs._fields if f not in ("mask", "group_ids")}
    return LossInputs(mask=jnp.ones((B, T), jnp.int32), group_ids=jnp.zeros((B,), jnp.int32),
                      **fields)


def _shape_problem(out: Any, spec: tuple, B: int, T: int) -> str | None:
    """None when `out` is a tuple matching `spec` (a shape, or "stats": a dict of [B, T])."""
    if not isinstance(out, tuple) or len(out) != len(spec):
        return f"{type(out).__name__} instead of a tuple of {len(spec)}"
    for i, (item, want) in enumerate(zip(out, spec)):
        if want == "stats":
            if not isinstance(item, dict):
                return f"output {i} (stats) is a {type(item).__name__}, not a dict"
            bad = {k: jnp.shape(v) for k, v in item.items() if jnp.shape(v) != (B, T)}
            if bad:
                return f"stats of shapes {bad} instead of per-token {_TOKENS} = {(B, T)}"
        elif jnp.shape(item) != want:
            return f"output {i} of shape {jnp.shape(item)} instead of {want}"
    return None


def _check_one(key: str, name: str, getter: Callable, args: dict, kwargs: dict, spec: tuple,
               shape: tuple[int, int]) -> None:
    """Look up, bind, run once on a test batch of `shape` (B, T) and check the output shapes
    of one registered function: on the first of `SHAPES` eagerly, on the others traced
    (`jax.eval_shape`, as the trainer's jitted step traces it: shapes, no compiling).

    Raises:
      ConfigError: naming `key`, the function and what failed.
    """
    try:
        fn = getter(name)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None
    hint = _OLD_LOSS_HINT if "loss" in key else ""
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        raise ConfigError(
            f"{key}={name!r}: {getattr(fn, '__name__', fn)}{inspect.signature(fn)} cannot be "
            f"called as the trainer calls it, fn({', '.join(args)}, "
            f"{', '.join(f'{k}=' for k in kwargs)}): {e}{hint}") from None
    B, T = shape
    try:  # and runs with the configured arguments (a bad method or clip fails here, not mid-step)
        if shape == SHAPES[0]:
            out = fn(*args.values(), **kwargs)
            out = jax.tree.map(jnp.asarray, out) if isinstance(out, tuple) else out
        else:
            out = jax.eval_shape(partial(fn, **kwargs), *args.values())
    except Exception as e:  # noqa: BLE001 - any failure of the user's function is reported
        raise ConfigError(f"{key}={name!r} fails on a {B}x{T} test batch with the configured "
                          f"arguments {kwargs}: {type(e).__name__}: {e}") from None
    problem = _shape_problem(out, spec, B, T)
    if problem:
        fits = (f" (right on the {SHAPES[0][0]}x{SHAPES[0][1]} one: outputs must follow the "
                "batch's B and T, not a fixed size or slice)" if shape != SHAPES[0] else "")
        raise ConfigError(f"{key}={name!r} returns {problem} on a {B}x{T} test batch{fits}{hint}")


def _calls(cfg: Config, B: int, T: int) -> list:
    """(key, name, getter, positional args, the trainer's own kwargs, config kwargs, output spec)
    on a test batch of B x T."""
    p = cfg.ppo
    settings = settings_for(cfg)
    upd, exp = settings.update, settings.experience
    tok, row = jnp.ones((B, T), jnp.float32), jnp.ones((B,), jnp.float32)
    mask = jnp.ones((B, T), jnp.int32)
    return [
        ("ppo.reward_shaping", p.reward_shaping, get_reward_shaping,
         {"scores": row, "ended": jnp.ones((B,), bool), "logprobs": tok, "ref_logprobs": tok,
          "mask": mask}, exp.shaping_fixed_kwargs(jnp.float32(p.kl_coef)),
         ("reward_shaping_kwargs", p.reward_shaping_kwargs), ((B, T), (B, T), (B,))),
        ("ppo.advantage_estimator", p.advantage_estimator, get_advantage_estimator,
         {"values": tok, "rewards": tok, "mask": mask},
         {**exp.estimator_fixed_kwargs(), "scores": row,
          "group_ids": jnp.zeros((B,), jnp.int32), "baseline_scores": row},
         ("advantage_kwargs", p.advantage_kwargs), ((B, T), (B, T))),
        ("ppo.policy_loss", p.policy_loss, get_policy_loss, {"batch": _test_batch(B, T)},
         upd.policy_fixed_kwargs(), ("policy_loss_kwargs", p.policy_loss_kwargs),
         ((B, T), "stats")),
        ("ppo.value_loss", p.value_loss, get_value_loss, {"batch": _test_batch(B, T)},
         {"cliprange_value": upd.cliprange_value}, ("value_loss_kwargs", p.value_loss_kwargs),
         ((B, T), "stats")),
    ]


def check_names(cfg: Config) -> None:
    """Registered names in the config exist, take the arguments the trainer will pass, run on
    a 1x2 and a 2x3 batch and return outputs of the right shapes on both (before anything is
    loaded).

    Raises:
      ConfigError: naming the key, listing the known names or the call that would fail.
    """
    for shape in SHAPES:
        for key, name, getter, args, fixed, (extra_name, extra), spec in _calls(cfg, *shape):
            shadowed = sorted(set(fixed) & set(extra))
            if shadowed:
                raise ConfigError(f"ppo.{extra_name}.{shadowed[0]}: the trainer passes "
                                  f"{shadowed[0]} itself (set it through its own ppo.* field)")
            _check_one(key, name, getter, args, {**fixed, **extra}, spec, shape)
    if cfg.ppo.kl_estimator not in KL_ESTIMATORS:
        raise ConfigError(f"ppo.kl_estimator={cfg.ppo.kl_estimator!r}; known: {list(KL_ESTIMATORS)}")
    if cfg.reward.kind == "function" and not cfg.env.name:
        reward_function(cfg)
    if cfg.env.name:
        environment(cfg)
        if needs_greedy_baseline(get_advantage_estimator(cfg.ppo.advantage_estimator)):
            raise ConfigError(f"env.name={cfg.env.name!r}: ReMax's greedy baseline is a single "
                              "response (ppo.advantage_estimator="
                              f"{cfg.ppo.advantage_estimator!r}); use gae or a group estimator")
    if cfg.ppo.dynamic_sampling and needs_greedy_baseline(
            get_advantage_estimator(cfg.ppo.advantage_estimator)):
        raise ConfigError(f"ppo.dynamic_sampling=true does not sample ReMax's greedy baseline "
                          f"(ppo.advantage_estimator={cfg.ppo.advantage_estimator!r}); use a "
                          "group estimator such as grpo or rloo")
    if (needs_groups(get_advantage_estimator(cfg.ppo.advantage_estimator))
            and cfg.generation.samples_per_prompt < 2):
        raise ConfigError(f"ppo.advantage_estimator={cfg.ppo.advantage_estimator!r} compares the "
                          "samples of a prompt, but generation.samples_per_prompt="
                          f"{cfg.generation.samples_per_prompt}: every score advantage would be "
                          "0 and nothing would train; set generation.samples_per_prompt to 2 or "
                          "more (e.g. 8), or use advantage_estimator=gae")


def check_prompt_files(cfg: Config) -> None:
    """Read `data.prompts`, and `eval.prompts` when evaluating, before any model loads. With a
    reward function, every row must hold the fields it reads, and the function is probed once.
    With `env.name`, every record's episode is started instead, each `reset` within
    `env.timeout_s`.

    Raises:
      FileNotFoundError / ValueError / ConfigError: naming the key and the file; ConfigError
        naming the key, the record and the environment whose `reset` raised, hung past
        `env.timeout_s`, or gave an empty or non-text prompt.
    """
    sources = [("data.prompts", cfg.data.prompts)]
    if eval_enabled(cfg.eval):
        sources.append(("eval.prompts", cfg.eval.prompts))
    env = environment(cfg) if cfg.env.name else None
    reward_fn = reward_function(cfg) if env is None and cfg.reward.kind == "function" else None
    for key, source in sources:
        texts, rows = prompt_records(cfg, source, key)
        if env is not None:  # every record starts an episode (`reset`)
            try:
                episode_prompts(env, texts, rows, key, timeout_s=cfg.env.timeout_s,
                                concurrency=cfg.env.concurrency)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        elif cfg.reward.kind == "function":
            check_prompt_rows(cfg.reward.function, rows, key, source)
            probe_reward(cfg, reward_fn, texts, rows, key)


def environment(cfg: Config) -> Environment:
    """The run's environment: the factory of `env.name` called with `env.kwargs`, within the
    set-up limit of `environments.build_environment`.

    Raises:
      ConfigError: naming `env.name`, the environment and what its factory did.
    """
    try:
        return build_environment(cfg.env.name, cfg.env.kwargs, timeout_s=cfg.env.timeout_s)
    except ValueError as e:
        raise ConfigError(f"env.name: {e}") from None


def reward_function(cfg: Config) -> RewardFunction:
    """The run's reward function: the factory of `reward.function` called with
    `reward.function_kwargs`. The factory and then each call are limited to `reward.timeout_s`.

    Raises:
      ConfigError: an unknown name, kwargs the factory does not take, a factory that raised or
        ran past `reward.timeout_s` (naming `reward.function` and the error or the limit), or a
        `reward.timeout_s` that is not > 0.
    """
    r = cfg.reward
    if r.timeout_s is not None and not r.timeout_s > 0:
        raise ConfigError(f"reward.timeout_s={r.timeout_s!r} must be > 0 seconds (or null: no "
                          "limit)")
    try:
        fn = call_with_deadline(lambda: get_reward_function(r.function, **r.function_kwargs),
                                r.timeout_s)
        return with_timeout(fn, r.timeout_s)
    except Expired:
        raise ConfigError(f"reward.function={r.function!r}: its factory did not return within "
                          f"reward.timeout_s={r.timeout_s:g} s") from None
    except ValueError as e:
        raise ConfigError(f"reward.function: {e}") from None
    except Exception as e:  # noqa: BLE001 - a fork's factory failing is named, not a traceback
        raise ConfigError(f"reward.function={r.function!r}: its factory raised "
                          f"{type(e).__name__}: {e}") from None


def probe_reward(cfg: Config, reward_fn: RewardFunction, texts: list[str], rows: list[dict],
                 key: str) -> None:
    """Call `reward_fn` once before any model loads, as a step will, on the placeholder
    responses '' and '0' to `texts`, the first records of `key`, unless its factory sets
    `probe = False`. With `env.name` the environment scores instead and nothing is called.

    Raises:
      ConfigError: naming `reward.function`, `key` and what the function did (raised, ran past
        `reward.timeout_s`, returned no `score`, the wrong shape, non-numbers or a non-finite
        value, and in which row).
    """
    name = cfg.reward.function
    if cfg.env.name or cfg.reward.kind != "function" or not probes(name):
        return
    try:
        probe_reward_function(reward_fn, texts, rows, prefix=cfg.data.response_prefix or "")
    except RewardFunctionError as e:
        raise ConfigError(f"reward.function={name!r} failed its load-time probe (placeholder "
                          f"responses '' and '0' to the first records of {key}): it {e}; "
                          "docs/forks.md, \"Reward functions\"") from None


def check_placement(cfg: Config, place, rollout_place=None) -> None:
    """`ppo.batch_size` on the mesh of `place` and of the rollout group's `rollout_place`
    (`generation.placement: split`; None: colocated) (`Placement.check_batch`), and the paged
    engine's sizes on the sampler's data replicas (`check_engine`), `model.attention` on the
    mesh's platform (`Placement.check_attention`) and `ppo.packing` on its batch shards
    (`stages.packing.check_packing`). Episodes run on any number of processes:
    each plays its own rows (`stages.ppo.episodes`).

    Raises:
      ConfigError: naming the key and what to set.
    """
    place.check_batch("ppo.batch_size", cfg.ppo.batch_size)
    place.check_attention(cfg.model.attention)
    check_packing("ppo", cfg.ppo, 1, place.batch_shards)
    sampler = place if rollout_place is None else rollout_place
    if rollout_place is not None:
        check_split_rows(cfg, place, rollout_place)
    check_engine(cfg, sampler.batch_shards, trainer_shards=place.batch_shards)


def check_split_rows(cfg: Config, place, rollout_place) -> None:
    """With `generation.placement: split`: `ppo.batch_size` on the rollout mesh, and each
    process holding the same rows of a batch in both groups, so prompts and responses cross
    inside each process (`parallel.transfer.uncovered`).

    Raises:
      ConfigError: naming `generation.rollout_devices` and why.
    """
    size, key = cfg.ppo.batch_size, f"generation.rollout_devices={cfg.generation.rollout_devices}"
    try:
        rollout_place.check_batch("ppo.batch_size", size)
    except ConfigError as err:
        raise ConfigError(f"the rollout group ({key}): {err}") from None
    for src, dst in ((place, rollout_place), (rollout_place, place)):
        why = uncovered(src.by_row, dst.by_row, (size,))
        if why is not None:
            raise ConfigError(f"{key}: a batch cannot cross between the groups inside each "
                              f"process: {why}")


def check_kernel(cfg: Config, model_cfg, mesh) -> None:
    """`generation.attention: pallas` against the actor's shapes: the kernel needs head_dim 128
    and a number of KV heads per chip it can tile.

    Raises:
      ConfigError: naming `generation.attention` and why the kernel cannot take the model.
    """
    g = cfg.generation
    if g.engine != "paged" or g.attention != "pallas":
        return
    from ppo_jax.models.paged_attention_tpu import unsupported_reason

    tensor = mesh.shape["tensor"] if mesh is not None else 1
    reason = unsupported_reason(model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim,
                                model_cfg.jnp_dtype, tensor)
    if reason is not None:
        raise ConfigError(f"generation.attention=pallas: {reason}; use "
                          "generation.attention=reference")


def check_router_replay(cfg: Config, model_cfg) -> None:
    """`model.router_replay: rollout` needs an MoE actor: a dense one has no routes to replay.

    Raises:
      ConfigError: naming `model.router_replay` and the actor's model type.
    """
    if cfg.model.router_replay != "none" and not getattr(model_cfg, "num_moe_layers", 0):
        raise ConfigError(f"model.router_replay={cfg.model.router_replay!r}: the actor "
                          f"({model_cfg.model_type}) has no MoE layer to replay; use "
                          "model.router_replay=none")


def check_engine(cfg: Config, replicas: int, trainer_shards: int = 1) -> None:
    """With `generation.engine: paged`, check the engine's settings against the run's widest
    batches on `replicas` data replicas, before any model is loaded. One is the training batch,
    with prompts `data.max_prompt_length` wide. The other is the held-out evaluation's, which
    samples on the same engine: at most `eval.num_prompts` x `eval.samples_per_prompt` rows,
    `eval.max_new_tokens` long. With `env.name`, the pool must hold every slot's longest
    episode. The eval rows are padded to a multiple of `replicas` and of the trainer's
    `trainer_shards` too (they differ with `generation.placement: split`).

    Raises:
      ConfigError: naming the `generation.*` key and its value.
    """
    settings, g, e = engine_settings(cfg), cfg.generation, cfg.eval
    if settings is None:
        return
    width = cfg.data.max_prompt_length
    share = g.share_prompt_prefill
    try:
        engine_layout(settings, batch=cfg.ppo.batch_size, prompt_width=width,
                      max_new_tokens=g.max_new_tokens, replicas=replicas,
                      group_size=g.samples_per_prompt if share else 1, turns=bool(cfg.env.name))
        check_page_size(g.page_size, width + g.max_new_tokens,
                        "data.max_prompt_length + generation.max_new_tokens")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not eval_enabled(e):
        return
    multiple = math.lcm(eval_rows_multiple(math.lcm(replicas, trainer_shards),
                                           cfg.ppo.micro_batch_size), e.samples_per_prompt)
    rows = -(-e.num_prompts * e.samples_per_prompt // multiple) * multiple
    try:
        engine_layout(settings, batch=rows, prompt_width=width,
                      max_new_tokens=e.max_new_tokens or g.max_new_tokens, replicas=replicas,
                      group_size=e.samples_per_prompt if share else 1, turns=bool(cfg.env.name))
    except ValueError as err:
        raise ConfigError(f"the held-out evaluation's batch ({rows} rows, "
                          f"eval.samples_per_prompt={e.samples_per_prompt}, "
                          f"{e.max_new_tokens or g.max_new_tokens} new tokens): {err}") from None
