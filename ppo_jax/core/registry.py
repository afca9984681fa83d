"""Name -> function registries: one `Registry` class, one convention for every kind.

A config names a function by string; a research fork adds one by registering a function under
a new name, with no trainer edit::

    from ppo_jax.core import register_policy_loss

    @register_policy_loss("my_loss")
    def my_loss(batch, *, cliprange, **unused):
        ratio = jnp.exp(batch.logprobs - batch.old_logprobs)
        return -batch.advantages * ratio, {"ratio": ratio}

The convention, the same for every kind (advantage estimators, policy losses, value losses,
reward shaping here; reward functions in ``ppo_jax.trainer.rewards.functions``):

- ``register_<kind>(name, *, override=False)`` is a decorator returning the function unchanged;
  registering the same function again is a no-op, another function under a taken name raises
  ``ValueError("<kind> 'name' is already registered; pass override=True to replace it")``
  (re-running a notebook cell that defines a new function object needs ``override=True``).
- ``get_<kind>(name)`` returns it, or raises ``ValueError("unknown <kind> 'name'; known: a, b")``.

Signatures the PPO trainer calls (``[B, T]`` arrays, ``mask`` 0/1; each call also gets the
entries of the matching ``ppo.*_kwargs`` config dict, scalars or strings, and the trainer checks
at start-up that the signature accepts the call and that the outputs have the right shapes):

- advantage estimator:
  ``fn(values, rewards, mask, *, gamma, lam, scores, group_ids, baseline_scores,
  **advantage_kwargs) -> (advantages [B, T], returns [B, T])`` (``scores`` / ``group_ids`` /
  ``baseline_scores`` are ``[B]``: see ``ppo_jax.core.estimators``; ``fn.uses_critic = False``
  makes the trainer load no critic). Built-in: ``"gae"`` (``compute_gae``; ``advantage_kwargs``
  may set ``method`` and ``unroll``), ``"grpo"``, ``"rloo"``, ``"reinforce_plus_plus"``,
  ``"reinforce_plus_plus_baseline"``, ``"remax"``.
- policy loss: ``fn(batch: LossInputs, *, cliprange, **policy_loss_kwargs)
  -> (per_token_loss [B, T], stats dict[str, [B, T]])``; ``cliprange_high`` and ``dual_clip``
  are passed too when the config sets them. Built-in: ``"ppo_clip"`` (``ppo_clip_loss``),
  ``"gspo"`` (``gspo_loss``, sequence-level ratio and clip; no ``dual_clip``), and the loss
  menu of docs/forks.md: ``"gspo_token"``, ``"gmpo"``, ``"cispo"``, ``"sapo"``,
  ``"clip_cov"``, ``"kl_cov"``. A loss may carry ``fn.check_kwargs(**kwargs)``, the validator
  of its hyper-parameters, and ``fn.reads_cliprange = False`` when it ignores ``cliprange``
  (``ppo_jax.core.loss_kwargs``); the config runs both when it loads.
- value loss: ``fn(batch: LossInputs, *, cliprange_value, **value_loss_kwargs)
  -> (per_token_loss [B, T], stats dict[str, [B, T]])``.
  Built-in: ``"clipped_mse"`` (``clipped_value_loss``).
- reward shaping: ``fn(scores [B], ended [B] bool, logprobs, ref_logprobs, mask, *, kl_coef,
  kl_estimator, reward_clip, score_scale, missing_eos_penalty, whiten_rewards,
  **reward_shaping_kwargs) -> (rewards [B, T], non_score_rewards [B, T], scores [B])``.
  Built-in: ``"kl_penalty"`` (``kl_penalty_shaping``).

Losses are PER TOKEN: the trainer reduces the loss once with ``ppo.loss_aggregation``
(``ppo_jax.core.aggregation``), exactly under gradient accumulation, and reports each stat as
its token mean; see ``ppo_jax.core.loss_inputs.LossInputs`` for what a batch holds. A function
with no use for a keyword takes ``**unused``. Functions must be jit-able, with the registered
kwargs static Python values or traced scalars.
"""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

_ALL: dict[str, "Registry"] = {}  # kind -> registry, every one ever created (registered_names)


class Registry:
    """A name -> function table of one ``kind`` ("policy loss", "reward function", ...).

    Creating one adds it to ``registered_names()`` / ``unregister(kind, ...)`` (a module that
    is re-imported replaces its registry of that kind).
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._table: dict[str, Callable] = {}
        _ALL[kind] = self

    def register(self, name: str, *, override: bool = False) -> Callable[[F], F]:
        """Decorator storing ``fn`` under ``name`` and returning it unchanged.

        Raises:
          ValueError: empty / non-string name, a non-callable, or ``name`` taken by another
            function and not ``override``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: F) -> F:
            if not callable(fn):
                raise ValueError(f"{self.kind} {name!r} must be callable, got {fn!r}")
            if name in self._table and self._table[name] is not fn and not override:
                raise ValueError(f"{self.kind} {name!r} is already registered; "
                                 "pass override=True to replace it")
            self._table[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> Callable:
        """The function registered as ``name``.

        Raises:
          ValueError: unknown ``name``; the message lists the known names.
        """
        if name not in self._table:
            known = ", ".join(sorted(self._table)) or "(none)"
            raise ValueError(f"unknown {self.kind} {name!r}; known: {known}")
        return self._table[name]

    def names(self) -> tuple[str, ...]:
        """The registered names, sorted."""
        return tuple(sorted(self._table))

    def unregister(self, name: str) -> None:
        """Removes ``name`` (for tests of forks); a missing name is ignored."""
        self._table.pop(name, None)


ADVANTAGE_ESTIMATORS = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
VALUE_LOSSES = Registry("value loss")
REWARD_SHAPINGS = Registry("reward shaping")


def register_advantage_estimator(name: str, *, override: bool = False) -> Callable[[F], F]:
    """Decorator registering ``fn(values, rewards, mask, *, gamma, lam, scores, group_ids,
    baseline_scores, **kw) -> (advantages, returns)`` (module doc). Raises: ValueError as
    ``Registry.register``."""
    return ADVANTAGE_ESTIMATORS.register(name, override=override)


def register_policy_loss(name: str, *, override: bool = False) -> Callable[[F], F]:
    """Decorator registering ``fn(batch: LossInputs, *, cliprange, **kw) -> (per_token_loss
    [B, T], stats of [B, T])`` (module doc). Raises: ValueError as ``Registry.register``."""
    return POLICY_LOSSES.register(name, override=override)


def register_value_loss(name: str, *, override: bool = False) -> Callable[[F], F]:
    """Decorator registering ``fn(batch: LossInputs, *, cliprange_value, **kw) ->
    (per_token_loss [B, T], stats of [B, T])`` (module doc). Raises: ValueError as
    ``Registry.register``."""
    return VALUE_LOSSES.register(name, override=override)


def register_reward_shaping(name: str, *, override: bool = False) -> Callable[[F], F]:
    """Decorator registering ``fn(scores, ended, logprobs, ref_logprobs, mask, *, kl_coef, ...)
    -> (rewards, non_score_rewards, scores)`` (module doc). Raises: ValueError as
    ``Registry.register``."""
    return REWARD_SHAPINGS.register(name, override=override)


def get_advantage_estimator(name: str) -> Callable:
    """The advantage estimator ``name``. Raises: ValueError listing the known names."""
    return ADVANTAGE_ESTIMATORS.get(name)


def get_policy_loss(name: str) -> Callable:
    """The policy loss ``name``. Raises: ValueError listing the known names."""
    return POLICY_LOSSES.get(name)


def get_value_loss(name: str) -> Callable:
    """The value loss ``name``. Raises: ValueError listing the known names."""
    return VALUE_LOSSES.get(name)


def get_reward_shaping(name: str) -> Callable:
    """The reward shaping ``name``. Raises: ValueError listing the known names."""
    return REWARD_SHAPINGS.get(name)


def registered_names() -> dict[str, tuple[str, ...]]:
    """``{kind: sorted names}`` of every registry created so far (core's four, plus
    "reward function" once ``ppo_jax.trainer.rewards.functions`` is imported)."""
    return {kind: reg.names() for kind, reg in _ALL.items()}


def unregister(kind: str, name: str) -> None:
    """Removes ``name`` from the ``kind`` registry (for tests of forks); missing names are ignored.

    Raises:
      ValueError: unknown ``kind``.
    """
    if kind not in _ALL:
        raise ValueError(f"unknown registry kind {kind!r}; known: {', '.join(_ALL)}")
    _ALL[kind].unregister(name)
