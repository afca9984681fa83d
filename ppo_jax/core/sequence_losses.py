"""Sequence-level policy losses: GSPO (one importance ratio and one clip decision per response),
GSPO-token (the sequence ratio with per-token advantages) and GMPO (the geometric mean of the
token ratios, clipped in log space).

Like every registered policy loss, ``gspo_loss`` returns a PER-TOKEN ``[B, T]`` loss and the
trainer reduces it once (``ppo_jax.core.aggregation``); here the per-token value is the row's
sequence loss, the same on each of its valid tokens, so ``seq-mean-token-mean`` turns it back
into GSPO's ``(1/G) sum_i loss_i``. Rows are independent, so micro-batches that split rows
sum exactly to the minibatch value, as for ``ppo_clip``.

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
from ppo_jax.core.losses import _prepare, ratio_inputs
from ppo_jax.core.masked import masked_mean
from ppo_jax.core.registry import register_policy_loss


def sequence_log_ratio(logprobs: jax.Array, old_logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """``log s_i = (1/|y_i|) sum_t (lp_{i,t} - old_{i,t})`` over the row's valid tokens.

    ``s_i = exp(log s_i) = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|)``, the length-normalised
    sequence importance ratio of GSPO (Zheng et al. 2025, "Group Sequence Policy
    Optimization", eq. 7). A row with an empty mask gets 0 (ratio 1).

    Args:
      logprobs, old_logprobs: ``[B, T]`` float.
      mask: ``[B, T]`` 0/1 response mask.

    Returns:
      ``[B]`` float (at least float32), differentiable in both log-prob arrays.

    Raises:
      ValueError: inputs missing, not rank-2 float, or of different shapes.
    """
    (lp, old), valid, _ = _prepare(("logprobs", "old_logprobs"), (logprobs, old_logprobs), mask)
    return masked_mean(lp - old, valid, axis=1)


def _on_tokens(row_values: jax.Array, valid: jax.Array, dtype) -> jax.Array:
    """``[B] -> [B, T]``: the row's value on its valid tokens, 0 elsewhere."""
    return jnp.where(valid, row_values[:, None], 0).astype(dtype)


@register_policy_loss("gspo")
def gspo_loss(batch: LossInputs, *, cliprange: Any, cliprange_high: Any = None,
              dual_clip: Any = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GSPO clipped sequence-level surrogate (to minimise), per token.

    For row ``i`` with valid tokens ``t = 1..|y_i|``:
    ``s_i = exp(mean_t (lp - old))``, eq. 7, from ``sequence_log_ratio``;
    ``A_i = mean_t advantages``, under stop-gradient: an outcome estimator's advantage is
    constant over the row's tokens, so this is it, and a per-token estimator such as GAE is
    averaged;
    ``loss_i = max(-A_i s_i, -A_i clip(s_i, 1 - cliprange, 1 + cliprange_high))``
    where ``cliprange_high`` defaults to ``cliprange``. ``loss_i`` is written on every valid token
    of row ``i``. Source: Zheng et al. 2025 ("Group Sequence Policy Optimization",
    arXiv:2507.18071), eq. 5 (objective, sign flipped), eq. 6 (group advantage), eq. 7 (ratio);
    the paper's ranges are ``cliprange = 3e-4``, ``cliprange_high = 4e-4``.

    Reduction: with ``loss_aggregation: seq-mean-token-mean`` the loss is exactly GSPO's
    ``(1/G) sum_i loss_i`` (row ``i`` contributes ``sum_t loss_i / |y_i| = loss_i``; an empty
    row adds 0 and still counts in ``G``). Its gradient is GSPO's sequence-level gradient
    (paper sec. 4.2): ``-(1/G) sum_i A_i s_i (1/|y_i|) sum_t grad lp_{i,t}`` over rows whose
    clipped term is not the larger, 0 for clipped rows. ``token-mean`` instead weighs row ``i``
    by ``|y_i| / N`` (longer responses count more), ``seq-mean-token-sum`` by ``|y_i| / (G T)``.

    GSPO-token equivalence (paper sec. 4.3): GSPO-token uses the per-token ratio
    ``s_{i,t} = sg[s_i] pi(y_{i,t}) / sg[pi(y_{i,t})]`` (value ``s_i``, gradient
    ``s_i grad lp_{i,t}``) with per-token advantages ``A_{i,t}``. When ``A_{i,t} = A_i``, its
    per-token loss has the same value ``loss_i`` and, under any reduction that weighs the
    tokens of a row alike (all three here), the same gradient as this loss: here every token of
    row ``i`` carries ``d loss_i / d lp_{i,u} = -A_i s_i / |y_i|`` for all ``u``, and the
    ``|y_i|`` tokens add up to ``-A_i s_i`` per ``u``, GSPO-token's per-token gradient
    (``gspo_token_loss``, registered as ``gspo_token``).

    Args:
      batch: ``LossInputs`` with ``logprobs`` (differentiated), ``old_logprobs``,
        ``advantages`` (treated as constants) and ``mask``, all ``[B, T]``.
      cliprange: epsilon of the low side (and of the high side unless ``cliprange_high``).
      cliprange_high: optional epsilon of the high side.
      dual_clip: must be None (GSPO defines no dual clip; accepted so the trainer's call with
        ``ppo.dual_clip`` set fails with a clear message).

    Returns:
      ``per_token_loss [B, T]``, ``loss_i`` on row ``i``'s valid tokens and 0 on masked slots,
      and ``stats``: per-token ``[B, T]`` arrays, 0 on masked slots, all ``stop_gradient``-ed.
      ``clipfrac`` is 1 on every token of a row whose clipped term is the larger, so its token
      mean is the fraction of clipped tokens, as the paper reports. ``clipfrac_low`` and
      ``clipfrac_high`` split it by side, ``s_i < 1 - cliprange`` or ``s_i > 1 + cliprange_high``.
      ``ratio`` is ``s_i``, ``token_ratio`` is ``exp(lp - old)``, ``approxkl`` is
      ``0.5 (lp - old)^2`` per token as in ``ppo_clip``, and ``policykl`` is ``old - lp``.

    Raises:
      ValueError: a missing field, wrong ranks / dtypes / shapes; a clip range that is not a
        numeric scalar; static ``cliprange < 0`` or ``cliprange_high < 0``; ``dual_clip`` set.
    """
    if dual_clip is not None:
        raise ValueError(f"gspo has no dual clip, got dual_clip={dual_clip!r} (set ppo.dual_clip "
                         "to null)")
    V.check_nonnegative("cliprange", cliprange)
    if cliprange_high is not None:
        V.check_nonnegative("cliprange_high", cliprange_high)
    (lp, old, adv), valid, dtype = _prepare(
        ("logprobs", "old_logprobs", "advantages"),
        (batch.logprobs, batch.old_logprobs, batch.advantages), batch.mask)
    old = jax.lax.stop_gradient(old)
    low = V.as_scalar("cliprange", cliprange).astype(dtype)
    high = low if cliprange_high is None else V.as_scalar("cliprange_high", cliprange_high).astype(dtype)

    log_ratio = lp - old  # 0 on masked slots: both were replaced by 0
    seq_ratio = jnp.exp(masked_mean(log_ratio, valid, axis=1))  # [B], 1 on an empty row
    seq_adv = jax.lax.stop_gradient(masked_mean(adv, valid, axis=1))  # [B], 0 on an empty row
    pg1 = -seq_adv * seq_ratio
    pg2 = -seq_adv * jnp.clip(seq_ratio, 1.0 - low, 1.0 + high)
    seq_loss = jnp.maximum(pg1, pg2)
    clipped = pg2 > pg1
    row = {"clipfrac": clipped, "clipfrac_low": clipped & (seq_ratio < 1.0 - low),
           "clipfrac_high": clipped & (seq_ratio > 1.0 + high), "ratio": seq_ratio}
    stats = {k: _on_tokens(v, valid, dtype) for k, v in row.items()}
    stats.update(token_ratio=jnp.where(valid, jnp.exp(log_ratio), 0),
                 approxkl=0.5 * log_ratio * log_ratio, policykl=-log_ratio)
    return _on_tokens(seq_loss, valid, dtype), jax.lax.stop_gradient(stats)


def check_sequence_clip_kwargs(*, cliprange: Any = 0.2, cliprange_high: Any = None) -> None:
    """The clip ranges of ``gspo_token`` and ``gmpo``: ``cliprange``, ``cliprange_high`` >= 0.

    Raises:
      LossKwargError: naming the key.
    """
    K.check_clip_ranges({"cliprange": cliprange, "cliprange_high": cliprange_high})


def _clip_bounds(cliprange: Any, cliprange_high: Any, dtype):
    low = V.as_scalar("cliprange", cliprange).astype(dtype)
    high = low if cliprange_high is None else V.as_scalar("cliprange_high", cliprange_high).astype(dtype)
    return low, high


@register_policy_loss("gspo_token")
def gspo_token_loss(batch: LossInputs, *, cliprange: Any, cliprange_high: Any = None
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GSPO-token per token (to minimise): GSPO's sequence ratio with per-token advantages.

    ``s_{i,t} = sg[s_i] pi_t / sg[pi_t]``, i.e. ``log s_{i,t} = sg[log s_i] + lp - sg[lp]``
    (``s_i`` of ``sequence_log_ratio``): its value is ``s_i`` on every token of row ``i`` and
    its gradient ``s_i grad lp_t``. ``l_t = max(-A_t s_{i,t}, -A_t clip(s_{i,t},
    1 - cliprange, 1 + cliprange_high))``, so the clip decision is per token (by the sign of
    ``A_t``). With advantages constant over a row (any outcome estimator) the per-token loss and
    its gradient equal ``gspo_loss``'s under every aggregation; with advantages that vary
    within a row (GAE, a process reward) each token gets its own. Source: Zheng et al. 2025
    (arXiv:2507.18071), sec. 4.3, the GSPO-token objective and ratio. Checked against verl
    ``compute_policy_loss_gspo`` (core_algos.py lines 1291-1304; verl's "gspo" IS this form, and
    clamps the log-ratio at 10, which is not done here) and TRL
    ``importance_sampling_level="sequence_token"`` (trl/experimental/gspo_token/grpo_trainer.py
    lines 78-82).

    Args:
      batch: ``LossInputs`` with ``logprobs`` (differentiated), ``old_logprobs``,
        ``advantages`` (constants) and ``mask``, all ``[B, T]``.
      cliprange, cliprange_high: as ``gspo_loss`` (no ``dual_clip``).

    Returns:
      ``per_token_loss [B, T]``, 0 on masked slots, and ``stop_gradient``-ed per-token stats:
      ``clipfrac`` (1 where the clipped term is the larger), ``ratio`` (``s_i``),
      ``token_ratio``, ``approxkl``, ``policykl``.

    Raises:
      ValueError: a missing field, wrong ranks / dtypes / shapes; ``LossKwargError`` for a
        static clip range < 0.
    """
    check_sequence_clip_kwargs(cliprange=cliprange, cliprange_high=cliprange_high)
    lp, old, adv, valid, dtype = ratio_inputs(batch)
    low, high = _clip_bounds(cliprange, cliprange_high, dtype)
    log_ratio = lp - old  # 0 on masked slots
    seq_log = jax.lax.stop_gradient(masked_mean(log_ratio, valid, axis=1))  # [B]
    ratio = jnp.exp(seq_log[:, None] + lp - jax.lax.stop_gradient(lp))
    pg1 = -adv * ratio
    pg2 = -adv * jnp.clip(ratio, 1.0 - low, 1.0 + high)
    per_token = jnp.where(valid, jnp.maximum(pg1, pg2), 0)
    stats = {"clipfrac": (valid & (pg2 > pg1)).astype(dtype),
             "ratio": jnp.where(valid, ratio, 0), "token_ratio": jnp.where(valid, jnp.exp(log_ratio), 0),
             "approxkl": 0.5 * log_ratio * log_ratio, "policykl": -log_ratio}
    return per_token, jax.lax.stop_gradient(stats)


gspo_token_loss.check_kwargs = check_sequence_clip_kwargs


@register_policy_loss("gmpo")
def gmpo_loss(batch: LossInputs, *, cliprange: Any, cliprange_high: Any = None
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GMPO per token (to minimise): the geometric mean of token ratios, clipped in log space.

    For row ``i`` with valid tokens ``t``, ``x_t = lp - old``, the row advantage
    ``A_i = mean_t advantages`` and ``g = sign(A_i)``:
    ``c_t = g min(g x_t, g clip(x_t, -cliprange, cliprange_high))`` (a token clipped only on
    the side that would enlarge the objective, PPO's pessimism in log space; ``c_t = 0``
    where ``A_i = 0``), ``rho_i = exp(mean_t c_t)`` and ``loss_i = -A_i rho_i``, written on
    every valid token of row ``i``. Gradient: ``-A_i rho_i / |y_i|`` on each unclipped token,
    0 on clipped ones. NOTE: ``cliprange`` / ``cliprange_high`` bound the LOG-ratio here (the
    paper's ``(e^-0.4, e^0.4)`` is ``cliprange = 0.4``). With ``loss_aggregation:
    seq-mean-token-mean`` the loss is GMPO's ``(1/G) sum_i loss_i`` exactly (as ``gspo``).
    Source: Zhao et al. 2025, "Geometric-Mean Policy Optimization" (arXiv:2507.20673), the
    GMPO objective with token-level clipping in log space. Checked against verl
    ``compute_policy_loss_geo_mean`` (core_algos.py lines 1684-1707), which takes the sign of
    each token's advantage where the paper takes the sequence's: the same for an outcome
    estimator (advantages constant over a row); here the paper's, the row advantage's sign.

    Args:
      batch: ``LossInputs`` with ``logprobs`` (differentiated), ``old_logprobs``,
        ``advantages`` (constants) and ``mask``, all ``[B, T]``.
      cliprange: the log-ratio's low bound ``-cliprange``.
      cliprange_high: its high bound; None: ``cliprange``.

    Returns:
      ``per_token_loss [B, T]``, ``loss_i`` on row ``i``'s valid tokens, 0 elsewhere, and
      ``stop_gradient``-ed per-token stats: ``clipfrac`` (tokens clipped), ``ratio``
      (``rho_i``), ``token_ratio``, ``approxkl``, ``policykl``.

    Raises:
      ValueError: a missing field, wrong ranks / dtypes / shapes; ``LossKwargError`` for a
        static clip range < 0.
    """
    check_sequence_clip_kwargs(cliprange=cliprange, cliprange_high=cliprange_high)
    lp, old, adv, valid, dtype = ratio_inputs(batch)
    low, high = _clip_bounds(cliprange, cliprange_high, dtype)
    log_ratio = lp - old  # 0 on masked slots
    seq_adv = jax.lax.stop_gradient(masked_mean(adv, valid, axis=1))  # [B]
    sign = jnp.sign(seq_adv)[:, None]
    clipped_log = sign * jnp.minimum(sign * log_ratio, sign * jnp.clip(log_ratio, -low, high))
    seq_ratio = jnp.exp(masked_mean(clipped_log, valid, axis=1))  # [B], 1 on an empty row
    clipped = valid & (((sign > 0) & (log_ratio > high)) | ((sign < 0) & (log_ratio < -low)))
    stats = {"clipfrac": clipped.astype(dtype), "ratio": _on_tokens(seq_ratio, valid, dtype),
             "token_ratio": jnp.where(valid, jnp.exp(log_ratio), 0),
             "approxkl": 0.5 * log_ratio * log_ratio, "policykl": -log_ratio}
    return _on_tokens(-seq_adv * seq_ratio, valid, dtype), jax.lax.stop_gradient(stats)


gmpo_loss.check_kwargs = check_sequence_clip_kwargs
