"""One reduction of per-token losses to a scalar, exact under gradient accumulation.

Modes (``ppo.loss_aggregation``), for a per-token loss ``l[b, t]`` and mask ``m[b, t]`` of a
minibatch with ``N`` valid tokens, ``S`` rows (sequences) and padded response length ``T``:

- ``"token-mean"``: ``sum_{b,t} m l / N`` — every token weighs the same (TRL 0.11, PPO's
  default; the minibatch token mean, never a mean of micro-batch means).
- ``"seq-mean-token-mean"``: ``(1 / S) sum_b [sum_t m l / n_b]`` with ``n_b = sum_t m[b, t]``
  — every sequence weighs the same (GRPO, Shao et al. 2024, eq. 3; a row with no valid token
  adds 0 and still counts in ``S``).
- ``"seq-mean-token-sum"``: ``(1 / S) sum_b [sum_t m l / T]`` — token sums over a CONSTANT
  normaliser ``S T``, so long and short responses are not reweighted by their length
  (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training", section 3.1:
  ``1/|o_i|`` replaced by a constant, the maximum response length).
  ``T`` is the width of the mask unless the caller passes ``max_response_length`` to
  ``loss_normalizers``. A trainer that drops all-pad columns passes it, so ``T`` stays the
  maximum response length.

Exactness: the caller computes ``Normalizers`` ONCE from the whole minibatch's mask
(``loss_normalizers``) and passes them to every micro-batch; each micro-batch's ``aggregate`` is
then a sum over its own rows divided by minibatch constants (``n_b`` is per row, so it is
local), and the micro-batch results add up exactly to the whole minibatch's value. Without
``normalizers`` the call's own mask gives them.

Stats are not losses: ``token_mean_stats`` reports every per-token stat as its minibatch token
mean whatever the loss mode (a clip fraction stays a fraction of tokens; verl's
``compute_policy_loss`` does the same).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V
from ppo_jax.core.masked import safe_divide

LOSS_AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LossAggregation = Literal[LOSS_AGGREGATIONS]  # the config's type of ppo.loss_aggregation


class Normalizers(NamedTuple):
    """The minibatch constants of ``aggregate`` (scalars: Python numbers or 0-d arrays).

    Attributes:
      tokens: ``N``, valid tokens of the minibatch (token-mean).
      seqs: ``S``, rows of the minibatch (the seq modes).
      max_response_length: ``T``, the padded (maximum) response length (seq-mean-token-sum).
    """

    tokens: Any
    seqs: Any
    max_response_length: Any


def check_aggregation(mode: str) -> None:
    """Raises ``ValueError("unknown loss aggregation 'x'; known: ...")`` unless ``mode`` is one
    of ``LOSS_AGGREGATIONS``."""
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; known: {', '.join(LOSS_AGGREGATIONS)}")


def loss_normalizers(mask: Any, max_response_length: Optional[int] = None) -> Normalizers:
    """``Normalizers`` of a (whole minibatch) ``[B, T]`` mask: float32 ``N``, ``B`` and the
    max_response_length, ``T`` or the given ``max_response_length``.

    ``max_response_length`` pins seq-mean-token-sum's constant when the mask is narrower than the maximum
    response length (a trainer that drops all-pad columns passes ``max_new_tokens``, so the
    loss does not change with the columns it keeps).

    Raises:
      ValueError: ``mask`` is not a rank-2 bool / int / float array; ``max_response_length`` not >= 1.
    """
    valid = V.as_valid("mask", mask)
    if valid.ndim != 2:
        raise ValueError(f"mask must have rank 2, got shape {tuple(valid.shape)}")
    b, t = valid.shape
    if max_response_length is not None and max_response_length < 1:
        raise ValueError(f"max_response_length={max_response_length!r} must be >= 1 (or None: "
                         "the mask's width)")
    t = t if max_response_length is None else max_response_length
    return Normalizers(jnp.sum(valid, dtype=jnp.float32), jnp.float32(b), jnp.float32(t))


def aggregate(per_token: jax.Array, mask: Any, mode: str = "token-mean",
              normalizers: Optional[Normalizers] = None) -> jax.Array:
    """Reduces a per-token ``[B, T]`` array to a scalar by ``mode`` (module doc for formulas).

    Masked slots are replaced by 0 with ``jnp.where`` first (NaN there reaches no value and no
    gradient). A zero normaliser gives 0, not NaN.

    Args:
      per_token: ``[B, T]`` float (bool / int stats are cast to float32).
      mask: ``[B, T]`` 0/1 response mask of this call's rows.
      mode: one of ``LOSS_AGGREGATIONS`` (static string).
      normalizers: the whole minibatch's ``Normalizers``; None: this call's own.

    Returns:
      A scalar of ``per_token``'s float dtype (at least float32).

    Raises:
      ValueError: unknown ``mode``; ``per_token`` not rank 2; ``mask`` of another shape;
        a static negative normaliser.
    """
    check_aggregation(mode)
    x = jnp.asarray(per_token)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    x = V.as_float("per_token", x, ndim=2)
    valid = V.as_valid("mask", mask, x.shape)
    norm = loss_normalizers(valid) if normalizers is None else normalizers
    for name, value in zip(Normalizers._fields, norm):
        V.check_nonnegative(f"normalizers.{name}", value)
    den = {k: V.as_scalar(f"normalizers.{k}", v).astype(x.dtype) for k, v in norm._asdict().items()}
    masked = jnp.where(valid, x, 0)
    if mode == "token-mean":
        return safe_divide(jnp.sum(masked), den["tokens"])
    row_sums = jnp.sum(masked, axis=1)
    if mode == "seq-mean-token-mean":
        row_means = safe_divide(row_sums, jnp.sum(valid, axis=1, dtype=x.dtype))
        return safe_divide(jnp.sum(row_means), den["seqs"])
    return safe_divide(jnp.sum(row_sums), den["seqs"] * den["max_response_length"])


def token_mean_stats(stats: Mapping[str, jax.Array], mask: Any,
                     normalizers: Optional[Normalizers] = None) -> dict[str, jax.Array]:
    """Each ``[B, T]`` stat as its (minibatch) token mean, ``stop_gradient``-ed.

    Raises:
      ValueError: a stat that is not ``[B, T]`` like ``mask`` (the message names it).
    """
    out = {}
    for key, value in stats.items():
        try:
            out[key] = aggregate(value, mask, "token-mean", normalizers)
        except ValueError as e:
            raise ValueError(f"stat {key!r}: {e} (stats of a registered loss are per-token "
                             "[B, T] arrays)") from None
    return jax.lax.stop_gradient(out)


def reduce_loss(terms: Mapping[str, jax.Array], stats: Mapping[str, jax.Array], mask: Any,
                mode: str = "token-mean", normalizers: Optional[Normalizers] = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The scalar loss of per-token loss ``terms`` and the reported stats.

    ``loss = aggregate(sum of terms, mask, mode)`` (one reduction); the stats are each term's
    own aggregate under ``mode`` (so they add up to ``loss``) and each per-token stat's token
    mean (``token_mean_stats``), all ``stop_gradient``-ed.

    Args:
      terms: ``{name: [B, T]}`` per-token loss terms, e.g. ``{"pg_loss": ..., "kl_loss": ...}``.
      stats: ``{name: [B, T]}`` per-token diagnostics of the loss function.
      mask, mode, normalizers: as ``aggregate``.

    Returns:
      ``(loss scalar, {**term aggregates, **stat token means})``.

    Raises:
      ValueError: as ``aggregate`` / ``token_mean_stats``; an empty ``terms``.
    """
    if not terms:
        raise ValueError("reduce_loss needs at least one loss term")
    values = list(terms.values())
    total = values[0]
    for term in values[1:]:
        total = total + term
    loss = aggregate(total, mask, mode, normalizers)
    parts = {k: aggregate(v, mask, mode, normalizers) for k, v in terms.items()} if len(terms) > 1 \
        else {next(iter(terms)): loss}
    return loss, {**token_mean_stats(stats, mask, normalizers), **jax.lax.stop_gradient(parts)}
