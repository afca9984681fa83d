"""Issue 2 acceptance items 1-6 and 8, with the exact numbers of the issue.

Item 7 (random ragged batches against a numpy loop in float64) is test_numpy_reference.py.
Every check runs with and without ``jax.jit`` (chex variants).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax import core


class AcceptanceTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_score_lands_on_eos_and_advantages_discount_back(self):
        # 1. Response [t0, t1, EOS, PAD, PAD], score 1, zero KL, values 0, gamma 1, lam 0.95.
        mask = jnp.array([[1, 1, 1, 0, 0]])
        logprobs = jnp.array([[-0.5, -1.0, -0.2, 0.0, 0.0]])

        @self.variant
        def run(scores, logprobs, mask):
            rewards, non_score = core.compute_rewards(scores, logprobs, logprobs, mask, kl_coef=0.1)
            adv, returns = core.compute_gae(jnp.zeros((1, 5)), rewards, mask, gamma=1.0, lam=0.95)
            return rewards, non_score, adv, returns

        rewards, non_score, adv, returns = run(jnp.array([1.0]), logprobs, mask)
        np.testing.assert_array_equal(rewards, [[0, 0, 1, 0, 0]])
        np.testing.assert_array_equal(non_score, np.zeros((1, 5)))
        np.testing.assert_allclose(adv, [[0.9025, 0.95, 1, 0, 0]], rtol=0, atol=1e-7)
        np.testing.assert_allclose(returns, [[0.9025, 0.95, 1, 0, 0]], rtol=0, atol=1e-7)

    @chex.variants(with_jit=True, without_jit=True)
    def test_value_in_padded_slot_does_not_leak_into_advantages(self):
        # 2. Mask [1,1,0], rewards [0,1,0], values [0,0,100], gamma 1, lam 0.95.
        values = jnp.array([[0.0, 0.0, 100.0]])
        rewards = jnp.array([[0.0, 1.0, 0.0]])
        mask = jnp.array([[1, 1, 0]])
        for method in core.GAE_METHODS:
            gae = self.variant(lambda v, r, m: core.compute_gae(v, r, m, gamma=1.0, lam=0.95, method=method))
            adv, returns = gae(values, rewards, mask)
            np.testing.assert_allclose(adv, [[0.95, 1.0, 0.0]], rtol=0, atol=1e-7, err_msg=method)
            np.testing.assert_allclose(returns, [[0.95, 1.0, 0.0]], rtol=0, atol=1e-7, err_msg=method)

    @chex.variants(with_jit=True, without_jit=True)
    def test_empty_row_gets_no_score_anywhere(self):
        # 3. Mask [0,0,0], score 10: rewards all zero, nothing written at index -1.
        lp = jnp.array([[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0]])
        mask = jnp.array([[0, 0, 0], [1, 1, 1]])
        run = self.variant(lambda s, lp, m: core.compute_rewards(s, lp, lp, m, kl_coef=0.1))
        rewards, non_score = run(jnp.array([10.0, 10.0]), lp, mask)
        np.testing.assert_array_equal(rewards, [[0, 0, 0], [0, 0, 10]])
        np.testing.assert_array_equal(non_score, np.zeros((2, 3)))

    @chex.variants(with_jit=True, without_jit=True)
    def test_whiten_with_one_valid_entry_is_finite(self):
        # 4. masked_whiten([[0.7, 0, 0]], mask [[1, 0, 0]]) is finite.
        out = self.variant(core.masked_whiten)(jnp.array([[0.7, 0.0, 0.0]]), jnp.array([[1, 0, 0]]))
        assert np.all(np.isfinite(out))
        np.testing.assert_array_equal(out, [[0.0, 0.0, 0.0]])
        keep = self.variant(lambda x, m: core.masked_whiten(x, m, shift_mean=False))
        np.testing.assert_allclose(keep(jnp.array([[0.7, 0.0, 0.0]]), jnp.array([[1, 0, 0]])), [[0.7, 0, 0]])

    @chex.variants(with_jit=True, without_jit=True)
    def test_nan_old_logprob_in_masked_slot_gives_exact_loss_and_finite_gradient(self):
        # 5. logprobs [[0,0]], old [[0,NaN]], advantages [[1,1]], mask [[1,0]]: loss -1.0.
        old = jnp.array([[0.0, jnp.nan]])
        adv = jnp.array([[1.0, 1.0]])
        mask = jnp.array([[1, 0]])

        def loss_fn(lp):
            return core.policy_loss(lp, old, adv, mask, cliprange=0.2)[0]

        loss, grad = self.variant(jax.value_and_grad(loss_fn))(jnp.zeros((1, 2)))
        assert float(loss) == -1.0
        np.testing.assert_array_equal(grad, [[-1.0, 0.0]])

    @chex.variants(with_jit=True, without_jit=True)
    def test_temperature_scales_logprob_and_entropy(self):
        # 6. logits [2,1,0], temperature 0.5, token 0: logprob -0.1429 (not -0.4076),
        #    entropy 0.4411 (not 0.8323).
        logits = jnp.array([[[2.0, 1.0, 0.0]]])
        tokens = jnp.array([[0]])
        lp = self.variant(lambda l, t: core.logprobs_from_logits(l, t, 0.5))(logits, tokens)
        ent = self.variant(lambda l: core.entropy_from_logits(l, 0.5))(logits)
        np.testing.assert_allclose(lp, [[-0.1429]], atol=5e-5)
        np.testing.assert_allclose(ent, [[0.4411]], atol=5e-5)
        lp1 = self.variant(lambda l, t: core.logprobs_from_logits(l, t))(logits, tokens)
        ent1 = self.variant(core.entropy_from_logits)(logits)
        np.testing.assert_allclose(lp1, [[-0.4076]], atol=5e-5)
        np.testing.assert_allclose(ent1, [[0.8323]], atol=1e-4)  # 0.832396: the issue truncates
        assert lp.dtype == jnp.float32 and ent.dtype == jnp.float32


def test_adaptive_kl_controller_inside_jit_follows_the_formula():
    # 8. Three updates inside jax.jit; the coefficient is an array in state.
    state = core.init_kl_controller("adaptive", 0.2, target=6.0, horizon=10000.0)
    kls = jnp.array([8.0, 3.0, 6.6])

    @jax.jit
    def three_updates(state, kls):
        for i in range(3):
            state = core.update_kl_controller(state, kls[i], 256)
        return state

    out = three_updates(state, kls)
    # By hand: error clip(kl/6 - 1, +-0.2) = 0.2, -0.2, 0.1; mult = 1 + error * 256 / 10000.
    # 0.2 * 1.00512 = 0.201024; * 0.99488 = 0.19999475712; * 1.00256 = 0.2005067437...
    expected = 0.2
    for kl in (8.0, 3.0, 6.6):
        expected *= 1 + np.clip(kl / 6.0 - 1, -0.2, 0.2) * 256 / 10000.0
    np.testing.assert_allclose(expected, 0.20050674369823, rtol=1e-12)
    assert isinstance(out.value, jax.Array) and out.value.shape == () and out.value.dtype == jnp.float32
    np.testing.assert_allclose(out.value, 0.20050674369823, rtol=1e-6)

    step = jax.jit(core.update_kl_controller)
    values = []
    for kl in (8.0, 3.0, 6.6):
        state = step(state, jnp.float32(kl), 256)
        values.append(float(state.value))
    np.testing.assert_allclose(values, [0.201024, 0.19999475712, 0.20050674369823], rtol=1e-6)
