"""The rollout / trainer log-prob mismatch: measured, and corrected by importance weights.

The rollout engine samples with its own weights and kernels (bf16 weights, other reduction
orders) and returns the log-probs it sampled with, ``rollout_logprobs`` (full-distribution
log-softmax at the sampling temperature). The trainer recomputes them in float32: the
experience's ``logprobs``, PPO's ``old_logprobs``. The two differ, so PPO's ratio
``pi_theta / pi_old`` starts from a policy that did not sample the batch: the update is
off-policy by ``pi_old / pi_rollout`` (TRL #4772, NeMo-RL #4243, vLLM RFC #42259).

``rollout_mismatch`` measures the gap; ``rollout_correction_weights`` gives per-token weights
that multiply the per-token policy-gradient loss (``ppo.rollout_correction``):

- ``"none"``: weight 1 on every real token (no correction).
- ``"tis"``: token-level truncated importance sampling, ``w_t = min(pi_old / pi_rollout, C)``
  (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
  the truncated-IS correction of the policy gradient).
- ``"mis"``: sequence-level masked importance sampling, ``rho = prod_t pi_old / pi_rollout``
  over a response's real tokens, ``w = rho`` if ``rho <= C`` else 0 for all its tokens (Liu,
  Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
  Training-Inference Mismatch", sequence-level MIS).
- ``"icepop"``: token-level masking, ``w_t = k_t = pi_old / pi_rollout`` when ``k_t`` lies in
  the band ``[low, high]``, else 0 (Ling Team 2025, "Every Step Evolves: Scaling Reinforcement
  Learning for Trillion-Scale Thinking Model", arXiv:2510.18855, IcePop's masking function
  ``M(k)``; band ``[0.5, 5]`` there and in OpenRLHF ``openrlhf/models/loss.py`` lines
  200-205, commit 3c3be623). verl's ``rollout_rs: token_k1`` drops the same tokens with weight
  1 inside the band and takes them out of the normaliser too (docs/forks.md, "The loss menu").

The weight is the behaviour-policy correction of decoupled PPO (Hilton et al. 2021, "Batch
size-invariance for policy optimization"): PPO's clip stays around ``pi_old`` and the weight
moves the expectation from ``pi_rollout`` to ``pi_old``. Both blog-post sources state the
formulas without equation numbers.

Masked slots may hold NaN / inf in any input: they are replaced with ``jnp.where`` before any
arithmetic and reach no weight, stat or gradient.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V
from ppo_jax.core.aggregation import Normalizers, aggregate, loss_normalizers
from ppo_jax.core.kl import kl_penalty
from ppo_jax.core.masked import masked_mean, safe_divide

ROLLOUT_CORRECTIONS: tuple[str, ...] = ("none", "tis", "mis", "icepop")
ICEPOP_BAND: tuple[float, float] = (0.5, 5.0)  # the IcePop paper's [alpha, beta]
RolloutCorrection = Literal[ROLLOUT_CORRECTIONS]  # the config's type of ppo.rollout_correction


def check_rollout_correction(mode: str, cap: Any = 2.0, band: tuple = ICEPOP_BAND) -> None:
    """Checks a correction mode and, for ``"tis"`` / ``"mis"``, its cap ``C``, for
    ``"icepop"`` its ``band = (low, high)``.

    ``C >= 1``: an exactly on-policy token or sequence (ratio 1) keeps weight 1, so a run with
    no mismatch is unchanged; ``C = 1`` is the one-sided truncation of Retrace / V-trace
    (Munos et al. 2016; Espeholt et al. 2018, rho-bar = 1). ``C < 1`` would truncate (tis) or
    drop (mis) on-policy data too. For the same reason the band holds 1:
    ``0 <= low <= 1 <= high``. A traced ``cap`` or bound is checked for rank and dtype only.

    Raises:
      ValueError: ``mode`` not in ``ROLLOUT_CORRECTIONS`` (naming it and the known names); a
        ``cap`` or bound that is not a numeric scalar; a static ``cap`` that is not finite or
        is < 1; a static band with ``low < 0``, ``low > high``, or 1 outside it, or a bound
        that is not finite.
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; known: "
                         f"{', '.join(ROLLOUT_CORRECTIONS)}")
    if mode == "none":
        return
    if mode == "icepop":
        _check_band(*band)
        return
    if V.is_static_number(cap):
        if not (math.isfinite(float(cap)) and float(cap) >= 1.0):
            raise ValueError(f"rollout correction cap must be a finite number >= 1 for "
                             f"{mode!r}, got {cap!r}")
    else:
        V.as_scalar("cap", cap)


def _check_band(low: Any, high: Any) -> None:
    """IcePop's band: ``0 <= low <= 1 <= high``, finite (static values; traced: rank, dtype)."""
    if not (V.is_static_number(low) and V.is_static_number(high)):
        V.as_scalar("band low", low), V.as_scalar("band high", high)
        return
    low, high = float(low), float(high)
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"icepop band [{low!r}, {high!r}] must be finite numbers")
    if low < 0 or low > high:
        raise ValueError(f"icepop band [{low!r}, {high!r}]: low must be >= 0 and <= high")
    if not low <= 1.0 <= high:
        raise ValueError(f"icepop band [{low!r}, {high!r}] must hold 1 (low <= 1 <= high): "
                         "an on-policy token (ratio 1) must keep its weight")


def _icepop(log_ratio: jax.Array, valid: jax.Array, low: jax.Array, high: jax.Array):
    """Token weights ``k`` inside ``[low, high]``, 0 outside, and the 0/1 tokens outside.

    Compared in log space (``log 0 = -inf`` for ``low = 0``), so a huge or NaN log-ratio is
    dropped, never turned into a weight."""
    inside = (log_ratio >= jnp.log(low)) & (log_ratio <= jnp.log(high))  # False for NaN
    weights = jnp.where(valid & inside, jnp.exp(jnp.where(inside, log_ratio, 0)), 0)
    return weights, valid & ~inside


def _prepare(names: tuple[str, str], a: Any, b: Any, mask: Any):
    """Validated ``(a, b)`` with masked slots replaced by 0, the bool ``valid`` mask, dtype."""
    for name, x in zip(names, (a, b)):
        if x is None:
            raise ValueError(f"{name} is missing (None)")
    a, b = V.as_float(names[0], a, ndim=2), V.as_float(names[1], b, ndim=2)
    V.same_shape(**{names[0]: a, names[1]: b})
    valid = V.as_valid("mask", mask, a.shape)
    dtype = jnp.result_type(a, b)
    return (jnp.where(valid, a, 0).astype(dtype), jnp.where(valid, b, 0).astype(dtype), valid,
            dtype)


def rollout_mismatch(logprobs: jax.Array, rollout_logprobs: jax.Array, mask: jax.Array
                     ) -> dict[str, jax.Array]:
    """How far the trainer's log-probs are from the sampler's, over the real tokens.

    With ``d = logprobs - rollout_logprobs`` on real tokens:

    - ``mismatch/abs_logprob_diff``: token mean of ``|d|``.
    - ``mismatch/k3_kl``: token mean of ``exp(d) - d - 1``, Schulman's 2020 k3 estimate of
      ``KL(pi_rollout || pi_trainer)`` from tokens sampled by ``pi_rollout``; >= 0. It is
      ``kl_penalty(rollout_logprobs, logprobs, "low_var_kl")``.
    - ``mismatch/max_ratio`` / ``mismatch/min_ratio``: max / min of ``exp(d)``; 1 when no
      token is real.

    Args:
      logprobs: ``[B, T]`` float, the trainer's recomputed log-probs (float32).
      rollout_logprobs: ``[B, T]`` float, the sampler's log-probs of the same tokens.
      mask: ``[B, T]`` 0/1 response mask; anything (NaN, inf) may sit in masked slots.

    Returns:
      ``{name: scalar}`` of the inputs' float dtype (at least float32), ``stop_gradient``-ed;
      token means are 0 on an empty mask.

    Raises:
      ValueError: inputs missing (None) or not rank-2 float arrays of one shape; a mask of
        another shape or a bad dtype.
    """
    lp, rl, valid, _ = _prepare(("logprobs", "rollout_logprobs"), logprobs, rollout_logprobs,
                                mask)
    d = lp - rl  # 0 on masked slots
    any_valid = jnp.any(valid)
    max_d = jnp.where(any_valid, jnp.max(jnp.where(valid, d, -jnp.inf)), 0)
    min_d = jnp.where(any_valid, jnp.min(jnp.where(valid, d, jnp.inf)), 0)
    stats = {
        "mismatch/abs_logprob_diff": masked_mean(jnp.abs(d), valid),
        "mismatch/k3_kl": masked_mean(kl_penalty(rl, lp, "low_var_kl"), valid),
        "mismatch/max_ratio": jnp.exp(max_d),
        "mismatch/min_ratio": jnp.exp(min_d),
    }
    return jax.lax.stop_gradient(stats)


def _tis(log_ratio: jax.Array, valid: jax.Array, cap: jax.Array):
    """Token weights ``min(exp(log_ratio), cap)`` and the 0/1 tokens at the cap."""
    ratio = jnp.exp(log_ratio)  # inf for a huge log-ratio: min(inf, cap) = cap, no NaN
    at_cap = valid & (ratio >= cap)
    return jnp.where(valid, jnp.minimum(ratio, cap), 0), at_cap


def _mis(log_ratio: jax.Array, valid: jax.Array, cap: jax.Array):
    """Token weights of sequence-level MIS and the ``[B]`` 0/1 rejected rows.

    ``log rho = sum_t log_ratio`` (0 on masked slots); kept when ``log rho <= log cap``, in log
    space, so a sum past float range (inf) or NaN is rejected, never turned into a weight.
    """
    log_rho = jnp.sum(jnp.where(valid, log_ratio, 0), axis=1)
    log_cap = jnp.log(cap)
    keep = log_rho <= log_cap  # False for NaN and +inf
    row_weight = jnp.where(keep, jnp.exp(jnp.where(keep, log_rho, 0)), 0)
    rejected = ~keep & jnp.any(valid, axis=1)
    return jnp.where(valid, row_weight[:, None], 0), rejected


def rollout_correction_weights(old_logprobs: jax.Array, rollout_logprobs: jax.Array,
                               mask: jax.Array, *, mode: str, cap: Any = 2.0,
                               band: tuple = ICEPOP_BAND,
                               normalizers: Optional[Normalizers] = None
                               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token importance weights from the sampler's policy to the trainer's.

    With ``d_t = old_logprobs - rollout_logprobs`` on real tokens:

    - ``"none"``: ``w_t = 1``.
    - ``"tis"`` (Yao et al. 2025): ``w_t = min(exp(d_t), C)``.
    - ``"mis"`` (Liu, Li et al. 2025): ``rho_b = exp(sum_t d_t)``; ``w_t = rho_b`` when
      ``rho_b <= C``, else 0, for every real token of row ``b``. It is computed in log space,
      so a huge sum gives weight 0, never inf or NaN.
    - ``"icepop"`` (IcePop, arXiv:2510.18855): ``w_t = exp(d_t)`` when
      ``low <= exp(d_t) <= high``, else 0, compared in log space (a NaN or huge ratio: 0).

    The stats are ``stop_gradient``-ed scalars. Each is a sum over this call's rows divided by
    the minibatch constants in ``normalizers``, so the stats of a minibatch's micro-batches add
    up to the minibatch's:

    - ``rollout_correction/weight_mean``: token mean of ``w``, ``sum w / N``.
    - ``rollout_correction/truncated_fraction``: for tis, the real tokens at the cap, where
      ``exp(d_t) >= C``, over ``N``; for mis, the rejected rows, where ``rho_b > C``, over
      ``S``; for icepop, the real tokens outside the band, over ``N``; for none, 0. A row with
      no real token has ``rho = 1`` and is never rejected.

    Args:
      old_logprobs: ``[B, T]`` float, the trainer's log-probs at rollout time (PPO's old).
      rollout_logprobs: ``[B, T]`` float, the sampler's log-probs of the same tokens.
      mask: ``[B, T]`` 0/1 response mask; anything (NaN, inf) may sit in masked slots.
      mode: one of ``ROLLOUT_CORRECTIONS`` (static).
      cap: ``C`` (static number >= 1, or a traced scalar); read by ``"tis"`` / ``"mis"``.
      band: ``(low, high)``, static numbers with ``0 <= low <= 1 <= high`` or traced
        scalars; read by ``"icepop"``.
      normalizers: the whole minibatch's ``Normalizers``; None: this call's own.

    Returns:
      ``(weights [B, T], stats)``: weights of the inputs' float dtype (float32 for float32
      inputs), ``stop_gradient``-ed, 0 on masked slots.

    Raises:
      ValueError: as ``check_rollout_correction``; inputs missing (None) or not rank-2 float
        arrays of one shape; a mask of another shape or a bad dtype.
    """
    check_rollout_correction(mode, cap, band)
    old, rl, valid, dtype = _prepare(("old_logprobs", "rollout_logprobs"), old_logprobs,
                                     rollout_logprobs, mask)
    norms = loss_normalizers(valid) if normalizers is None else normalizers
    log_ratio = old - rl  # 0 on masked slots
    truncated = jnp.zeros((), dtype)
    if mode == "none":
        weights = valid.astype(dtype)
    elif mode == "tis":
        weights, at_cap = _tis(log_ratio, valid, V.as_scalar("cap", cap).astype(dtype))
        truncated = aggregate(at_cap.astype(dtype), valid, "token-mean", norms)
    elif mode == "icepop":
        low, high = (V.as_scalar(f"band {k}", b).astype(dtype) for k, b in zip(("low", "high"), band))
        weights, dropped = _icepop(log_ratio, valid, low, high)
        truncated = aggregate(dropped.astype(dtype), valid, "token-mean", norms)
    else:
        weights, rejected = _mis(log_ratio, valid, V.as_scalar("cap", cap).astype(dtype))
        seqs = V.as_scalar("normalizers.seqs", norms.seqs).astype(dtype)
        truncated = safe_divide(jnp.sum(rejected, dtype=dtype), seqs)
    stats = {"rollout_correction/weight_mean": aggregate(weights, valid, "token-mean", norms),
             "rollout_correction/truncated_fraction": truncated}
    return jax.lax.stop_gradient(weights), jax.lax.stop_gradient(stats)
