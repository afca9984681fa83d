"""NaN / inf in masked slots never reach a value or a gradient, in any function."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax import core

MASK = jnp.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
PAD = MASK == 0


def poisoned(x, fill=jnp.nan):
    return jnp.where(PAD, fill, x)


def base(seed):
    return jnp.asarray(np.random.default_rng(seed).normal(0, 0.5, MASK.shape), jnp.float32)


def all_finite(tree):
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


class MaskedNanTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_nan_in_padding_never_reaches_losses_or_their_gradients(self):
        lp, old, adv = poisoned(base(0)), poisoned(base(1), jnp.inf), poisoned(base(2))
        v, old_v, ret = poisoned(base(3), -jnp.inf), poisoned(base(4)), poisoned(base(5), 1e38)

        @self.variant
        def run(lp, v):
            def total(lp, v):
                pg, pst = core.policy_loss(lp, old, adv, MASK, cliprange=0.2, dual_clip=3.0)
                vf, vst = core.value_loss(v, old_v, ret, MASK, cliprange_value=0.2)
                return pg + vf, (pst, vst)

            return jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(lp, v)

        (loss, stats), (g_lp, g_v) = run(lp, v)
        assert all_finite((loss, stats, g_lp, g_v))
        assert not bool(jnp.any(jnp.where(PAD, g_lp, 0))) and not bool(jnp.any(jnp.where(PAD, g_v, 0)))
        clean = jax.tree.map(lambda x: jnp.where(PAD, 0.0, x), (lp, old, adv, v, old_v, ret))
        pg, _ = core.policy_loss(clean[0], clean[1], clean[2], MASK, cliprange=0.2, dual_clip=3.0)
        vf, _ = core.value_loss(clean[3], clean[4], clean[5], MASK, cliprange_value=0.2)
        np.testing.assert_allclose(loss, pg + vf, rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_nan_in_padding_never_reaches_rewards_advantages_or_whitening(self):
        lp, ref, values = poisoned(base(0)), poisoned(base(1), jnp.inf), poisoned(base(2))
        scores = jnp.array([1.0, jnp.nan, -2.0])  # the empty row's score is never used

        @self.variant
        def run(lp, ref, values):
            out = []
            for est in core.KL_ESTIMATORS:
                out += list(core.compute_rewards(scores, lp, ref, MASK, kl_coef=0.1, estimator=est))
            for method in core.GAE_METHODS:
                adv, ret = core.compute_gae(values, out[0], MASK, gamma=0.99, lam=0.95, method=method)
                out += [adv, ret, core.masked_whiten(adv, MASK),
                        core.masked_whiten(ret, MASK, shift_mean=False)]
            stats = (core.masked_mean(values, MASK), core.masked_var(values, MASK),
                     core.masked_sum(values, MASK, axis=1), core.masked_mean(values, MASK, axis=1))
            return out, stats

        out, stats = run(lp, ref, values)
        assert all_finite((out, stats))
        for x in out:
            np.testing.assert_array_equal(jnp.where(PAD, x, 0), jnp.zeros(MASK.shape))

    def test_nan_in_padding_never_reaches_whitening_gradients(self):
        x = poisoned(base(6))

        @jax.jit
        def grads(x):
            return (jax.grad(lambda x: jnp.sum(core.masked_whiten(x, MASK) ** 3))(x),
                    jax.grad(lambda x: core.masked_var(x, MASK) + core.masked_mean(x, MASK))(x))

        g_whiten, g_stats = grads(x)
        assert all_finite((g_whiten, g_stats))
        np.testing.assert_array_equal(jnp.where(PAD, g_whiten, 0), jnp.zeros(MASK.shape))

    def test_entropy_and_full_kl_are_finite_with_minus_inf_logits(self):
        logits = jnp.array([[[0.0, -jnp.inf, 1.0], [2.0, 2.0, -jnp.inf]]])
        ref = jnp.array([[[0.5, 0.0, 1.0], [-jnp.inf, 2.0, 0.0]]])
        ent, g = jax.jit(jax.value_and_grad(lambda z: core.entropy_from_logits(z).sum()))(logits)
        assert all_finite((ent, g))
        two_way = core.entropy_from_logits(logits[..., [0, 2]]).sum() + np.log(2)  # -inf drops out
        np.testing.assert_allclose(ent, two_way, rtol=1e-6)
        kl = core.full_kl(logits, ref)
        assert bool(jnp.isfinite(kl[0, 0])) and float(kl[0, 1]) == np.inf  # p > 0 where q == 0
        finite_ref = jnp.where(jnp.isfinite(ref), ref, 0.0)  # p == 0 terms: finite value and grad
        assert all_finite(jax.jit(jax.value_and_grad(lambda z: core.full_kl(z, finite_ref).sum()))(logits))
