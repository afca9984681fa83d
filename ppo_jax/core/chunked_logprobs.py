"""Token log-probs and entropies straight from the LM head, one vocabulary block at a time.

``logprobs_from_logits(hidden @ W + b, tokens, tau)`` and ``entropy_from_logits(...)`` form the
full ``[B, T, V]`` float32 logits (and, under ``jax.grad``, their softmax and gradient) although
PPO needs only two numbers per position. Here the vocabulary is cut into blocks of
``chunk_size`` columns and each block's logits ``z_c = (h W_c + b_c) / tau`` are folded into a
running state per position (online softmax, Milakov & Gimelshein 2018):

    m   = max_v z_v                        (running maximum)
    s   = sum_v exp(z_v - m)               (lse = m + log s)
    u   = sum_v exp(z_v - m) (z_v - m)     (E_p[z] - m = u / s)
    z_t = z at the target token            (picked from the block that holds it)

so ``logprob = z_t - lse`` and ``entropy = lse - E_p[z] = log s - u / s``. Only one
``[B, T, chunk]`` block is alive at a time, forward and backward: a ``jax.custom_vjp`` keeps
``(lse, entropy)`` per position and the backward pass recomputes each block's logits and adds
its share of the gradients, with

    d logprob / d z_v = 1[v = t] - p_v
    d entropy / d z_v = -p_v (log p_v + H)

and ``d/dlogits = d/dz / tau``. This is the fused linear + cross-entropy idea of Liger-Kernel
(``LigerFusedLinearCrossEntropy``) and of Wijmans et al. 2024, "Cut Your Losses in
Large-Vocabulary Language Models" (Cut Cross-Entropy), extended to the entropy, written here as
two ``lax.scan``s over blocks (a last, narrower block when ``V % chunk_size != 0``; no padding
of the kernel). The kernel gradient is written block by block into one kernel-shaped buffer.
With ``vocab_shards = S`` a block holds ``chunk_size`` columns of each of ``S`` vocabulary
shards, so a head split over devices along the vocabulary is sliced where it lives.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V

F32 = jnp.float32


def _acc(x: jax.Array):
    """Accumulation dtype: float32, or float64 for float64 inputs."""
    return jnp.promote_types(x.dtype, F32)


def _specs(vocab_axis: int) -> tuple[str, str, str]:
    """einsum specs of (logits, d_hidden, d_kernel) on a block of the ``[S, Vs, D]`` /
    ``[D, S, Vs]`` kernel view (``s`` = vocabulary shard, ``v`` = column in the block)."""
    if vocab_axis == 0:
        return "btd,svd->btsv", "btsv,svd->btd", "btsv,btd->svd"
    return "btd,dsv->btsv", "btsv,dsv->btd", "btd,btsv->dsv"


def _shard_view(x: jax.Array, vocab_axis: int, shards: int) -> jax.Array:
    """Splits the vocabulary axis ``V`` of ``x`` into ``[shards, V // shards]``."""
    shape = x.shape[:vocab_axis] + (shards, x.shape[vocab_axis] // shards) + x.shape[vocab_axis + 1:]
    return x.reshape(shape)


def _block_logits(hidden, kernel, bias, temperature, start, size: int, vocab_axis: int):
    """``z = (hidden @ W_block + b_block) / temperature``: ``[B, T, S, size]`` (float32 for
    float32 / bfloat16 inputs), the columns ``[start, start + size)`` of every shard."""
    w = jax.lax.dynamic_slice_in_dim(kernel, start, size, axis=vocab_axis + 1)
    logits = jnp.einsum(_specs(vocab_axis)[0], hidden, w, preferred_element_type=_acc(hidden))
    if bias is not None:
        logits = logits + jax.lax.dynamic_slice_in_dim(bias, start, size, axis=1).astype(logits.dtype)
    return logits / temperature


def _block_onehot(tokens: jax.Array, start, size: int, shards: int, shard_width: int):
    """``[B, T, S, size]`` bool: the block's column of shard ``s`` is the target token."""
    first = jnp.arange(shards, dtype=tokens.dtype)[:, None] * shard_width + start
    return (first + jnp.arange(size, dtype=tokens.dtype)) == tokens[..., None, None]


def _scan_blocks(body: Callable, carry, width: int, chunk_size: int):
    """``carry = body(carry, start, size)`` over the blocks ``[start, start + size)`` of a
    shard's ``width`` columns: full blocks in one ``lax.scan``, then the narrower last block."""
    size = min(chunk_size, width)
    n_full, rest = divmod(width, size)
    starts = jnp.arange(n_full, dtype=jnp.int32) * size
    carry, _ = jax.lax.scan(lambda c, start: (body(c, start, size), None), carry, starts)
    if rest:
        carry = body(carry, n_full * size, rest)
    return carry


def _fold_block(state, z: jax.Array, onehot: jax.Array):
    """The online-softmax state ``(m, s, u, z_t)`` after one more block of logits ``z``."""
    m, s, u, picked = state
    m_new = jnp.maximum(m, jnp.max(z, axis=(-2, -1)))
    shift = jnp.where(s > 0, m - m_new, 0.0)  # 0 on the first block (m = -inf, s = 0)
    scale = jnp.exp(m - m_new)
    zc = z - m_new[..., None, None]
    e = jnp.exp(zc)
    s_new = s * scale + jnp.sum(e, axis=(-2, -1))
    u_new = scale * (u + s * shift) + jnp.sum(e * zc, axis=(-2, -1))
    picked = picked + jnp.sum(jnp.where(onehot, z, 0.0), axis=(-2, -1))
    return m_new, s_new, u_new, picked


def _forward(chunk_size, vocab_axis, hidden, kernel, bias, tokens, temperature):
    """``(logprobs, entropy, lse)``, each ``[B, T]`` float32 (float64 for float64 inputs);
    ``kernel`` / ``bias`` in the shard view."""
    shape, dtype = tokens.shape, _acc(hidden)
    shards, width = kernel.shape[vocab_axis], kernel.shape[vocab_axis + 1]
    init = (jnp.full(shape, -jnp.inf, dtype), jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
            jnp.zeros(shape, dtype))

    def body(state, start, size):
        z = _block_logits(hidden, kernel, bias, temperature, start, size, vocab_axis)
        return _fold_block(state, z, _block_onehot(tokens, start, size, shards, width))

    m, s, u, picked = _scan_blocks(body, init, width, chunk_size)
    lse = m + jnp.log(s)
    return picked - lse, jnp.log(s) - u / s, lse


def _col(x: jax.Array) -> jax.Array:
    """``[B, T]`` -> ``[B, T, 1, 1]`` (broadcasts against a ``[B, T, S, size]`` block)."""
    return x[..., None, None]


def _block_grads(z, onehot, lse, entropy, g_logprob, g_entropy):
    """``d(sum g_lp * logprob + g_H * entropy) / dz`` on one block: ``[B, T, S, size]``."""
    logp = z - _col(lse)
    p = jnp.exp(logp)
    g = jnp.where(onehot, _col(g_logprob), 0.0) - _col(g_logprob) * p
    return g - _col(g_entropy) * p * (logp + _col(entropy))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(chunk_size, vocab_axis, hidden, kernel, bias, tokens, temperature):
    logprobs, entropy, _ = _forward(chunk_size, vocab_axis, hidden, kernel, bias, tokens,
                                    temperature)
    return logprobs, entropy


def _fused_fwd(chunk_size, vocab_axis, hidden, kernel, bias, tokens, temperature):
    logprobs, entropy, lse = _forward(chunk_size, vocab_axis, hidden, kernel, bias, tokens,
                                      temperature)
    return (logprobs, entropy), (hidden, kernel, bias, tokens, temperature, lse, entropy)


def _fused_bwd(chunk_size, vocab_axis, residuals, cotangents):
    hidden, kernel, bias, tokens, temperature, lse, entropy = residuals
    acc, axis = _acc(hidden), vocab_axis + 1
    shards, width = kernel.shape[vocab_axis], kernel.shape[axis]
    g_logprob, g_entropy = (c.astype(acc) for c in cotangents)
    _, spec_h, spec_k = _specs(vocab_axis)

    def body(carry, start, size):
        d_hidden, d_kernel, d_bias, d_temp = carry
        z = _block_logits(hidden, kernel, bias, temperature, start, size, vocab_axis)
        g_z = _block_grads(z, _block_onehot(tokens, start, size, shards, width), lse, entropy,
                           g_logprob, g_entropy)
        g = g_z / temperature  # d/dlogits
        w = jax.lax.dynamic_slice_in_dim(kernel, start, size, axis=axis)
        d_hidden = d_hidden + jnp.einsum(spec_h, g.astype(w.dtype), w, preferred_element_type=acc)
        g_in = g.astype(hidden.dtype)
        operands = (g_in, hidden) if vocab_axis == 0 else (hidden, g_in)
        d_w = jnp.einsum(spec_k, *operands, preferred_element_type=acc).astype(d_kernel.dtype)
        d_kernel = jax.lax.dynamic_update_slice_in_dim(d_kernel, d_w, start, axis=axis)
        if d_bias is not None:
            d_bias = jax.lax.dynamic_update_slice_in_dim(
                d_bias, jnp.sum(g, axis=(0, 1)).astype(d_bias.dtype), start, axis=1)
        return d_hidden, d_kernel, d_bias, d_temp - jnp.sum(g_z * z) / temperature

    init = (jnp.zeros(hidden.shape, acc), jnp.zeros_like(kernel),
            None if bias is None else jnp.zeros_like(bias), jnp.zeros((), acc))
    d_hidden, d_kernel, d_bias, d_temp = _scan_blocks(body, init, width, chunk_size)
    return (d_hidden.astype(hidden.dtype), d_kernel, d_bias, None,
            d_temp.astype(temperature.dtype))


_fused.defvjp(_fused_fwd, _fused_bwd)


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _check_args(hidden, kernel, bias, tokens, chunk_size, vocab_axis, vocab_shards):
    """The checked ``tokens``. Raises ValueError (see ``chunked_logprobs_and_entropy``)."""
    _check_count("chunk_size", chunk_size)
    _check_count("vocab_shards", vocab_shards)
    if vocab_axis not in (0, 1):
        raise ValueError(f"vocab_axis must be 0 ([V, D] kernel) or 1 ([D, V]), got {vocab_axis!r}")
    for name, x, ndim in (("hidden", hidden, 3), ("kernel", kernel, 2)):
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim != ndim:
            raise ValueError(f"{name} must be a rank-{ndim} float array, got shape "
                             f"{tuple(x.shape)} and dtype {x.dtype}")
    vocab, width = kernel.shape[vocab_axis], kernel.shape[1 - vocab_axis]
    if width != hidden.shape[-1]:
        raise ValueError(f"kernel {tuple(kernel.shape)} (vocab_axis={vocab_axis}) does not match "
                         f"hidden {tuple(hidden.shape)}: expected D={hidden.shape[-1]}")
    if bias is not None and tuple(jnp.shape(bias)) != (vocab,):
        raise ValueError(f"bias must have shape ({vocab},), got {tuple(jnp.shape(bias))}")
    if vocab % vocab_shards:
        raise ValueError(f"vocab_shards={vocab_shards} does not divide the vocabulary V={vocab}")
    tokens = V.as_int("tokens", tokens, ndim=2)
    if tuple(tokens.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"tokens has shape {tuple(tokens.shape)} but hidden has shape "
                         f"{tuple(hidden.shape)}; expected tokens [B, T] for hidden [B, T, D]")
    return tokens


def chunked_logprobs_and_entropy(hidden: jax.Array, kernel: jax.Array, tokens: jax.Array,
                                 temperature: Any = 1.0, *, chunk_size: int,
                                 bias: jax.Array | None = None, vocab_axis: int = 1,
                                 vocab_shards: int = 1):
    """Log-prob of ``tokens`` and entropy under ``softmax((hidden @ W + b) / temperature)``,
    without forming the ``[B, T, V]`` logits. The module docstring gives the formulas and sources.

    Equal (to float32 rounding) to ``logprobs_from_logits(logits, tokens, temperature)`` and
    ``entropy_from_logits(logits, temperature)`` with
    ``logits = einsum(hidden, W, preferred_element_type=float32) + b``, in value and in
    gradient w.r.t. ``hidden``, ``kernel``, ``bias`` and ``temperature``, for any cotangents of
    both outputs. Peak memory of the head: a few ``[B, T, min(chunk_size, V)]`` float32 blocks
    plus the kernel-shaped gradient, instead of several ``[B, T, V]``.

    With ``vocab_shards = S > 1`` the vocabulary is seen as ``S`` contiguous shards of ``V / S``
    columns and each block takes ``chunk_size`` columns of EVERY shard (``[B, T, S, chunk]``):
    when the kernel's vocabulary axis is split over ``S`` devices (Megatron's vocab-parallel
    head, the ``tensor`` mesh axis), every device slices its own columns and only ``[B, T]``
    partial maxima and sums cross devices. With ``S = 1`` on such a kernel, XLA would gather
    the whole kernel on every device to slice it.

    Args:
      hidden: ``[B, T, D]`` float, the final hidden states (any float dtype: it is the matmul's
        input dtype; products accumulate in float32).
      kernel: the LM head, ``[D, V]`` (``vocab_axis=1``, an untied ``unembed/kernel``) or
        ``[V, D]`` (``vocab_axis=0``, a tied embedding matrix / HF ``lm_head.weight``), float,
        in the same dtype as ``hidden``.
      tokens: ``[B, T]`` int target ids in ``[0, V)`` (values not checked: an id outside gives
        ``logprob = -lse``, not the plain path's clamped gather).
      temperature: positive scalar (Python float or traced 0-d array).
      chunk_size: vocabulary columns per block (static, >= 1; ``>= V`` is one block); per
        shard when ``vocab_shards > 1``.
      bias: optional ``[V]`` float head bias.
      vocab_axis: which axis of ``kernel`` is the vocabulary (static).
      vocab_shards: ``S``, the number of devices the vocabulary axis is split over (static;
        must divide ``V``). The values do not depend on it.

    Returns:
      ``(logprobs [B, T], entropy [B, T])``, float32 (float64 for float64 ``hidden``; entropy
      in nats).

    Raises:
      ValueError: wrong ranks / dtypes, ``kernel`` not matching ``hidden``'s ``D``, a bias that is
        not ``[V]``, tokens not ``[B, T]``, ``chunk_size < 1``, ``vocab_axis`` not 0 or 1,
        ``vocab_shards`` < 1 or not dividing ``V``, or a static ``temperature <= 0``.
    """
    V.check_positive("temperature", temperature)
    hidden, kernel = jnp.asarray(hidden), jnp.asarray(kernel)
    bias = None if bias is None else jnp.asarray(bias)
    tokens = _check_args(hidden, kernel, bias, tokens, chunk_size, vocab_axis, vocab_shards)
    temperature = jnp.asarray(temperature, _acc(hidden))
    kernel = _shard_view(kernel, vocab_axis, vocab_shards)
    bias = None if bias is None else bias.reshape(vocab_shards, -1)
    return _fused(chunk_size, vocab_axis, hidden, kernel, bias, tokens, temperature)
