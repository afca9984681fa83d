"""KL coefficient controllers (fixed and adaptive) as pure functions on an array state.

The state is a ``NamedTuple`` pytree whose leaves are all 0-d arrays (float32 ``value``,
``target``, ``horizon``; int32 ``kind``), so it lives inside a jitted train state, is updated
inside ``jit`` without retracing, and serialises with orbax. The coefficient must never be a
Python float captured at trace time.

Adaptive rule: Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences",
section 2.2), as in TRL 0.11 ``AdaptiveKLController.update``::

    proportional_error = clip(current_kl / target - 1, -0.2, 0.2)
    mult = 1 + proportional_error * n_steps / horizon
    value = value * mult

``n_steps`` is the number of samples (sequences) in the step, as TRL passes ``batch_size``.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V

KL_CONTROLLER_KINDS: dict[str, int] = {"fixed": 0, "adaptive": 1}
KLControllerKind = Literal[tuple(KL_CONTROLLER_KINDS)]  # the config's type of ppo.kl_controller
PROPORTIONAL_ERROR_CLIP = 0.2


class KLControllerState(NamedTuple):
    """KL controller state; every leaf a 0-d array.

    Attributes:
      value: float32, the current KL coefficient (``kl_coef`` of ``compute_rewards``).
      target: float32, target KL (adaptive only; 0 for fixed).
      horizon: float32, horizon in samples (adaptive only; 1 for fixed).
      kind: int32 code, ``KL_CONTROLLER_KINDS[kind]`` (0 fixed, 1 adaptive).
    """

    value: jax.Array
    target: jax.Array
    horizon: jax.Array
    kind: jax.Array


def init_kl_controller(
    kind: str,
    init_kl_coef: float,
    target: float | None = None,
    horizon: float | None = None,
) -> KLControllerState:
    """Builds a fixed or adaptive KL controller state.

    Args:
      kind: ``"fixed"`` or ``"adaptive"``.
      init_kl_coef: initial coefficient, ``>= 0``.
      target: target KL, ``> 0``; required for ``"adaptive"``, ignored for ``"fixed"``.
      horizon: horizon in samples, ``> 0``; required for ``"adaptive"``, ignored for ``"fixed"``.

    Returns:
      ``KLControllerState`` of 0-d arrays.

    Raises:
      ValueError: unknown ``kind`` (listing the known ones), negative ``init_kl_coef``, or a
        missing / non-positive ``target`` or ``horizon`` for ``"adaptive"``.
    """
    if kind not in KL_CONTROLLER_KINDS:
        raise ValueError(f"unknown KL controller kind {kind!r}; known: {', '.join(KL_CONTROLLER_KINDS)}")
    V.check_nonnegative("init_kl_coef", init_kl_coef)
    if kind == "adaptive":
        for name, x in (("target", target), ("horizon", horizon)):
            if x is None:
                raise ValueError(f"adaptive KL controller needs {name}, got None")
            V.check_positive(name, x)
    else:
        target, horizon = 0.0, 1.0
    return KLControllerState(
        value=jnp.asarray(init_kl_coef, jnp.float32),
        target=jnp.asarray(target, jnp.float32),
        horizon=jnp.asarray(horizon, jnp.float32),
        kind=jnp.asarray(KL_CONTROLLER_KINDS[kind], jnp.int32),
    )


def update_kl_controller(state: KLControllerState, current_kl: Any, n_steps: Any) -> KLControllerState:
    """One controller update; a fixed controller returns its value unchanged.

    Args:
      state: ``KLControllerState``.
      current_kl: scalar, the measured KL of the step (TRL: mean over sequences of the summed
        per-token k1 KL), Python float or traced 0-d array.
      n_steps: scalar, samples in the step (Python int or traced 0-d array).

    Returns:
      A new ``KLControllerState`` (same structure, dtypes and shapes; jit-stable).

    Raises:
      ValueError: ``current_kl`` or ``n_steps`` is not a scalar.
    """
    current_kl = V.as_scalar("current_kl", current_kl).astype(jnp.float32)
    n_steps = V.as_scalar("n_steps", n_steps).astype(jnp.float32)
    adaptive = state.kind == KL_CONTROLLER_KINDS["adaptive"]
    target = jnp.where(adaptive, state.target, 1.0)
    horizon = jnp.where(adaptive, state.horizon, 1.0)
    error = jnp.clip(current_kl / target - 1.0, -PROPORTIONAL_ERROR_CLIP, PROPORTIONAL_ERROR_CLIP)
    mult = 1.0 + error * n_steps / horizon
    value = jnp.where(adaptive, state.value * mult, state.value)
    return state._replace(value=value.astype(state.value.dtype))
