"""Edge cases found by a fresh-user probe: zero-length responses, garbage in masked slots under
differentiation, the chunked GAE's gradient at gamma * lam = 0, non-scalar clip ranges."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax import core


def test_zero_length_responses_give_empty_rewards():
    empty = jnp.zeros((3, 0))
    rewards, non_score = core.compute_rewards(jnp.ones(3), empty, empty, empty, kl_coef=0.1)
    assert rewards.shape == non_score.shape == (3, 0)
    rewards, _ = core.compute_rewards_from_kl(jnp.ones(3), empty, empty, kl_coef=0.1)
    assert rewards.shape == (3, 0)


def test_nan_in_masked_kl_slots_reaches_no_gradient():
    rng = np.random.default_rng(0)
    mask = (np.arange(9)[None] < rng.integers(1, 10, (4, 1))).astype(np.float32)
    kl = rng.normal(size=(4, 9)).astype(np.float32)
    clean = np.where(mask > 0, kl, 0.0)
    dirty = np.where(mask > 0, kl, np.nan)

    def total(coef, kl):
        return core.compute_rewards_from_kl(jnp.ones(4), kl, mask, kl_coef=coef)[0].sum()

    g_dirty = jax.grad(total)(0.1, dirty)
    assert np.isfinite(g_dirty)
    np.testing.assert_allclose(g_dirty, jax.grad(total)(0.1, clean), rtol=1e-6)
    np.testing.assert_allclose(g_dirty, -clean.sum(), rtol=1e-5)


def test_every_gae_method_has_the_same_gradient_at_lam_zero():
    rng = np.random.default_rng(1)
    values = jnp.asarray(rng.normal(size=(2, 13)), jnp.float32)
    rewards = jnp.asarray(rng.normal(size=(2, 13)), jnp.float32)
    mask = jnp.ones((2, 13))

    def grad(method):
        f = lambda lam: core.compute_gae(values, rewards, mask, gamma=0.9, lam=lam, method=method,
                                         chunk=4)[0].sum()
        return jax.grad(f)(0.0)

    scan = grad("scan")
    assert np.isfinite(scan)
    for method in ("chunked", "associative"):
        np.testing.assert_allclose(grad(method), scan, rtol=1e-5, err_msg=method)


@pytest.mark.parametrize("bad", [np.full(5, 0.2), "0.2", None])
def test_clip_ranges_must_be_numeric_scalars(bad):
    x = jnp.zeros((2, 5))
    m = jnp.ones((2, 5))
    with pytest.raises(ValueError, match="cliprange must be"):
        core.policy_loss(x, x, x, m, cliprange=bad)
    if bad is not None:  # cliprange_high=None means "same as cliprange"
        with pytest.raises(ValueError, match="cliprange_high must be"):
            core.policy_loss(x, x, x, m, cliprange=0.2, cliprange_high=bad)
    with pytest.raises(ValueError, match="cliprange_value must be"):
        core.value_loss(x, x, x, m, cliprange_value=bad)
