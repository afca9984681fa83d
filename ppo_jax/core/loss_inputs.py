"""`LossInputs`: the one per-token batch every registered policy / value loss receives.

A registered loss is ``fn(batch: LossInputs, *, <trainer keywords>, **config_kwargs) ->
(per_token_loss [B, T], stats)`` (``ppo_jax.core.registry``); the trainer reduces the per-token
loss once (``ppo_jax.core.aggregation``). Shapes follow the design doc: ``B`` rows (a
micro-batch), ``T`` padded response length.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V


class LossInputs(NamedTuple):
    """One micro-batch as a loss sees it (a pytree: jit, vmap and scan pass it through).

    Fields that do not exist in a call are ``None``: the actor's loss of a run with a separate
    critic has no new ``values``, the critic's loss has no ``logprobs`` / ``entropy``. The
    trainer passes every float field with masked slots replaced by 0 (``masked_inputs``), so a
    loss needs no ``jnp.where`` of its own to stay NaN-safe.

    Attributes:
      mask: ``[B, T]`` int32 0/1 response mask (1 up to and including the stop token).
      logprobs: ``[B, T]`` float32, new log-probs (differentiated).
      old_logprobs: ``[B, T]`` float32, log-probs at rollout time.
      ref_logprobs: ``[B, T]`` float32, reference-model log-probs (same temperature).
      entropy: ``[B, T]`` float32, entropy of the new next-token distribution (differentiated).
      advantages: ``[B, T]`` float32, from the advantage estimator (whitened when configured).
      values: ``[B, T]`` float32, new critic values (differentiated).
      old_values: ``[B, T]`` float32, critic values at rollout time.
      returns: ``[B, T]`` float32, value targets from the advantage estimator.
      group_ids: ``[B]`` int32, the group (prompt) of each row; rows of one prompt share an id.
        Until the trainer samples several responses per prompt every row is its own group
        (its row index in the experience batch).
      rollout_logprobs: ``[B, T]`` float32, the log-probs the sampler drew the tokens with
        (the rollout engine's, possibly from bf16 weights); equal to ``old_logprobs`` when the
        sampler returns none. ``old_logprobs - rollout_logprobs`` is the rollout / trainer
        mismatch (``core.rollout_correction``).
    """

    mask: jax.Array
    logprobs: Optional[jax.Array] = None
    old_logprobs: Optional[jax.Array] = None
    ref_logprobs: Optional[jax.Array] = None
    entropy: Optional[jax.Array] = None
    advantages: Optional[jax.Array] = None
    values: Optional[jax.Array] = None
    old_values: Optional[jax.Array] = None
    returns: Optional[jax.Array] = None
    group_ids: Optional[jax.Array] = None
    rollout_logprobs: Optional[jax.Array] = None


PER_TOKEN_FIELDS: tuple[str, ...] = tuple(f for f in LossInputs._fields if f not in ("mask", "group_ids"))


def masked_inputs(batch: LossInputs) -> LossInputs:
    """``batch`` with every per-token float field set to 0 where ``mask`` is 0.

    ``jnp.where`` (not ``x * mask``), so NaN / inf in padding reaches neither a loss value nor a
    gradient; the gradient of a field on masked slots is exactly 0.

    Raises:
      ValueError: ``mask`` is not ``[B, T]``, or a field is not a float array of its shape.
    """
    valid = V.as_valid("mask", batch.mask)
    if valid.ndim != 2:
        raise ValueError(f"mask must have rank 2, got shape {tuple(valid.shape)}")
    out = {}
    for name in PER_TOKEN_FIELDS:
        x = getattr(batch, name)
        if x is not None:
            x = V.as_float(name, x, ndim=2)
            V.same_shape(mask=valid, **{name: x})
            out[name] = jnp.where(valid, x, 0)
    return batch._replace(**out)
