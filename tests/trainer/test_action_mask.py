"""Observation tokens inside a response (a multi-turn rollout: `core.actions`): rewards, KL,
GAE and the update's losses against float64 numpy references on hand-built action masks, every
registered policy loss blind to observations, and `action_mask=None` as today's path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppo_jax.core import (
    LossInputs, action_order, aggregate, compact_actions, expand_actions, get_policy_loss,
    get_value_loss, init_kl_controller, loss_normalizers, masked_inputs,
)
from ppo_jax.core.registry import POLICY_LOSSES, VALUE_LOSSES
from ppo_jax.models import Model, load_model, split_model
from ppo_jax.trainer.stages.ppo.experience import PPOModels, make_experience
from tests.trainer.default_settings import experience_settings, forward_settings
from ppo_jax.rollout.forward import Rollout

B, P, N = 3, 4, 8
LENGTH = np.array([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0, 0]])
# row 0: action, action, obs, obs, action, action, action; row 1: obs in the middle and an
# observation as its last token (cut by the budget); row 2: single turn
ACTIONS = np.array([[1, 1, 0, 0, 1, 1, 1, 0], [1, 0, 0, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]])
GAMMA, LAM, KL_COEF = 0.9, 0.8, 0.2


def test_compaction_moves_actions_to_the_front_in_order_and_back():
    order = action_order(jnp.asarray(ACTIONS))
    x = jnp.arange(B * N, dtype=jnp.float32).reshape(B, N)
    packed = compact_actions(x, order)
    np.testing.assert_array_equal(packed[0, :5], [0, 1, 4, 5, 6])
    np.testing.assert_array_equal(compact_actions(jnp.asarray(ACTIONS), order)[:, :5].sum(1),
                                  ACTIONS.sum(1))
    np.testing.assert_array_equal(expand_actions(packed, order), x)
    np.testing.assert_array_equal(order[2], np.arange(N))  # a prefix: the identity


def verl_gae(values, rewards, actions, gamma, lam):
    """verl's multi-turn GAE (core_algos.compute_gae_advantage_return) in float64, as a loop:
    values and TD errors on observation tokens are skipped."""
    values, rewards, actions = (np.asarray(a, np.float64) for a in (values, rewards, actions))
    adv = np.zeros_like(values)
    next_value = np.zeros(values.shape[0])
    last = np.zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        new = delta + gamma * lam * last
        m = actions[:, t]
        next_value = values[:, t] * m + (1 - m) * next_value
        last = new * m + (1 - m) * last
        adv[:, t] = last
    return adv * actions, (adv + values) * actions


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    actor, _ = load_model(tiny_checkpoint, "causal_lm")
    critic, _ = load_model(tiny_checkpoint, "value")
    (ag, ap), (cg, cp) = split_model(actor), split_model(critic)
    ap, cp = nnx.to_pure_dict(ap), nnx.to_pure_dict(cp)
    ref = jax.tree.map(lambda x: x * 1.01, ap)  # a reference that differs: KL != 0
    # a critic with a non-zero head, so values differ per token
    cp = jax.tree.map(lambda x: x + 0.05 if x.ndim == 2 and x.shape[-1] == 1 else x, cp)
    return PPOModels(Model(ag, ap), Model(ag, ref), Model(cg, cp), None)


def experience(models, action_mask, *, whiten=False):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.integers(4, 200, (B, P)), jnp.int32)
    r = jnp.asarray(rng.integers(4, 200, (B, N)), jnp.int32)
    settings = experience_settings(forward=forward_settings(micro_batch_size=B), gamma=GAMMA,
                                  lam=LAM, whiten_advantages=whiten)
    kl = init_kl_controller("fixed", KL_COEF, 6.0, 10000)
    scores = jnp.asarray([1.0, -0.5, 0.25])
    return jax.jit(lambda m, a: make_experience(
        m, Rollout(q, jnp.ones((B, P), jnp.int32), r, jnp.asarray(LENGTH)), kl, scores,
        jnp.ones(B, bool), settings=settings, action_mask=a))(models, action_mask)


def test_rewards_kl_and_gae_over_interior_observations_equal_float64_references(models):
    exp, _, stats = experience(models, jnp.asarray(ACTIONS))
    lp, ref, values = (np.asarray(x, np.float64) for x in (exp.logprobs, exp.ref_logprobs,
                                                           exp.values))
    # KL penalty on action tokens only; the score at each row's last action token
    want_rewards = -KL_COEF * (lp - ref) * ACTIONS
    last = np.array([np.flatnonzero(row)[-1] for row in ACTIONS])
    want_rewards[np.arange(B), last] += [1.0, -0.5, 0.25]
    np.testing.assert_allclose(exp.rewards, want_rewards, rtol=1e-5, atol=1e-6)
    want_adv, want_ret = verl_gae(values, want_rewards, ACTIONS, GAMMA, LAM)
    np.testing.assert_allclose(exp.advantages, want_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(exp.returns, want_ret, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(exp.action_mask, ACTIONS)
    np.testing.assert_array_equal(exp.response_mask, LENGTH)
    np.testing.assert_allclose(stats["kl"], np.mean(((lp - ref) * ACTIONS).sum(1)), rtol=1e-5)
    assert float(stats["action_length"]) == pytest.approx(ACTIONS.sum(1).mean())
    assert float(stats["response_length"]) == pytest.approx(LENGTH.sum(1).mean())


def test_whitened_advantages_are_whitened_over_actions_only(models):
    exp, _, _ = experience(models, jnp.asarray(ACTIONS), whiten=True)
    adv = np.asarray(exp.advantages, np.float64)
    on = ACTIONS > 0
    assert np.all(adv[~on] == 0)
    assert abs(adv[on].mean()) < 1e-5
    raw, _ = verl_gae(exp.values, exp.rewards, ACTIONS, GAMMA, LAM)
    z = (raw[on] - raw[on].mean()) / np.sqrt(raw[on].var(ddof=1) + 1e-8)
    np.testing.assert_allclose(adv[on], z, rtol=1e-4, atol=1e-4)


def test_no_action_mask_is_todays_path_and_a_prefix_action_mask_changes_nothing(models):
    plain, _, s0 = experience(models, None)
    same, _, s1 = experience(models, jnp.asarray(LENGTH))
    for name in ("rewards", "advantages", "returns", "logprobs", "values"):
        np.testing.assert_array_equal(getattr(plain, name), getattr(same, name), err_msg=name)
    np.testing.assert_array_equal(plain.action_mask, plain.response_mask)
    assert "action_length" not in s0 and s0["kl"] == s1["kl"]


def _loss_batch(seed, mask):
    rng = np.random.default_rng(seed)
    f = lambda: jnp.asarray(rng.normal(size=(2, N)) * 0.3, jnp.float32)  # noqa: E731
    return LossInputs(mask=jnp.asarray(mask), logprobs=f() - 1.0, old_logprobs=f() - 1.0,
                      ref_logprobs=f() - 1.0, advantages=f(), values=f(), old_values=f(),
                      returns=f(), entropy=jnp.abs(f()), group_ids=jnp.arange(2),
                      rollout_logprobs=f() - 1.0)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_every_policy_loss_ignores_observation_tokens(name, aggregation):
    """A batch with observation tokens between its actions has exactly the loss of the same
    batch with the observations taken out (actions compacted to a prefix): the observations'
    values, whatever they hold, reach no loss and no normaliser."""
    actions = jnp.asarray(ACTIONS[:2])
    batch = masked_inputs(_loss_batch(1, actions))
    order = action_order(actions)
    packed = masked_inputs(jax.tree.map(
        lambda x: compact_actions(x, order) if x.ndim == 2 else x, batch))

    def loss(b):
        per_token, _ = get_policy_loss(name)(b, cliprange=0.2)
        return aggregate(per_token, b.mask, aggregation, loss_normalizers(b.mask))

    np.testing.assert_allclose(loss(batch), loss(packed), rtol=1e-6, atol=1e-7)
    noisy = batch._replace(advantages=jnp.where(actions > 0, batch.advantages, 1e4))
    np.testing.assert_allclose(loss(masked_inputs(noisy)), loss(batch), rtol=1e-6, atol=1e-7)


def test_clipped_policy_loss_with_interior_observations_equals_a_float64_reference():
    actions = ACTIONS[:2]
    b = masked_inputs(_loss_batch(2, jnp.asarray(actions)))
    per_token, _ = get_policy_loss("ppo_clip")(b, cliprange=0.2)
    got = aggregate(per_token, b.mask, "token-mean", loss_normalizers(b.mask))
    lp, old, adv = (np.asarray(x, np.float64) for x in (b.logprobs, b.old_logprobs, b.advantages))
    ratio = np.exp(lp - old)
    loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2))
    want = (loss * actions).sum() / actions.sum()
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("name", VALUE_LOSSES.names())
def test_every_value_loss_ignores_observation_tokens(name):
    """The critic's values are read at action tokens only: observations change no value loss."""
    actions = jnp.asarray(ACTIONS[:2])
    batch = masked_inputs(_loss_batch(3, actions))
    order = action_order(actions)
    packed = masked_inputs(jax.tree.map(
        lambda x: compact_actions(x, order) if x.ndim == 2 else x, batch))

    def loss(b):
        per_token, _ = get_value_loss(name)(b, cliprange_value=0.2)
        return aggregate(per_token, b.mask, "token-mean", loss_normalizers(b.mask))

    np.testing.assert_allclose(loss(batch), loss(packed), rtol=1e-6, atol=1e-7)
