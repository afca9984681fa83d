"""Name -> function registries for advantage estimators, policy losses and value losses.

A config names the functions by string; a research fork adds one by registering a function
under a new name, with no trainer edit::

    from ppo_jax.core import register_advantage_estimator

    @register_advantage_estimator("my_estimator")
    def my_estimator(values, rewards, mask, *, gamma, lam, **unused):
        ...
        return advantages, returns

Signatures a registered function must have (all arrays ``[B, T]``; ``mask`` is 0/1). The
trainer calls each one with the keyword arguments below plus the entries of the matching
``ppo.*_kwargs`` config dict (scalars or strings, e.g. ``--set ppo.policy_loss_kwargs.beta=0.1``),
and checks at start-up that the signature accepts that call:

- advantage estimator:
  ``fn(values, rewards, mask, *, gamma, lam, **advantage_kwargs)
  -> (advantages [B, T], returns [B, T])``.
  Built-in: ``"gae"`` (``compute_gae``; ``advantage_kwargs`` may set ``method`` and ``unroll``).
- policy loss:
  ``fn(logprobs, old_logprobs, advantages, mask, *, loss_normalizer, cliprange,
  **policy_loss_kwargs) -> (loss scalar, stats dict[str, scalar])``; ``cliprange_high`` and
  ``dual_clip`` are passed too when the config sets them.
  Built-in: ``"ppo_clip"`` (``policy_loss``).
- value loss:
  ``fn(values, old_values, returns, mask, *, loss_normalizer, cliprange_value,
  **value_loss_kwargs) -> (loss scalar, stats dict[str, scalar])``.
  Built-in: ``"clipped_mse"`` (``value_loss``).

A function that has no use for a keyword can take ``**unused``. Registering a name twice
raises unless ``override=True`` (re-running a notebook cell that registers a new function
object under the same name needs it).

Losses and stats must be token sums divided by ``loss_normalizer`` when it is given (token
means over ``mask`` otherwise), so that summing them over micro-batches gives exact minibatch
token means; stats must have a fixed set of keys. Functions must be jit-able, with the
registered kwargs static Python values or traced scalars.
"""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

_REGISTRIES: dict[str, dict[str, Callable]] = {
    "advantage estimator": {},
    "policy loss": {},
    "value loss": {},
}


def _register(kind: str, name: str, *, override: bool) -> Callable[[F], F]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")
    table = _REGISTRIES[kind]

    def decorator(fn: F) -> F:
        if not callable(fn):
            raise ValueError(f"{kind} {name!r} must be callable, got {fn!r}")
        if name in table and table[name] is not fn and not override:
            raise ValueError(f"{kind} {name!r} is already registered; pass override=True to replace it")
        table[name] = fn
        return fn

    return decorator


def _get(kind: str, name: str) -> Callable:
    table = _REGISTRIES[kind]
    if name not in table:
        known = ", ".join(sorted(table)) or "(none)"
        raise ValueError(f"unknown {kind} {name!r}; known: {known}")
    return table[name]


def register_advantage_estimator(name: str, *, override: bool = False) -> Callable[[F], F]:
    """Decorator registering ``fn(values, rewards, mask, **kwargs) -> (advantages, returns)``.

    Raises:
      ValueError: empty name, or ``name`` taken by another function and not ``override``.
    """
    return _register("advantage estimator", name, override=override)


def register_policy_loss(name: str, *, override: bool = False) -> Callable[[F], F]:
    """Decorator registering
    ``fn(logprobs, old_logprobs, advantages, mask, *, loss_normalizer=None, **kw) -> (loss, stats)``.

    Raises:
      ValueError: empty name, or ``name`` taken by another function and not ``override``.
    """
    return _register("policy loss", name, override=override)


def register_value_loss(name: str, *, override: bool = False) -> Callable[[F], F]:
    """Decorator registering
    ``fn(values, old_values, returns, mask, *, loss_normalizer=None, **kw) -> (loss, stats)``.

    Raises:
      ValueError: empty name, or ``name`` taken by another function and not ``override``.
    """
    return _register("value loss", name, override=override)


def get_advantage_estimator(name: str) -> Callable:
    """The advantage estimator registered as ``name``.

    Raises:
      ValueError: unknown ``name``; the message lists the known names.
    """
    return _get("advantage estimator", name)


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered as ``name``.

    Raises:
      ValueError: unknown ``name``; the message lists the known names.
    """
    return _get("policy loss", name)


def get_value_loss(name: str) -> Callable:
    """The value loss registered as ``name``.

    Raises:
      ValueError: unknown ``name``; the message lists the known names.
    """
    return _get("value loss", name)


def registered_names() -> dict[str, tuple[str, ...]]:
    """``{"advantage estimator": (...), "policy loss": (...), "value loss": (...)}``, sorted."""
    return {kind: tuple(sorted(table)) for kind, table in _REGISTRIES.items()}


def unregister(kind: str, name: str) -> None:
    """Removes ``name`` from the ``kind`` registry (for tests of forks); missing names are ignored.

    Raises:
      ValueError: unknown ``kind``.
    """
    if kind not in _REGISTRIES:
        raise ValueError(f"unknown registry kind {kind!r}; known: {', '.join(_REGISTRIES)}")
    _REGISTRIES[kind].pop(name, None)
