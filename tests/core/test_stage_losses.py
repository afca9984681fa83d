"""Stage 1 and 2 losses: SFT next-token NLL (masked, micro-batch exact) and Bradley-Terry."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax import core


class BradleyTerryTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_loss_and_gradient_for_given_scores(self):
        # r_c = 1, r_r = 0: -log sigmoid(1) = log(1 + e^-1) = 0.31326; d/dr_c = -sigmoid(-1) = -0.26894
        fn = self.variant(lambda rc, rr: core.bradley_terry_loss(rc, rr)[0].sum())
        rc, rr = jnp.array([1.0]), jnp.array([0.0])
        np.testing.assert_allclose(fn(rc, rr), np.log1p(np.exp(-1.0)), rtol=1e-6)
        np.testing.assert_allclose(fn(rc, rr), 0.3133, atol=5e-5)
        g_c, g_r = jax.grad(fn, argnums=(0, 1))(rc, rr)
        np.testing.assert_allclose(g_c, [-0.2689], atol=5e-5)
        np.testing.assert_allclose(g_r, [0.2689], atol=5e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_margin_is_subtracted_and_stats_per_pair(self):
        rc = jnp.array([2.0, -1.0, 30.0, -40.0])
        rr = jnp.array([0.5, 0.0, 0.0, 0.0])
        margin = jnp.array([1.0, 0.0, 0.0, 0.0])
        loss, stats = self.variant(core.bradley_terry_loss)(rc, rr, margin)
        d = np.array([2.0 - 0.5 - 1.0, -1.0, 30.0, -40.0], np.float64)
        want = np.log1p(np.exp(-d))  # float64 reference; finite at both extremes
        np.testing.assert_allclose(loss, want, rtol=1e-6)
        np.testing.assert_array_equal(stats["accuracy"], [1.0, 0.0, 1.0, 0.0])
        np.testing.assert_allclose(stats["margin"], [1.5, -1.0, 30.0, -40.0])

    def test_shape_mismatch_is_named(self):
        with pytest.raises(ValueError, match="rejected_scores"):
            core.bradley_terry_loss(jnp.zeros(3), jnp.zeros(2))
        with pytest.raises(ValueError, match="margin"):
            core.bradley_terry_loss(jnp.zeros(3), jnp.zeros(3), jnp.zeros(2))


class NLLTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_masked_token_mean_ignores_prompt_padding_and_nan(self):
        lp = jnp.array([[-1.0, -2.0, jnp.nan], [-0.5, -4.0, -8.0]])
        mask = jnp.array([[1, 1, 0], [0, 1, 1]])
        loss, stats = self.variant(lambda x: core.nll_loss(x, mask))(lp)
        np.testing.assert_allclose(loss, (1 + 2 + 4 + 8) / 4)
        np.testing.assert_allclose(stats["tokens"], 1.0)
        g = jax.grad(lambda x: core.nll_loss(x, mask)[0])(lp)
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(g, -np.asarray(mask) / 4)

    def test_micro_batches_sum_to_the_whole_minibatch_mean(self):
        rng = np.random.default_rng(0)
        lp = -rng.random((6, 5)).astype(np.float32)
        mask = (rng.random((6, 5)) > 0.4).astype(np.int32)
        whole, _ = core.nll_loss(lp, mask)
        n = mask.sum()
        parts = sum(float(core.nll_loss(lp[i:i + 2], mask[i:i + 2], loss_normalizer=n)[0])
                    for i in range(0, 6, 2))
        np.testing.assert_allclose(parts, whole, rtol=1e-6)
        np.testing.assert_allclose(whole, -(lp * mask).sum() / n, rtol=1e-6)

    def test_next_token_shift(self):
        ids = jnp.array([[5, 6, 7, 8]])
        loss_mask = jnp.array([[0, 0, 1, 1]])  # tokens 7 and 8 are the response
        targets, mask = core.shift_for_next_token(ids, loss_mask)
        np.testing.assert_array_equal(targets, [[6, 7, 8]])
        np.testing.assert_array_equal(mask, [[0, 1, 1]])  # logits at 1 -> 7, at 2 -> 8
