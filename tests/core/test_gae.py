"""The three GAE implementations agree; chunking does not depend on T being a multiple."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax import core


@pytest.mark.parametrize("t,chunk", [(37, 8), (5, 32), (1, 1)])
def test_gae_methods_agree_for_any_length_and_chunk(t, chunk):
    rng = np.random.default_rng(t)
    values = jnp.asarray(rng.normal(size=(3, t)), jnp.float32)
    rewards = jnp.asarray(rng.normal(size=(3, t)), jnp.float32)
    mask = jnp.asarray(np.arange(t)[None] < np.array([[t], [t // 2], [0]]))
    def gae(method, **kw):
        return jax.jit(lambda v, r, m: core.compute_gae(v, r, m, gamma=0.99, lam=0.95, method=method, **kw))

    ref = gae("scan")(values, rewards, mask)
    for method, kw in (("chunked", dict(chunk=chunk)), ("associative", {}), ("scan", dict(unroll=4))):
        got = gae(method, **kw)(values, rewards, mask)
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-5, err_msg=method)
        np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-5, err_msg=method)


def test_gae_takes_traced_gamma_and_lam_and_zero_discount():
    values = jnp.array([[1.0, 2.0, 3.0]])
    rewards = jnp.array([[0.5, 0.0, 1.0]])
    mask = jnp.ones((1, 3))
    gae = jax.jit(lambda g, l: core.compute_gae(values, rewards, mask, gamma=g, lam=l))
    adv, _ = gae(jnp.float32(0.0), jnp.float32(0.0))  # A = r - V
    np.testing.assert_allclose(adv, [[-0.5, -2.0, -2.0]])
    adv, _ = gae(jnp.float32(1.0), jnp.float32(0.0))  # A = r + V' - V
    np.testing.assert_allclose(adv, [[1.5, 1.0, -2.0]])
