"""The built-in loss terms (entropy bonus, KL in the loss), reward shaping as a registered step,
and the example fork's losses, with hand-computed numbers."""

import importlib
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax import core

MASK = jnp.array([[1, 1, 0]])


class LossTermsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_entropy_bonus_is_minus_coef_times_entropy_and_pushes_entropy_up(self):
        ent = jnp.array([[0.5, 1.0, 9.0]])  # 9.0 is padding

        @self.variant
        def run(ent):
            def loss(ent):
                batch = core.masked_inputs(core.LossInputs(mask=MASK, entropy=ent))
                terms = core.policy_regularizers(batch, entropy_coef=0.1)
                return core.aggregate(terms["entropy_loss"], MASK), terms

            return jax.value_and_grad(loss, has_aux=True)(ent)

        (value, terms), grad = run(ent)
        assert set(terms) == {"entropy_loss"}
        np.testing.assert_allclose(terms["entropy_loss"], [[-0.05, -0.1, 0.0]], rtol=1e-6)
        np.testing.assert_allclose(value, -0.075, rtol=1e-6)
        np.testing.assert_allclose(grad, [[-0.05, -0.05, 0.0]], rtol=1e-6)  # -coef / N tokens

    @chex.variants(with_jit=True, without_jit=True)
    def test_kl_loss_is_coef_times_k3_differentiated_through_logprobs_only(self):
        # d = lp - ref = [0.5, -1.0]: k3 = exp(-d) + d - 1 = [0.1065307, 0.7182818];
        # d k3 / d lp = 1 - exp(-d) = [0.3934693, -1.7182818]; ref gets no gradient.
        lp = jnp.array([[-1.0, -2.0, 0.0]])
        ref = jnp.array([[-1.5, -1.0, jnp.nan]])

        @self.variant
        def run(lp, ref):
            def loss(lp, ref):
                batch = core.masked_inputs(core.LossInputs(mask=MASK, logprobs=lp, ref_logprobs=ref))
                terms = core.policy_regularizers(batch, kl_loss_coef=0.2)
                return core.aggregate(terms["kl_loss"], MASK), terms

            return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(lp, ref)

        (value, terms), (g_lp, g_ref) = run(lp, ref)
        k3 = np.array([np.exp(-0.5) + 0.5 - 1, np.exp(1.0) - 1.0 - 1])
        np.testing.assert_allclose(terms["kl_loss"], [[*(0.2 * k3), 0.0]], rtol=1e-6)
        np.testing.assert_allclose(value, 0.2 * k3.mean(), rtol=1e-6)
        np.testing.assert_allclose(g_lp, [[0.1 * (1 - np.exp(-0.5)), 0.1 * (1 - np.exp(1.0)), 0.0]], rtol=1e-6)
        np.testing.assert_array_equal(g_ref, np.zeros((1, 3)))

    def test_kl_loss_takes_any_estimator_and_zero_coefs_add_no_term(self):
        lp, ref = jnp.array([[-1.0, -2.0, 0.0]]), jnp.array([[-1.5, -1.0, 0.0]])
        batch = core.LossInputs(mask=MASK, logprobs=lp, ref_logprobs=ref)
        for est, want in (("kl", [0.5, -1.0]), ("abs", [0.5, 1.0]), ("mse", [0.125, 0.5])):
            terms = core.policy_regularizers(batch, kl_loss_coef=2.0, kl_loss_estimator=est)
            np.testing.assert_allclose(terms["kl_loss"], [[2 * want[0], 2 * want[1], 0.0]], rtol=1e-6)
        assert core.policy_regularizers(batch) == {}
        with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
            core.policy_regularizers(batch, kl_loss_coef=1.0, kl_loss_estimator="k4")
        with pytest.raises(ValueError, match="entropy is missing"):
            core.policy_regularizers(batch, entropy_coef=0.1)


def test_kl_penalty_shaping_scales_penalises_and_places_the_score():
    # scores [1, 2] x 2, row 1 never ended: -0.5 -> [2, 3.5]; k1 KL * 0.1 on every token.
    lp = jnp.array([[-1.0, -1.0, 0.0], [-2.0, -1.0, -1.0]])
    ref = jnp.array([[-1.5, -1.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = jnp.array([[1, 1, 0], [1, 1, 1]])
    shaping = core.get_reward_shaping("kl_penalty")
    rewards, non_score, scores = jax.jit(lambda s, e: shaping(
        s, e, lp, ref, mask, kl_coef=0.1, score_scale=2.0, missing_eos_penalty=0.5))(
        jnp.array([1.0, 2.0]), jnp.array([True, False]))
    np.testing.assert_allclose(scores, [2.0, 3.5])
    np.testing.assert_allclose(non_score, [[-0.05, 0.0, 0.0], [0.1, 0.0, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(rewards, [[-0.05, 2.0, 0.0], [0.1, 0.0, 3.5]], rtol=1e-6)
    whitened, _, _ = shaping(jnp.array([1.0, 2.0]), jnp.array([True, True]), lp, ref, mask, kl_coef=0.1,
                             whiten_rewards=True)
    raw, _, _ = shaping(jnp.array([1.0, 2.0]), jnp.array([True, True]), lp, ref, mask, kl_coef=0.1)
    np.testing.assert_allclose(whitened, core.masked_whiten(raw, mask, shift_mean=False), rtol=1e-6)


@pytest.fixture
def my_losses(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))  # the repo root
    sys.modules.pop("examples.my_losses", None)
    yield importlib.import_module("examples.my_losses")
    for name in ("plain_pg", "ppo_clip_entropy"):
        core.unregister("policy loss", name)
    sys.modules.pop("examples.my_losses", None)


def test_example_forks_give_hand_computed_per_token_losses(my_losses):
    # A = [1, -2], ratio = e^[0.1, -0.1]; entropy [0.5, 2].
    d = jnp.array([[0.1, -0.1]])
    batch = core.LossInputs(mask=jnp.ones((1, 2)), logprobs=d, old_logprobs=jnp.zeros((1, 2)),
                            advantages=jnp.array([[1.0, -2.0]]), entropy=jnp.array([[0.5, 2.0]]))
    per_token, stats = core.get_policy_loss("plain_pg")(batch, cliprange=0.2, pg_coef=0.5)
    np.testing.assert_allclose(per_token, [[-0.5 * np.exp(0.1), 1.0 * np.exp(-0.1)]], rtol=1e-6)
    np.testing.assert_allclose(stats["approxkl"], [[0.005, 0.005]], rtol=1e-5)
    # the fork's entropy-regularised clipped loss == ppo_clip + the built-in entropy term
    fork, fork_stats = core.get_policy_loss("ppo_clip_entropy")(batch, cliprange=0.2, ent_coef=0.1)
    clip, _ = core.ppo_clip_loss(batch, cliprange=0.2)
    bonus = core.policy_regularizers(batch, entropy_coef=0.1)["entropy_loss"]
    np.testing.assert_array_equal(fork, clip + bonus)
    np.testing.assert_allclose(fork, [[-np.exp(0.1) - 0.05, 2 * np.exp(-0.1) - 0.2]], rtol=1e-6)
    assert "clipfrac" in fork_stats and "entropy_bonus" in fork_stats
