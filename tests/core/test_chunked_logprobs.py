"""`core.chunked_logprobs_and_entropy` against the full-logits path: values and gradients
(w.r.t. hidden, kernel, bias, temperature, for a random mix of both outputs), every block
layout (ragged last block, one block, one column), both kernel layouts, a vocabulary seen as
shards, bfloat16 inputs, a float64 numpy reference, and no `[B, T, V]` array in the compiled
gradient (the sharded layout on 8 devices: tests/parallel/test_sharded_head.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.core import chunked_logprobs_and_entropy, entropy_from_logits, logprobs_from_logits

B, T, D, VOCAB = 2, 3, 8, 37


def inputs(dtype=jnp.float32, vocab=VOCAB, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    hidden = jax.random.normal(k[0], (B, T, D)).astype(dtype)
    kernel = (0.7 * jax.random.normal(k[1], (D, vocab))).astype(dtype)
    bias = 0.3 * jax.random.normal(k[2], (vocab,))
    tokens = jax.random.randint(k[3], (B, T), 0, vocab)
    tokens = tokens.at[0, 0].set(0).at[0, 1].set(vocab - 1)  # first and last column
    return hidden, kernel, bias, tokens, jax.random.normal(k[4], (B, T)), jax.random.normal(k[5], (B, T))


def plain(hidden, kernel, bias, tokens, temperature):
    logits = jnp.einsum("btd,dv->btv", hidden, kernel, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias
    return logprobs_from_logits(logits, tokens, temperature), entropy_from_logits(logits, temperature)


def chunked(chunk_size, vocab_axis=1):
    def fn(hidden, kernel, bias, tokens, temperature):
        w = kernel.T if vocab_axis == 0 else kernel
        return chunked_logprobs_and_entropy(hidden, w, tokens, temperature, chunk_size=chunk_size,
                                            bias=bias, vocab_axis=vocab_axis)
    return fn


def mixed_loss(fn, tokens, a, c):
    """A random linear combination of both outputs, as a function of (hidden, kernel, bias, tau)."""
    def loss(hidden, kernel, bias, temperature):
        logprobs, entropy = fn(hidden, kernel, bias, tokens, temperature)
        return jnp.sum(a * logprobs + c * entropy)
    return loss


def max_diffs(x, y):
    return [float(jnp.max(jnp.abs(jnp.asarray(u, jnp.float32) - jnp.asarray(v, jnp.float32))))
            for u, v in zip(x, y)]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("vocab_axis", [1, 0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 8, VOCAB, 100])  # ragged, one block, bigger than V
def test_values_and_gradients_equal_the_full_logits_path(chunk_size, temperature, vocab_axis, jit):
    hidden, kernel, bias, tokens, a, c = inputs()
    wrap = jax.jit if jit else (lambda f: f)
    want = plain(hidden, kernel, bias, tokens, temperature)
    got = wrap(chunked(chunk_size, vocab_axis))(hidden, kernel, bias, tokens, temperature)
    assert all(x.dtype == jnp.float32 and x.shape == (B, T) for x in got)
    assert max(max_diffs(got, want)) < 1e-5
    args = (hidden, kernel, bias, jnp.float32(temperature))
    g_want = jax.grad(mixed_loss(plain, tokens, a, c), argnums=(0, 1, 2, 3))(*args)
    g_got = wrap(jax.grad(mixed_loss(chunked(chunk_size, vocab_axis), tokens, a, c),
                          argnums=(0, 1, 2, 3)))(*args)
    diffs = max_diffs(g_got, g_want)
    assert max(diffs[:3]) < 1e-5, diffs
    np.testing.assert_allclose(g_got[3], g_want[3], rtol=1e-5)  # d/dtemperature (a sum of B*T*V)


@pytest.mark.parametrize("which", [0, 1])
def test_each_output_alone_has_the_full_logits_gradient(which):
    """A policy loss without an entropy bonus (zero entropy cotangent), and the other way round."""
    hidden, kernel, _, tokens, _, _ = inputs(seed=3)

    def loss(fn):
        return lambda h, k: jnp.sum(fn(h, k, None, tokens, 1.3)[which])

    g_want = jax.grad(loss(plain), argnums=(0, 1))(hidden, kernel)
    g_got = jax.grad(loss(chunked(10)), argnums=(0, 1))(hidden, kernel)
    assert max(max_diffs(g_got, g_want)) < 1e-5


@pytest.mark.parametrize("vocab_axis", [1, 0])
@pytest.mark.parametrize("chunk_size", [3, 10, 64])
def test_a_vocabulary_seen_as_shards_gives_the_same_values_and_gradients(chunk_size, vocab_axis):
    """vocab_shards=4 on V=40: blocks of every shard's columns (ragged, whole shard, one block)."""
    hidden, kernel, bias, tokens, a, c = inputs(vocab=40, seed=7)

    def sharded(h, k, b, tok, tau):
        w = k.T if vocab_axis == 0 else k
        return chunked_logprobs_and_entropy(h, w, tok, tau, chunk_size=chunk_size, bias=b,
                                            vocab_axis=vocab_axis, vocab_shards=4)

    assert max(max_diffs(sharded(hidden, kernel, bias, tokens, 0.9),
                         plain(hidden, kernel, bias, tokens, 0.9))) < 1e-5
    args = (hidden, kernel, bias, jnp.float32(0.9))
    g_want = jax.grad(mixed_loss(plain, tokens, a, c), argnums=(0, 1, 2))(*args)
    g_got = jax.jit(jax.grad(mixed_loss(sharded, tokens, a, c), argnums=(0, 1, 2)))(*args)
    assert max(max_diffs(g_got, g_want)) < 1e-5


def test_bfloat16_inputs_match_the_bfloat16_full_logits_path():
    hidden, kernel, bias, tokens, a, c = inputs(jnp.bfloat16)
    want = plain(hidden, kernel, None, tokens, 1.0)
    got = chunked(8)(hidden, kernel, None, tokens, 1.0)
    assert max(max_diffs(got, want)) < 1e-5  # same bf16 products, float32 sums
    g_want = jax.grad(mixed_loss(plain, tokens, a, c), argnums=(0, 1))(hidden, kernel, None, 1.0)
    g_got = jax.grad(mixed_loss(chunked(8), tokens, a, c), argnums=(0, 1))(hidden, kernel, None, 1.0)
    assert all(g.dtype == jnp.bfloat16 for g in g_got)
    for x, y in zip(g_got, g_want):  # bf16 rounding of the gradients themselves
        scale = float(jnp.max(jnp.abs(y.astype(jnp.float32))))
        assert float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))) < 1e-2 * scale


def test_float64_matches_a_numpy_reference(x64):
    hidden, kernel, bias, tokens, _, _ = inputs()
    h, w, b = (np.asarray(x, np.float64) for x in (hidden, kernel, bias))
    z = (h @ w + b) / 0.8
    z_max = z.max(-1, keepdims=True)
    logp = z - (z_max + np.log(np.exp(z - z_max).sum(-1, keepdims=True)))
    want_lp = np.take_along_axis(logp, np.asarray(tokens)[..., None], -1)[..., 0]
    want_h = -(np.exp(logp) * logp).sum(-1)
    lp, ent = chunked_logprobs_and_entropy(jnp.asarray(h), jnp.asarray(w), tokens, 0.8,
                                           chunk_size=5, bias=jnp.asarray(b))
    assert lp.dtype == jnp.float64
    np.testing.assert_allclose(lp, want_lp, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ent, want_h, rtol=1e-12, atol=1e-12)


def test_large_logits_keep_entropy_accurate():
    """Peaked distributions (|logits| ~ 100): the running state is kept relative to the max."""
    hidden, kernel, _, tokens, _, _ = inputs(seed=5)
    hidden = 30.0 * hidden
    want = plain(hidden, kernel, None, tokens, 1.0)
    got = chunked(6)(hidden, kernel, None, tokens, 1.0)
    assert max(max_diffs(got, want)) < 1e-4 and bool(jnp.all(jnp.isfinite(got[1])))


def test_no_full_vocabulary_array_in_the_compiled_gradient():
    vocab, chunk = 1000, 64
    hidden, kernel, _, tokens, a, c = inputs(vocab=vocab)

    def hlo(fn):
        grad = jax.jit(jax.grad(mixed_loss(fn, tokens, a, c), argnums=(0, 1)))
        return grad.lower(hidden, kernel, None, 1.0).compile().as_text()

    full = f"[{B},{T},{vocab}]"
    assert full in hlo(plain)  # the check can see such an array
    text = hlo(chunked(chunk))
    assert full not in text and f"{B * T},{vocab}]" not in text


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=4, vocab_axis=2), "vocab_axis"),
    (dict(chunk_size=4, bias=jnp.zeros(5)), "bias"),
    (dict(chunk_size=4, temperature=0.0), "temperature"),
    (dict(chunk_size=4, vocab_shards=3), "vocab_shards=3 does not divide"),
    (dict(chunk_size=4, vocab_shards=0), "vocab_shards"),
])
def test_bad_arguments_raise(kwargs, match):
    hidden, kernel, _, tokens, _, _ = inputs()
    with pytest.raises(ValueError, match=match):
        chunked_logprobs_and_entropy(hidden, kernel, tokens, **kwargs)


def test_mismatched_shapes_raise():
    hidden, kernel, _, tokens, _, _ = inputs()
    with pytest.raises(ValueError, match="does not match"):
        chunked_logprobs_and_entropy(hidden, kernel.T, tokens, chunk_size=4)
    with pytest.raises(ValueError, match="tokens"):
        chunked_logprobs_and_entropy(hidden, kernel, tokens[:, :2], chunk_size=4)
