"""Gradient accumulation over micro-batches, shared by every stage's update (PPO, SFT, reward
model).

A minibatch `[M, ...]` is split into `M / micro_batch_size` micro-batches run by one
`lax.scan`; gradients and stats are summed. Each stage's loss returns a SUM over its
micro-batch divided by a normaliser of the whole minibatch (its token or pair count), so the
sums are exact minibatch means, equal to the loss of the whole minibatch at once.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ppo_jax.parallel import shard_like_params, shard_rows


def _zeros_like(tree):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree)


def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


def accumulate_gradients(loss_fn: Callable, params: Any, batch: Any, *, micro_batch_size: int,
                         mesh: Optional[Mesh] = None, per_micro: Any = None) -> tuple[Any, dict]:
    """Summed `(grads, stats)` of `loss_fn(params, micro) -> (loss, stats)` over micro-batches.

    Args:
      loss_fn: differentiable in `params`; `stats` is a dict of scalars.
      params: the params pytree.
      batch: a pytree of arrays with a common leading dim M (a multiple of micro_batch_size).
      micro_batch_size: rows per forward/backward pass.
      mesh: split each micro-batch's rows over ("data", "fsdp"); gradients are laid out like
        their params. None: one device.
      per_micro: None, or a pytree whose leaves have a leading dim M / micro_batch_size, one
        entry a micro-batch (its packing plan, `rollout.packing`); `loss_fn` then takes
        `(micro, entry)` as its second argument.

    Returns:
      `(grads, stats)`, the sums over micro-batches.

    Raises:
      ValueError: M is not a multiple of micro_batch_size.
    """
    rows = jax.tree.leaves(batch)[0].shape[0]
    if rows % micro_batch_size:
        raise ValueError(f"minibatch of {rows} rows is not a multiple of micro_batch_size="
                         f"{micro_batch_size}")
    n_micro = rows // micro_batch_size

    def grad_fn(p, m):
        grads, stats = jax.grad(loss_fn, has_aux=True)(p, m)
        return shard_like_params(grads, mesh), stats  # gradients live like their params

    if n_micro == 1:
        return grad_fn(params, batch if per_micro is None else
                       (batch, jax.tree.map(lambda x: x[0], per_micro)))
    micro = jax.tree.map(lambda x: shard_rows(
        x.reshape(n_micro, micro_batch_size, *x.shape[1:]), mesh, axis=1), batch)
    if per_micro is not None:
        micro = (micro, per_micro)
    shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro))
    zeros = _zeros_like(shapes)
    zeros = (shard_like_params(zeros[0], mesh), zeros[1])

    def body(acc, m):
        return _add(acc, grad_fn(params, m)), None

    return jax.lax.scan(body, zeros, micro)[0]
