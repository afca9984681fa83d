"""Stage 1 (SFT): the next-token negative log-likelihood of the response tokens.

DeepSpeed-Chat step 1 / TRL `SFTTrainer` with a completion-only collator: the loss is the
cross-entropy of each response token given everything before it; prompt and padding tokens are
masked out (transformers' `labels = -100`). Like the PPO losses, the function returns token SUMS
divided by a caller-given normaliser, so micro-batches of one minibatch add up to the exact
minibatch token mean (a mean of micro-batch means would weight short micro-batches more).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V
from ppo_jax.core.masked import masked_sum


def shift_for_next_token(ids: jax.Array, loss_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Targets and their mask for logits read at positions `0 .. L-2`.

    The logits at position `t` predict token `t + 1`, so `targets = ids[:, 1:]` and
    `mask = loss_mask[:, 1:]` (transformers' `shift_labels`).

    Args:
      ids: `[B, L]` int token ids.
      loss_mask: `[B, L]` 0/1, 1 on the tokens to learn (the response, EOS included).

    Returns:
      `(targets [B, L-1] int32, mask [B, L-1] int32)`.

    Raises:
      ValueError: `ids` is not a rank-2 integer array, or the shapes differ.
    """
    ids = V.as_int("ids", ids, ndim=2)
    valid = V.as_valid("loss_mask", loss_mask, ids.shape)
    return ids[:, 1:].astype(jnp.int32), valid[:, 1:].astype(jnp.int32)


def nll_loss(logprobs: jax.Array, mask: jax.Array, *, loss_normalizer: Any = None
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`-sum(mask * logprobs) / loss_normalizer`: the SFT loss of one micro-batch.

    Args:
      logprobs: `[B, T]` float, log-prob of each target token (`logprobs_from_logits`).
      mask: `[B, T]` 0/1, 1 on response targets; other entries may hold anything (NaN too).
      loss_normalizer: the token count of the whole minibatch (scalar); None: this call's own
        token count (at least 1).

    Returns:
      `(loss, stats)`: the scalar loss and `{"nll": loss, "tokens": mask count / normaliser}`
      (both sum to the minibatch values over its micro-batches).

    Raises:
      ValueError: shapes or dtypes do not match.
    """
    logprobs = V.as_float("logprobs", logprobs, ndim=2)
    count = masked_sum(jnp.ones_like(logprobs), mask)
    n = jnp.maximum(count, 1.0) if loss_normalizer is None else jnp.asarray(loss_normalizer, logprobs.dtype)
    loss = -masked_sum(logprobs, mask) / n
    return loss, {"nll": loss, "tokens": jax.lax.stop_gradient(count / n)}
