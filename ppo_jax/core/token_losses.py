"""Token-level alternatives to PPO's clip: CISPO (a clipped, stop-gradient importance weight on
REINFORCE) and SAPO (a soft sigmoid gate in place of the clip).

Like ``ppo_clip_loss`` each returns a PER-TOKEN ``[B, T]`` loss and per-token stats; the
trainer reduces it once (``core.aggregation``). Rows and tokens are independent, so
micro-batches add up exactly to the minibatch. The anchors named below are verl
``verl/trainer/ppo/core_algos.py`` at commit b178a3cd and TRL ``trl/trainer/grpo_trainer.py``
at commit f2cd5771 (docs/forks.md, "The loss menu").

Masked slots may hold NaN/inf in any input: they are replaced with ``jnp.where`` before any
arithmetic, so they reach neither the loss nor its gradient.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ppo_jax.core import loss_kwargs as K
from ppo_jax.core import validation as V
from ppo_jax.core.loss_inputs import LossInputs
from ppo_jax.core.losses import ratio_inputs
from ppo_jax.core.registry import register_policy_loss


def check_cispo_kwargs(*, cliprange: Any = 0.2, cliprange_high: Any = None) -> None:
    """CISPO's clip ranges: ``cliprange`` and ``cliprange_high`` >= 0.

    Raises:
      LossKwargError: naming the key.
    """
    K.check_clip_ranges({"cliprange": cliprange, "cliprange_high": cliprange_high})


@register_policy_loss("cispo")
def cispo_loss(batch: LossInputs, *, cliprange: Any, cliprange_high: Any = None
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """CISPO per token (to minimise): ``l = -sg(clip(r, 1 - cliprange, 1 + cliprange_high)) A lp``.

    ``r = exp(lp - old)``; ``cliprange_high`` defaults to ``cliprange``. The clipped weight is a
    constant, so the gradient is ``-w A grad lp`` on EVERY token, clipped or not: a clipped
    token keeps its gradient at the bounded weight, where PPO's clip drops it. The value is
    REINFORCE's surrogate ``-w A lp``, not a ratio times A.
    Source: MiniMax-M1 (arXiv:2506.13585), the CISPO objective ``J_CISPO`` and its clipped IS
    weight ``r_hat``. The paper bounds only the high side in practice (a large eps_low): set
    ``cliprange >= 1`` for no lower bound. Checked against verl ``compute_policy_loss_cispo``
    (core_algos.py lines 1753-1758: the two-sided clamp with ``clip_ratio_low``, which defaults
    to ``clip_ratio``, as here); TRL (grpo_trainer.py lines 3081-3082) clamps at an absolute
    ``max=epsilon_high`` with no lower bound: the same as ``cliprange >= 1``,
    ``cliprange_high = epsilon_high - 1``.

    Args:
      batch: ``LossInputs`` with ``logprobs`` (differentiated), ``old_logprobs``,
        ``advantages`` (constants) and ``mask``, all ``[B, T]``.
      cliprange: eps_low of the importance-weight clip.
      cliprange_high: eps_high; None: ``cliprange``.

    Returns:
      ``per_token_loss [B, T]``, 0 on masked slots, and ``stop_gradient``-ed per-token stats:
      ``clipfrac`` (1 where ``r`` lies outside the band), ``ratio`` (``r``), ``is_weight``
      (the clipped weight), ``approxkl`` (``0.5 (lp - old)^2``), ``policykl`` (``old - lp``).

    Raises:
      ValueError: a missing field, wrong ranks / dtypes / shapes; ``LossKwargError`` for a
        static clip range < 0 or not a number.
    """
    check_cispo_kwargs(cliprange=cliprange, cliprange_high=cliprange_high)
    lp, old, adv, valid, dtype = ratio_inputs(batch)
    low = V.as_scalar("cliprange", cliprange).astype(dtype)
    high = low if cliprange_high is None else V.as_scalar("cliprange_high", cliprange_high).astype(dtype)
    log_ratio = lp - old  # 0 on masked slots
    ratio = jnp.exp(log_ratio)
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - low, 1.0 + high))
    per_token = jnp.where(valid, -weight * adv * lp, 0)
    outside = valid & ((ratio < 1.0 - low) | (ratio > 1.0 + high))
    stats = {"clipfrac": outside.astype(dtype), "ratio": ratio, "is_weight": weight,
             "approxkl": 0.5 * log_ratio * log_ratio, "policykl": -log_ratio}
    return per_token, jax.lax.stop_gradient(stats)


cispo_loss.check_kwargs = check_cispo_kwargs


def check_sapo_kwargs(*, cliprange: Any = None, tau_pos: Any = 1.0, tau_neg: Any = 1.05) -> None:
    """SAPO's temperatures: ``tau_pos > 0`` and ``tau_neg > 0`` (the gate divides by them).

    Raises:
      LossKwargError: naming the key.
    """
    for key, value in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
        K.check_positive({key: value}, key)


@register_policy_loss("sapo")
def sapo_loss(batch: LossInputs, *, cliprange: Any = None, tau_pos: Any = 1.0,
              tau_neg: Any = 1.05) -> tuple[jax.Array, dict[str, jax.Array]]:
    """SAPO's soft-gated surrogate per token (to minimise): ``l = -f(r) A``.

    ``r = exp(lp - old)``, ``f(r) = (4 / tau) sigmoid(tau (r - 1))`` with ``tau = tau_pos``
    where ``A > 0`` and ``tau_neg`` elsewhere (``A <= 0``). Its gradient is
    ``-A w grad lp`` with ``w = 4 sigmoid (1 - sigmoid) r``: 1 at ``r = 1`` (the on-policy
    gradient), decaying smoothly as ``r`` leaves 1, faster for the larger temperature (the paper
    takes ``tau_neg > tau_pos``: negative updates spread over the vocabulary). No hard clip,
    so ``cliprange`` is taken (the trainer always passes it) and ignored
    (``reads_cliprange = False``). Source: Gao et al. 2025, "Soft Adaptive Policy
    Optimization" (arXiv:2511.20347), the SAPO objective, its gate ``f_{i,t}`` and temperatures
    (defaults 1.0 / 1.05). Checked against verl ``compute_policy_loss_sapo`` (core_algos.py
    lines 1364-1388) and TRL (grpo_trainer.py lines 3093-3095), which agree.

    Args:
      batch: ``LossInputs`` with ``logprobs`` (differentiated), ``old_logprobs``,
        ``advantages`` (constants) and ``mask``, all ``[B, T]``.
      cliprange: ignored.
      tau_pos, tau_neg: the gate's temperatures, > 0.

    Returns:
      ``per_token_loss [B, T]``, 0 on masked slots, and ``stop_gradient``-ed per-token stats:
      ``gate_weight`` (``w`` above), ``ratio``, ``approxkl``, ``policykl``.

    Raises:
      ValueError: a missing field, wrong ranks / dtypes / shapes; ``LossKwargError`` for a
        static temperature <= 0 or not a number.
    """
    check_sapo_kwargs(tau_pos=tau_pos, tau_neg=tau_neg)
    lp, old, adv, valid, dtype = ratio_inputs(batch)
    tau = jnp.where(adv > 0, V.as_scalar("tau_pos", tau_pos).astype(dtype),
                    V.as_scalar("tau_neg", tau_neg).astype(dtype))
    log_ratio = lp - old  # 0 on masked slots
    ratio = jnp.exp(log_ratio)
    gate = jax.nn.sigmoid(tau * (ratio - 1.0))
    per_token = jnp.where(valid, -(4.0 / tau) * gate * adv, 0)
    stats = {"gate_weight": jnp.where(valid, 4.0 * gate * (1.0 - gate) * ratio, 0),
             "ratio": ratio, "approxkl": 0.5 * log_ratio * log_ratio, "policykl": -log_ratio}
    return per_token, jax.lax.stop_gradient(stats)


sapo_loss.check_kwargs = check_sapo_kwargs
sapo_loss.reads_cliprange = False
