"""Config names select advantage estimators and losses; a fork registers one function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax import core
from ppo_jax.core import registry


@pytest.fixture
def clean_registry():
    yield
    registry.unregister("advantage estimator", "reinforce_test")
    registry.unregister("policy loss", "vanilla_pg_test")


def test_builtins_are_registered_under_their_config_names():
    assert core.get_advantage_estimator("gae") is core.estimators.gae
    assert core.get_policy_loss("ppo_clip") is core.ppo_clip_loss
    assert core.get_value_loss("clipped_mse") is core.clipped_value_loss
    assert core.get_reward_shaping("kl_penalty") is core.kl_penalty_shaping
    names = core.registered_names()
    assert "gae" in names["advantage estimator"] and "ppo_clip" in names["policy loss"]
    assert "kl_penalty" in names["reward shaping"]


def test_unknown_name_lists_the_known_names():
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo_klp'; known: .*ppo_clip"):
        core.get_policy_loss("ppo_klp")
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gea'; known: .*gae"):
        core.get_advantage_estimator("gea")
    with pytest.raises(ValueError, match=r"unknown value loss 'mse'; known: .*clipped_mse"):
        core.get_value_loss("mse")


def test_registered_estimator_and_loss_are_found_by_name_and_jit(clean_registry):
    @core.register_advantage_estimator("reinforce_test")
    def reinforce(values, rewards, mask, *, gamma, **unused):
        del values, unused
        ret = jax.lax.cumsum(jnp.where(mask != 0, rewards, 0.0) * 1.0, axis=1, reverse=True) * gamma
        return ret, ret

    @core.register_policy_loss("vanilla_pg_test")
    def vanilla(batch, **unused):
        return -batch.advantages * batch.logprobs, {"logprobs": batch.logprobs}

    config = {"advantage": "reinforce_test", "policy_loss": "vanilla_pg_test"}

    @jax.jit
    def step(lp, rewards, mask):
        adv, _ = core.get_advantage_estimator(config["advantage"])(None, rewards, mask, gamma=1.0, lam=0.9)
        batch = core.LossInputs(mask=mask, logprobs=lp, old_logprobs=lp, advantages=adv)
        per_token, stats = core.get_policy_loss(config["policy_loss"])(batch, cliprange=0.2)
        return core.reduce_loss({"pg_loss": per_token}, stats, mask)

    loss, stats = step(jnp.array([[-1.0, -2.0]]), jnp.array([[0.0, 1.0]]), jnp.array([[1, 1]]))
    np.testing.assert_allclose(loss, -(1.0 * -1.0 + 1.0 * -2.0) / 2)
    assert set(stats) == {"pg_loss", "logprobs"}


def test_duplicate_registration_needs_override(clean_registry):
    def first(*a, **k):
        return None

    def second(*a, **k):
        return None

    core.register_policy_loss("vanilla_pg_test")(first)
    core.register_policy_loss("vanilla_pg_test")(first)  # same function again: fine
    with pytest.raises(ValueError, match=r"policy loss 'vanilla_pg_test' is already registered"):
        core.register_policy_loss("vanilla_pg_test")(second)
    core.register_policy_loss("vanilla_pg_test", override=True)(second)
    assert core.get_policy_loss("vanilla_pg_test") is second
    with pytest.raises(ValueError, match=r"non-empty string"):
        core.register_value_loss("")
