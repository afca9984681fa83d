"""Policy / value loss behaviours: clipping variants and micro-batch-exact token means."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax import core


class PolicyClipTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_asymmetric_clip_uses_cliprange_high_above_one(self):
        # ratio e^0.4 = 1.49 with A = 1: clipped at 1 + 0.28; ratio e^-0.4 = 0.67 with A = -1:
        # clipped at 1 - 0.2 (the low side keeps cliprange).
        lp = jnp.array([[0.4, -0.4]])
        adv = jnp.array([[1.0, -1.0]])
        fn = self.variant(lambda lp: core.policy_loss(lp, jnp.zeros((1, 2)), adv, jnp.ones((1, 2)),
                                                      cliprange=0.2, cliprange_high=0.28))
        loss, stats = fn(lp)
        np.testing.assert_allclose(loss, 0.5 * (-1.28 + 0.8), rtol=1e-6)
        np.testing.assert_allclose(stats["clipfrac"], 1.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_dual_clip_caps_negative_advantage_loss(self):
        # A = -1, ratio e^1.6 = 4.95: plain PPO loss 4.95; dual-clip c = 3 caps it at 3.
        # A = +1 tokens are never dual-clipped.
        lp = jnp.array([[1.6, 1.6]])
        adv = jnp.array([[-1.0, 1.0]])
        mask = jnp.ones((1, 2))

        def run(dual_clip):
            return self.variant(lambda lp: core.policy_loss(lp, jnp.zeros((1, 2)), adv, mask, cliprange=0.2,
                                                            dual_clip=dual_clip))(lp)

        plain, plain_stats = run(None)
        dual, dual_stats = run(3.0)
        np.testing.assert_allclose(plain, 0.5 * (np.exp(1.6) - 1.2), rtol=1e-6)
        np.testing.assert_allclose(dual, 0.5 * (3.0 - 1.2), rtol=1e-6)
        assert float(plain_stats["dual_clipfrac"]) == 0.0
        assert float(dual_stats["dual_clipfrac"]) == 0.5

    @chex.variants(with_jit=True, without_jit=True)
    def test_first_minibatch_has_ratio_one_and_zero_approxkl(self):
        lp = jnp.array([[-1.0, -2.0, 0.3]])
        fn = self.variant(lambda lp: core.policy_loss(lp, lp, jnp.array([[1.0, -2.0, 5.0]]),
                                                      jnp.array([[1, 1, 0]]), cliprange=0.2))
        loss, stats = fn(lp)
        assert float(stats["ratio"]) == 1.0 and float(stats["approxkl"]) == 0.0
        assert float(stats["clipfrac"]) == 0.0 and float(loss) == 0.5

    @chex.variants(with_jit=True, without_jit=True)
    def test_value_loss_takes_the_larger_of_clipped_and_unclipped_error(self):
        # V = 2, old = 0, c = 0.5 -> clipped 0.5; R = 0: errors 4 and 0.25 -> 0.5 * 4.
        # V = 0.2, old = 0, R = 1: V inside the clip, both errors 0.64.
        fn = self.variant(lambda v: core.value_loss(v, jnp.zeros((1, 2)), jnp.array([[0.0, 1.0]]),
                                                    jnp.ones((1, 2)), cliprange_value=0.5))
        loss, stats = fn(jnp.array([[2.0, 0.2]]))
        np.testing.assert_allclose(loss, 0.5 * (4.0 + 0.64) / 2, rtol=1e-6)
        np.testing.assert_allclose(stats["value_error"], (4.0 + 0.64) / 2, rtol=1e-6)
        assert float(stats["vf_clipfrac"]) == 0.0
        loss, stats = fn(jnp.array([[-0.2, 0.2]]))  # R = 0 at V = -0.2: not clipped either
        assert float(stats["vf_clipfrac"]) == 0.0


def test_micro_batch_losses_sum_to_the_full_batch_token_mean():
    # One micro-batch with one token of loss 1, one with three tokens of loss 0 -> 0.25
    # (a mean of means would say 0.5).
    zeros = jnp.zeros((1, 3))
    mb1 = dict(adv=jnp.array([[-1.0, 7.0, 7.0]]), mask=jnp.array([[1, 0, 0]]))
    mb2 = dict(adv=jnp.zeros((1, 3)), mask=jnp.ones((1, 3)))
    total = 4
    out = [core.policy_loss(zeros, zeros, mb["adv"], mb["mask"], cliprange=0.2, loss_normalizer=total)
           for mb in (mb1, mb2)]
    loss, stats = jax.tree.map(jnp.add, *out)
    assert float(loss) == 0.25
    assert float(stats["ratio"]) == 1.0  # stats aggregate the same way

    # Same for the value loss: 0.5 (sqrt(2) - 0)^2 = 1 on one token, 0 on three.
    values = (jnp.array([[np.sqrt(2.0), 0.0, 0.0]]), zeros)
    vout = [core.value_loss(v, zeros, zeros, mb["mask"], cliprange_value=10.0, loss_normalizer=total)
            for v, mb in zip(values, (mb1, mb2))]
    vloss, vstats = jax.tree.map(jnp.add, *vout)
    np.testing.assert_allclose(vloss, 0.25, rtol=1e-6)
    np.testing.assert_allclose(vstats["value_error"], 0.5, rtol=1e-6)


def test_scanned_micro_batches_with_traced_normalizer_equal_full_batch_loss_stats_and_grads():
    rng = np.random.default_rng(0)
    b, t = 4, 6
    mask = jnp.asarray(np.arange(t)[None] < np.array([[6], [1], [0], [4]]))
    lp, old, adv = (jnp.asarray(rng.normal(0, 0.3, (b, t)), jnp.float32) for _ in range(3))

    def full(lp):
        return core.policy_loss(lp, old, adv, mask, cliprange=0.1)

    @jax.jit
    def accumulated(lp):
        n = core.masked_count(mask)

        def body(carry, mb):
            def loss_fn(lp_mb):
                return core.policy_loss(lp_mb, mb[1], mb[2], mb[3], cliprange=0.1, loss_normalizer=n)

            (loss, stats), grad = jax.value_and_grad(loss_fn, has_aux=True)(mb[0])
            return jax.tree.map(jnp.add, carry, (loss, stats)), grad

        split = [x.reshape(2, 2, t) for x in (lp, old, adv, mask)]
        init = jax.tree.map(jnp.zeros_like, jax.eval_shape(full, lp))
        (loss, stats), grads = jax.lax.scan(body, init, split)
        return loss, stats, grads.reshape(b, t)

    (want_loss, want_stats), want_grad = jax.value_and_grad(full, has_aux=True)(lp)
    loss, stats, grad = accumulated(lp)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    chex.assert_trees_all_close(stats, want_stats, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6)


def test_losses_of_an_all_padding_batch_are_zero_not_nan():
    nan = jnp.full((2, 3), jnp.nan)
    mask = jnp.zeros((2, 3))
    loss, stats = core.policy_loss(nan, nan, nan, mask, cliprange=0.2)
    vloss, vstats = core.value_loss(nan, nan, nan, mask, cliprange_value=0.2)
    for x in jax.tree.leaves((loss, stats, vloss, vstats)):
        assert float(x) == 0.0
