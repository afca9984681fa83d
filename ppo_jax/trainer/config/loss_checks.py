"""The policy loss's keyword arguments, checked when the config loads (before any compile).

The trainer calls `fn(batch, cliprange=..., [cliprange_high=..., dual_clip=...,]
**ppo.policy_loss_kwargs)` (`stages.ppo.update.UpdateSettings.policy_kwargs`). Here, with the
registered function in hand:

- every keyword must be a parameter of `fn` (unless it takes `**kwargs`): a key of
  `ppo.policy_loss_kwargs` it does not take, or a `ppo.cliprange_high` / `ppo.dual_clip` it has
  no use for, is named with the loss and the keys it does take;
- `fn.check_kwargs`, the loss's own validator (`core.loss_kwargs`), refuses bad values (a
  temperature <= 0, a band with low > high, a fraction outside (0, 1]), naming the key.

A name not registered yet is left to `stages.ppo.load_checks.check_names` (a fork's module is
imported by `--import` before the config loads; the start-up check lists the known names).
`stages.ppo.load_checks` still binds and runs every registered function on test batches.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from ppo_jax.core.loss_kwargs import LossKwargError, check_loss_kwargs, reads_cliprange
from ppo_jax.core.registry import get_policy_loss
from ppo_jax.trainer.config.fields import ConfigError
from ppo_jax.trainer.config.schema import PPOConfig

TRAINER_KEYS = ("cliprange", "cliprange_high", "dual_clip")  # passed from ppo.* by the trainer


def policy_loss_or_none(name: str) -> Optional[Callable]:
    """The registered policy loss `name`, or None when no function has that name (yet)."""
    try:
        return get_policy_loss(name)
    except ValueError:
        return None


def policy_call_kwargs(p: PPOConfig) -> dict[str, Any]:
    """The keyword arguments of the trainer's policy-loss call (`UpdateSettings.policy_kwargs`)."""
    kw = {"cliprange": p.cliprange}
    for key in ("cliprange_high", "dual_clip"):
        if getattr(p, key) is not None:
            kw[key] = getattr(p, key)
    return {**kw, **p.policy_loss_kwargs}


def _full_key(p: PPOConfig, key: str) -> str:
    return f"ppo.policy_loss_kwargs.{key}" if key in p.policy_loss_kwargs else f"ppo.{key}"


def _takes(fn: Callable) -> tuple[Optional[set], list[str]]:
    """(the keyword names `fn` takes, None when it takes `**kwargs` or no `cliprange`; its own
    hyper-parameters). A function without `cliprange` cannot take the trainer's call at all:
    `stages.ppo.load_checks` says so, with the registered-loss signature to follow."""
    params = list(inspect.signature(fn).parameters.values())[1:]  # after the batch
    names = {q.name for q in params}
    if "cliprange" not in names or any(q.kind is inspect.Parameter.VAR_KEYWORD for q in params):
        return None, []
    return names, sorted(names - set(TRAINER_KEYS))


def _what_it_takes(fn: Callable, key: str, names: set, own: list[str]) -> str:
    """The keys of the kind of `key` that `fn` reads: the trainer's `ppo.*` ones for a trainer
    key (`ppo.cliprange` only where `reads_cliprange`), else its `ppo.policy_loss_kwargs`."""
    if key not in TRAINER_KEYS:
        return f"its ppo.policy_loss_kwargs: {', '.join(own) or 'none'}"
    reads = [f"ppo.{k}" for k in TRAINER_KEYS
             if k in names and (k != "cliprange" or reads_cliprange(fn))]
    return (f"it reads {' and '.join(reads)}" if reads else
            f"it reads none of {', '.join(f'ppo.{k}' for k in TRAINER_KEYS)}")


def check_policy_loss(p: PPOConfig) -> None:
    """`ppo.policy_loss_kwargs` (and `ppo.cliprange_high` / `ppo.dual_clip`) against the
    configured policy loss's signature and validator.

    Raises:
      ConfigError: naming the key, its value, the loss, and the keys the loss takes or why
        the value is refused.
    """
    for key in TRAINER_KEYS:
        if key in p.policy_loss_kwargs:
            raise ConfigError(f"ppo.policy_loss_kwargs.{key}: the trainer passes {key} itself "
                              f"(set it through ppo.{key})")
    fn = policy_loss_or_none(p.policy_loss)
    if fn is None:
        return
    kwargs = policy_call_kwargs(p)
    names, own = _takes(fn)
    if names is not None:
        for key, value in kwargs.items():
            if key not in names:
                raise ConfigError(
                    f"{_full_key(p, key)}={value!r}: ppo.policy_loss={p.policy_loss!r} takes no "
                    f"{key} ({_what_it_takes(fn, key, names, own)}); drop it or pick a loss "
                    "that reads it (docs/forks.md)")
    try:
        check_loss_kwargs(fn, kwargs)
    except LossKwargError as e:
        raise ConfigError(f"{_full_key(p, e.key)}={e.value!r} {e.why} "
                          f"(ppo.policy_loss={p.policy_loss!r})") from None
