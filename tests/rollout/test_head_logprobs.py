"""The forward passes with `logprob_chunk_size > 0` (the LM head in vocabulary blocks) against
the full-logits path on tiny random Llamas: tied and untied heads, float32 and bfloat16
compute, values and gradients w.r.t. every param, and the shared-critic pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.models import init_model, split_model
from ppo_jax.models.tiny_random import tiny_config
from ppo_jax.rollout.forward import policy_logprobs, policy_logprobs_and_values

VOCAB, CHUNK, B, P, N = 203, 48, 2, 4, 5  # 203 = 4 blocks of 48 + a block of 11


def rollout(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.integers(4, VOCAB, (B, P)).astype(np.int32)
    qm = np.ones((B, P), np.int32)
    qm[1, :2] = 0
    r = rng.integers(0, VOCAB, (B, N)).astype(np.int32)
    r[0, 0], r[0, 1] = 0, VOCAB - 1  # first and last vocabulary column
    rm = np.ones((B, N), np.int32)
    rm[1, 3:] = 0
    return tuple(jnp.asarray(x) for x in (q, qm, r, rm))


def tiny(tied: bool, dtype: str = "float32"):
    model = init_model(tiny_config(VOCAB, tie_word_embeddings=tied, dtype=dtype), seed=1)
    return split_model(model)


def loss_of(graphdef, chunk, temperature, weights):
    a, c = weights

    def loss(params):
        lp, ent = policy_logprobs(graphdef, params, *rollout(), temperature=temperature,
                                  with_entropy=True, logprob_chunk_size=chunk)
        return jnp.sum(a * lp + c * ent), (lp, ent)
    return loss


def tree_max_diff(x, y):
    diffs = jax.tree.map(lambda u, v: float(jnp.max(jnp.abs(u.astype(jnp.float32) -
                                                            v.astype(jnp.float32)))), x, y)
    return max(jax.tree.leaves(diffs))


@pytest.mark.parametrize("tied, temperature", [  # one case in the default run (budget)
    (True, 0.6), pytest.param(True, 1.0, marks=pytest.mark.slow),
    pytest.param(False, 1.0, marks=pytest.mark.slow), pytest.param(False, 0.6, marks=pytest.mark.slow)])
def test_chunked_policy_logprobs_equal_the_full_logits_path(tied, temperature):
    graphdef, params = tiny(tied)
    k = jax.random.split(jax.random.PRNGKey(2))
    weights = (jax.random.normal(k[0], (B, N)), jax.random.normal(k[1], (B, N)))
    (_, want), g_want = jax.jit(jax.value_and_grad(loss_of(graphdef, 0, temperature, weights),
                                                   has_aux=True))(params)
    (_, got), g_got = jax.jit(jax.value_and_grad(loss_of(graphdef, CHUNK, temperature, weights),
                                                 has_aux=True))(params)
    assert tree_max_diff(got, want) < 1e-5
    assert tree_max_diff(g_got, g_want) < 1e-5
    lp_only = policy_logprobs(graphdef, params, *rollout(), temperature=temperature,
                              logprob_chunk_size=CHUNK)
    np.testing.assert_allclose(lp_only, got[0], atol=1e-6)


@pytest.mark.slow  # default-run budget (11 s on 2 cores); `make test-slow`
def test_bfloat16_compute_gives_the_full_logits_values_and_gradients():
    graphdef, params = tiny(True, "bfloat16")
    weights = (jnp.ones((B, N)), 0.5 * jnp.ones((B, N)))
    (_, want), g_want = jax.value_and_grad(loss_of(graphdef, 0, 1.0, weights), has_aux=True)(params)
    (_, got), g_got = jax.value_and_grad(loss_of(graphdef, CHUNK, 1.0, weights), has_aux=True)(params)
    assert tree_max_diff(got, want) < 1e-4
    scale = max(jax.tree.leaves(jax.tree.map(lambda g: float(jnp.max(jnp.abs(g))), g_want)))
    assert tree_max_diff(g_got, g_want) < 2e-2 * scale


def test_chunked_shared_critic_pass_equals_the_full_logits_pass():
    model = init_model(tiny_config(VOCAB, tie_word_embeddings=True), "causal_lm_value", seed=1,
                       head_init_std=0.01)  # a CausalLMWithValueHead with a non-zero value head
    graphdef, shared = split_model(model)

    def total(chunk):
        def loss(p):
            lp, ent, v = policy_logprobs_and_values(graphdef, p, *rollout(), temperature=0.9,
                                                    logprob_chunk_size=chunk)
            return jnp.sum(lp) - 0.1 * jnp.sum(ent) + jnp.sum(v ** 2), (lp, ent, v)
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(shared)

    (_, want), g_want = total(0)
    (_, got), g_got = total(CHUNK)
    assert tree_max_diff(got, want) < 1e-5
    assert tree_max_diff(g_got, g_want) < 1e-5
