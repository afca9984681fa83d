"""`ppo.packing`: the experience pass and the update over packed rows equal the padded ones,
on a tiny random Llama in float32: every advantage estimator's experience, and every policy
loss under every aggregation mode (their stats and the trained params), with a critic, with
the shared critic, and with a multi-turn action mask. The plans are the trainer's
(`stages.ppo.packing.Packer`): the update's follows its epochs' permutations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ppo_jax.core import get_policy_loss, init_kl_controller
from ppo_jax.core.registry import registered_names
from ppo_jax.core.aggregation import LOSS_AGGREGATIONS
from ppo_jax.models import Model, load_model, split_model
from ppo_jax.parallel.mesh import make_mesh
from ppo_jax.rollout.forward import Rollout
from ppo_jax.trainer.placement import Placement
from ppo_jax.trainer.stages.ppo.experience import PPOModels, make_experience
from ppo_jax.trainer.stages.ppo.packing import Packer
from ppo_jax.trainer.stages.ppo.update import ppo_update
from ppo_jax.trainer.state import TrainState
from tests.trainer.default_settings import experience_settings, forward_settings, update_settings

B, P, N, MICRO = 8, 6, 12, 4
R_LENS = np.array([12, 2, 5, 1, 9, 3, 12, 4])  # heavy-tailed: mean / max 0.5


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    (ag, ap), (cg, cp) = (split_model(load_model(tiny_checkpoint, k)[0]) for k in ("causal_lm", "value"))
    shared = split_model(load_model(tiny_checkpoint, "causal_lm_value")[0])
    return (ag, nnx.to_pure_dict(ap), cg, nnx.to_pure_dict(cp),
            shared[0], nnx.to_pure_dict(shared[1]))


@pytest.fixture(scope="module")
def packer():
    place = Placement(make_mesh(data=1, devices=jax.devices()[:1]))
    return Packer(place, micro_batch_size=MICRO, mini_batch_size=4, ppo_epochs=2)


def rollout(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.integers(4, 200, (B, P)).astype(np.int32)
    qm = (np.arange(P)[None] >= np.array([0, 2, 1, 0, 4, 0, 3, 1])[:, None]).astype(np.int32)
    r = rng.integers(4, 200, (B, N)).astype(np.int32)
    rm = (np.arange(N)[None] < R_LENS[:, None]).astype(np.int32)
    return Rollout(*(jnp.asarray(x) for x in (q * qm, qm, r * rm, rm)))


def action_mask():
    """A multi-turn mask: tokens 3-5 of each response are an observation."""
    m = np.ones((B, N), np.int32)
    m[:, 3:6] = 0
    return jnp.asarray(m)


def experience(models, packer, *, packed, estimator="gae", shared=False, actions=None):
    ag, ap, cg, cp, sg, sp = models
    s = experience_settings(forward=forward_settings(micro_batch_size=MICRO),
                            advantage_estimator=estimator, samples_per_prompt=2,
                            shared_critic=shared)
    r = rollout()
    plan = packer.experience(r, packer.lengths(r))[0] if packed else None
    kl = init_kl_controller("fixed", 0.1, 6.0, 10000)
    scores = jnp.linspace(-1.0, 1.0, B)
    group_ids = jnp.arange(B) // 2
    baseline = jnp.full((B,), 0.1) if estimator == "remax" else None

    def run(ap, cp):
        actor = Model(sg, ap) if shared else Model(ag, ap)
        critic = None if shared or estimator != "gae" else Model(cg, cp)
        return make_experience(PPOModels(actor, Model(sg if shared else ag, ap), critic, None),
                               r, kl, scores, jnp.ones(B, bool), settings=s,
                               group_ids=group_ids, baseline_scores=baseline,
                               action_mask=actions, packing=plan)
    return jax.jit(run)(sp if shared else ap, cp)


def assert_experience_equal(a, b, mask):
    real = np.asarray(mask) == 1
    for f in ("logprobs", "ref_logprobs", "values", "rewards", "advantages", "returns"):
        x, y = np.asarray(getattr(a[0], f)), np.asarray(getattr(b[0], f))
        np.testing.assert_allclose(x[real], y[real], rtol=1e-5, atol=1e-6, err_msg=f)
    for k in a[2]:
        np.testing.assert_allclose(a[2][k], b[2][k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("estimator", [  # GAE with a critic in the default run (budget)
    "gae", *(pytest.param(e, marks=pytest.mark.slow) for e in
             ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"))])
def test_the_packed_experience_equals_the_padded_one(models, packer, estimator):
    padded = experience(models, packer, packed=False, estimator=estimator)
    packed = experience(models, packer, packed=True, estimator=estimator)
    assert_experience_equal(packed, padded, rollout().response_mask)


def update(models, packer, exp, *, packed, shared=False, **fields):
    ag, ap, cg, cp, sg, sp = models
    s = update_settings(mini_batch_size=4, micro_batch_size=MICRO, ppo_epochs=2,
                        shared_critic=shared, **fields)
    tx = optax.sgd(0.05)  # params move linearly in the gradients (Adam would magnify rounding)
    a = TrainState.create(sp if shared else ap, tx)
    c = None if shared else TrainState.create(cp, tx)
    key = jax.random.PRNGKey(3)
    r = Rollout(exp.query_ids, exp.query_mask, exp.response_ids, exp.response_mask)
    plan = packer.update(r, packer.lengths(r), key)[0] if packed else None
    return jax.jit(lambda a, c, e, k, p: ppo_update(
        a, c, None, e, k, p, actor_graphdef=sg if shared else ag,
        critic_graphdef=None if shared else cg, actor_tx=tx, critic_tx=None if shared else tx,
        settings=s))(a, c, exp, key, plan)


def assert_updates_equal(a, b):
    # atol 1e-6: a stat like policykl is a small mean of differences of log-probs near -5,
    # summed in another order over the micro-batches
    for k in b[2]:
        np.testing.assert_allclose(a[2][k], b[2][k], rtol=1e-5, atol=1e-6, err_msg=k)
    for x, y in zip(jax.tree.leaves(a[:2]), jax.tree.leaves(b[:2])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


LOSSES = ("ppo_clip", "gspo", "gspo_token", "gmpo", "cispo", "sapo", "clip_cov", "kl_cov")
CASES = [(loss, mode) for loss in LOSSES for mode in LOSS_AGGREGATIONS]
# the covariance losses select tokens over the whole call: a ratio this batch reaches
COVARIANCE_KWARGS = {"clip_cov": (("clip_cov_ratio", 0.2), ("clip_cov_lb", -1.0)),
                     "kl_cov": (("kl_cov_ratio", 0.2),)}


def test_every_registered_policy_loss_is_in_the_grid():
    builtin = {n for n in registered_names()["policy loss"]
               if get_policy_loss(n).__module__.startswith("ppo_jax.core")}
    assert set(LOSSES) == builtin


@pytest.mark.parametrize("loss, mode", [
    CASES[0], *(pytest.param(*c, marks=pytest.mark.slow) for c in CASES[1:])])
def test_the_packed_update_equals_the_padded_one(models, packer, loss, mode):
    """Every registered loss. Clip-Cov and KL-Cov centre over each call's tokens
    (`per_micro_batch`), so their packed micro-batches keep the padded ones' rows."""
    exp = experience(models, packer, packed=False)[0]
    fields = dict(policy_loss=loss, loss_aggregation=mode, entropy_coef=0.01, kl_loss_coef=0.05,
                  policy_loss_kwargs=COVARIANCE_KWARGS.get(loss, ()))
    keep = getattr(get_policy_loss(loss), "per_micro_batch", False)
    plans = packer if not keep else Packer(packer.place, micro_batch_size=MICRO,
                                           mini_batch_size=4, ppo_epochs=2, keep_micro_batches=True)
    assert_updates_equal(update(models, plans, exp, packed=True, **fields),
                         update(models, packer, exp, packed=False, **fields))


@pytest.mark.slow  # two experience passes and two updates of the shared model
def test_packing_with_the_shared_critic_and_a_multi_turn_action_mask(models, packer):
    exps = [experience(models, packer, packed=p, shared=True, actions=action_mask())
            for p in (False, True)]
    assert_experience_equal(exps[1], exps[0], rollout().response_mask * action_mask())
    padded = update(models, packer, exps[0][0], packed=False, shared=True)
    assert_updates_equal(update(models, packer, exps[0][0], packed=True, shared=True), padded)
    assert_updates_equal(update(models, budget_packer(18), exps[0][0], packed=True, shared=True),
                         padded)


def test_the_update_plan_keeps_each_minibatch_of_the_epochs_permutations(packer):
    """Each minibatch holds the rows its permutation slice names (rearranged among its
    micro-batches), and each micro-batch packs exactly its rows' tokens."""
    r = rollout()
    key = jax.random.PRNGKey(3)
    batch, figures = packer.update(r, packer.lengths(r), key)
    perms = np.asarray(jax.jit(lambda k: jax.vmap(lambda kk: jax.random.permutation(kk, B))(
        jax.random.split(k, 2)))(key))
    order = np.asarray(batch.order)
    q_lens, r_lens = (np.asarray(x) for x in packer.lengths(r))
    seq = q_lens + r_lens
    for e in range(2):
        for mb in range(2):
            rows = order[e, 4 * mb:4 * mb + 4]
            assert sorted(rows) == sorted(perms[e, 4 * mb:4 * mb + 4])
            seg = np.asarray(batch.rows.segments[e, mb, 0, 0])
            assert (seg > 0).sum() == seq[rows].sum()
    rows, width = batch.rows.src.shape[-2:]
    assert figures["packing/update_padded_fill"] == pytest.approx(seq.sum() / (B * (P + N)))
    assert figures["packing/update_fill"] == pytest.approx(seq.sum() / (B // MICRO * rows * width))


def budget_packer(tokens):
    place = Placement(make_mesh(data=1, devices=jax.devices()[:1]))
    return Packer(place, micro_batch_size=MICRO, mini_batch_size=4, ppo_epochs=2,
                  micro_batch_tokens=tokens)


# P + N = 18 slots a row: 18 tokens is one packed row a micro-batch, 36 two
@pytest.mark.parametrize("tokens, loss, mode", [  # all slow: the default run's budget (~28 s)
    pytest.param(18, "ppo_clip", "seq-mean-token-mean", marks=pytest.mark.slow),
    # Clip-Cov and KL-Cov centre over each micro-batch, which a budget regroups (docs/packing.md)
    *(pytest.param(18, *c, marks=pytest.mark.slow) for c in CASES
      if c[0] not in COVARIANCE_KWARGS and c != ("ppo_clip", "seq-mean-token-mean")),
    pytest.param(36, "ppo_clip", "token-mean", marks=pytest.mark.slow)])
def test_micro_batches_by_tokens_give_the_padded_update(models, packer, tokens, loss, mode):
    """`ppo.micro_batch_tokens`: micro-batches of as many sequences as fit the budget (a
    varying count, absent places masked out) sum to the padded update's losses, gradients and
    stats under every aggregation mode."""
    exp = experience(models, packer, packed=False)[0]
    fields = dict(policy_loss=loss, loss_aggregation=mode, entropy_coef=0.01, kl_loss_coef=0.05)
    budget = budget_packer(tokens)
    r = Rollout(exp.query_ids, exp.query_mask, exp.response_ids, exp.response_mask)
    figures = budget.update(r, budget.lengths(r), jax.random.PRNGKey(3))[1]
    if tokens == 18:  # one row a micro-batch: a minibatch of 4 takes several micro-batches
        assert figures["packing/update_micro_batches"] >= 2
    assert_updates_equal(update(models, budget, exp, packed=True, **fields),
                         update(models, packer, exp, packed=False, **fields))
