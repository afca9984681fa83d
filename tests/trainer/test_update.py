"""The PPO update phase: token means across micro-batches, the first-minibatch invariant,
gradient accumulation, and the experience alignment on a tiny random Llama."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ppo_jax.core import init_kl_controller, register_policy_loss
from ppo_jax.core.registry import unregister
from ppo_jax.models import load_model, split_model
from ppo_jax.models import Model
from ppo_jax.trainer.stages.ppo.experience import PPOModels, make_experience
from tests.trainer.default_settings import experience_settings, forward_settings
from ppo_jax.rollout.forward import Rollout
from ppo_jax.trainer.optim import make_optimizer
from ppo_jax.trainer.state import TrainState
from ppo_jax.trainer.stages.ppo.update import ppo_update
from tests.trainer.default_settings import update_settings

B, P, N = 4, 6, 5

def models_of(ag, ap, ref, cg=None, cp=None, rg=None, rp=None):
    """The experience's models: actor and reference of graph `ag`, optional critic / reward."""
    return PPOModels(Model(ag, ap), Model(ag, ref), None if cg is None else Model(cg, cp),
                     None if rg is None else Model(rg, rp))



@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    actor, _ = load_model(tiny_checkpoint, "causal_lm")
    critic, _ = load_model(tiny_checkpoint, "value")
    (ag, ap), (cg, cp) = split_model(actor), split_model(critic)
    return ag, nnx.to_pure_dict(ap), cg, nnx.to_pure_dict(cp)


@pytest.fixture(scope="module")
def shared_model(tiny_checkpoint):
    """The tiny actor as a `CausalLMWithValueHead` (zero value head): `(graphdef, params)`."""
    model, _ = load_model(tiny_checkpoint, "causal_lm_value")
    graphdef, params = split_model(model)
    return graphdef, nnx.to_pure_dict(params)


def rollout(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.integers(4, 200, (B, P)).astype(np.int32)
    qm = np.ones((B, P), np.int32)
    qm[1, :2] = 0  # left padding
    r = rng.integers(4, 200, (B, N)).astype(np.int32)
    lengths = np.array([5, 3, 1, 4])
    rm = (np.arange(N)[None] < lengths[:, None]).astype(np.int32)
    return tuple(jnp.asarray(x) for x in (q, qm, r, rm))


def experience(models, settings=experience_settings(forward=forward_settings(micro_batch_size=2)),
               scores=None):
    ag, ap, cg, cp = models
    q, qm, r, rm = rollout()
    scores = jnp.asarray([1.0, -0.5, 0.25, 0.0]) if scores is None else scores
    kl = init_kl_controller("adaptive", 0.2, 6.0, 10000)
    return jax.jit(lambda ap, cp: make_experience(
        models_of(ag, ap, ap, cg, cp, None, None),
        Rollout(q, qm, r, rm), kl, scores, jnp.ones(B, bool),
        settings=settings))(ap, cp)


def run_update(models, exp, settings, tx=None):
    ag, ap, cg, cp = models
    tx = tx or make_optimizer(1e-3)
    a, c = TrainState.create(ap, tx), TrainState.create(cp, tx)
    return jax.jit(lambda a, c, e, k: ppo_update(a, c, None, e, k, actor_graphdef=ag, critic_graphdef=cg,
                                                 actor_tx=tx, critic_tx=tx, settings=settings))(
        a, c, exp, jax.random.PRNGKey(0))


def test_first_minibatch_of_first_epoch_has_ratio_one_and_zero_approxkl(models):
    exp, _, _ = experience(models)
    _, _, stats = run_update(models, exp, update_settings(ppo_epochs=2, mini_batch_size=2,
                                                         micro_batch_size=2))
    # The rollout and update programs are different XLA computations (the update also
    # differentiates), and XLA CPU's fusion may reassociate float32 sums: log-probs agree to a
    # few ulp, so ratio is 1 to 1e-6 and approxkl is 0 to 1e-12. Any real mismatch (dropout,
    # temperature, shifted positions) shows up as approxkl >= 1e-4.
    assert abs(float(stats["ratio"][0, 0]) - 1.0) < 1e-6
    assert float(stats["approxkl"][0, 0]) < 1e-12
    assert float(stats["clipfrac"][0, 0]) == 0.0
    assert stats["ratio"].shape == (2, 2)
    # later minibatches see updated params: the policy has moved
    assert float(stats["approxkl"][1, 1]) > 1e-10


def test_token_means_across_micro_batches_are_sums_over_total_tokens(models):
    # micro-batch 1: one token with loss 1; micro-batch 2: three tokens with loss 0 -> 0.25
    @register_policy_loss("per_token_advantage")
    def per_token_advantage(batch, **kw):
        return batch.advantages + 0.0 * batch.logprobs, {}

    try:
        exp, _, _ = experience(models)
        mask = jnp.asarray([[1, 0, 0, 0, 0], [1, 1, 1, 0, 0]], jnp.int32)
        adv = jnp.asarray([[1.0, 9, 9, 9, 9], [0.0, 0, 0, 9, 9]])
        two = jax.tree.map(lambda x: x[:2], exp).replace(response_mask=mask, action_mask=mask,
                                                          advantages=adv)
        settings = update_settings(ppo_epochs=1, mini_batch_size=2, micro_batch_size=1,
                                  policy_loss="per_token_advantage")
        ag, ap, cg, cp = models
        tx = make_optimizer(1e-3)
        _, _, stats = ppo_update(TrainState.create(ap, tx), TrainState.create(cp, tx), None, two,
                                 jax.random.PRNGKey(0), actor_graphdef=ag, critic_graphdef=cg,
                                 actor_tx=tx, critic_tx=tx, settings=settings)
        assert float(stats["pg_loss"][0, 0]) == pytest.approx(0.25, abs=1e-7)
    finally:
        unregister("policy loss", "per_token_advantage")


def test_gradient_accumulation_matches_one_big_micro_batch(models):
    exp, _, _ = experience(models)
    one = update_settings(ppo_epochs=1, mini_batch_size=4, micro_batch_size=4)
    four = update_settings(ppo_epochs=1, mini_batch_size=4, micro_batch_size=1)
    sgd = optax.sgd(1.0)  # params move by exactly the (accumulated) gradient
    a1, c1, s1 = run_update(models, exp, one, sgd)
    a4, c4, s4 = run_update(models, exp, four, sgd)
    for key in ("pg_loss", "vf_loss", "policy_entropy", "actor_grad_norm", "critic_grad_norm"):
        np.testing.assert_allclose(s1[key], s4[key], rtol=2e-5, atol=1e-7)
    for s1_params, s4_params in ((a1.params, a4.params), (c1.params, c4.params)):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6),
                     s1_params, s4_params)


def test_experience_reads_outputs_before_each_response_token(models):
    """Old log-probs equal log_softmax of the full forward's logits at position P - 1 + t."""
    ag, ap, cg, cp = models
    exp, kl_state, stats = experience(models)
    q, qm, r, rm = rollout()
    ids, mask = jnp.concatenate([q, r], 1), jnp.concatenate([qm, rm], 1)
    logits = np.asarray(nnx.merge(ag, ap)(ids, mask)[0], np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want = np.take_along_axis(logp[:, P - 1:P - 1 + N], np.asarray(r)[..., None], -1)[..., 0]
    valid = np.asarray(rm) > 0
    np.testing.assert_allclose(np.asarray(exp.logprobs)[valid], want[valid], atol=2e-5)
    # reference == actor here, so the KL and the non-score reward are exactly zero
    assert float(stats["kl"]) == 0.0 and float(stats["non_score_reward"]) == 0.0
    # score lands on the last real token; the adaptive controller moved by TRL's formula
    last = valid.sum(1) - 1
    np.testing.assert_allclose(np.asarray(exp.rewards)[np.arange(B), last], [1.0, -0.5, 0.25, 0.0])
    assert float(kl_state.value) == pytest.approx(0.2 * (1 - 0.2 * B / 10000), rel=1e-6)
    assert np.all(np.asarray(exp.advantages)[~valid] == 0.0)


def test_missing_eos_penalty_and_score_scale(models):
    ag, ap, cg, cp = models
    q, qm, r, rm = rollout()
    kl = init_kl_controller("fixed", 0.0)
    settings = experience_settings(forward=forward_settings(micro_batch_size=4), score_scale=2.0,
                                  missing_eos_penalty=1.0)
    ended = jnp.asarray([True, False, True, False])
    exp, _, stats = make_experience(
        models_of(ag, ap, ap, cg, cp, None, None),
        Rollout(q, qm, r, rm), kl, jnp.ones(B), ended,
        settings=settings)
    np.testing.assert_allclose(np.asarray(exp.scores), [2.0, 1.0, 2.0, 1.0])
    assert float(stats["score_mean"]) == 1.0  # raw scores are logged


@pytest.mark.slow  # default-run budget (15 min on 2 cores)
def test_shared_critic_with_zero_vf_coef_moves_the_policy_like_the_separate_actor(
        models, shared_model):
    ag, ap, cg, cp = models
    sg, shared = shared_model
    q, qm, r, rm = rollout()
    kl = init_kl_controller("fixed", 0.1)
    scores, ended = jnp.asarray([1.0, -0.5, 0.25, 0.0]), jnp.ones(B, bool)
    exp_s, _, stats_s = make_experience(
        PPOModels(Model(sg, shared), Model(ag, ap)),
        Rollout(q, qm, r, rm), kl, scores, ended,
        settings=experience_settings(forward=forward_settings(micro_batch_size=4), shared_critic=True))
    exp, _, _ = make_experience(
        models_of(ag, ap, ap, cg, cp, None, None),
        Rollout(q, qm, r, rm), kl, scores, ended,
        settings=experience_settings(forward=forward_settings(micro_batch_size=4)))
    # zero value heads on both sides: same values (0), same advantages
    np.testing.assert_allclose(exp_s.advantages, exp.advantages, atol=1e-6)
    assert float(stats_s["values_mean"]) == 0.0
    tx = optax.sgd(0.1)
    settings = update_settings(ppo_epochs=1, mini_batch_size=4, micro_batch_size=2)
    a_sep, _, _ = ppo_update(TrainState.create(ap, tx), TrainState.create(cp, tx), None, exp,
                             jax.random.PRNGKey(0), actor_graphdef=ag, critic_graphdef=cg,
                             actor_tx=tx, critic_tx=tx, settings=settings)
    joint = update_settings(ppo_epochs=1, mini_batch_size=4, micro_batch_size=2, shared_critic=True,
                           vf_coef=0.0)
    a_sh, none, stats = ppo_update(TrainState.create(shared, tx), None, None, exp_s, jax.random.PRNGKey(0),
                                   actor_graphdef=sg, critic_graphdef=None, actor_tx=tx,
                                   critic_tx=None, settings=joint)
    assert none is None and "vf_loss" in stats and "pg_loss" in stats
    policy = {k: v for k, v in a_sh.params.items() if k != "value_head"}
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), policy, a_sep.params)
    # with vf_coef > 0 the value head learns
    joint = update_settings(ppo_epochs=1, mini_batch_size=4, micro_batch_size=2, shared_critic=True, vf_coef=1.0)
    a_sh, _, _ = ppo_update(TrainState.create(shared, tx), None, None, exp_s, jax.random.PRNGKey(0),
                            actor_graphdef=sg, critic_graphdef=None, actor_tx=tx, critic_tx=None,
                            settings=joint)
    assert float(jnp.abs(a_sh.params["value_head"]["kernel"]).sum()) > 0.0


def _with_ref_noise(exp, seed=1):
    """The experience with a reference that differs from the actor (non-zero KL loss)."""
    noise = np.random.default_rng(seed).normal(0, 0.3, exp.ref_logprobs.shape).astype(np.float32)
    return exp.replace(ref_logprobs=exp.ref_logprobs + jnp.asarray(noise))


@pytest.mark.slow  # default-run budget (15 min on 2 cores)
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_gradient_accumulation_is_exact_in_every_aggregation_mode_with_both_loss_terms(models, mode):
    exp = _with_ref_noise(experience(models)[0])
    kw = dict(ppo_epochs=1, mini_batch_size=4, loss_aggregation=mode, entropy_coef=0.01, kl_loss_coef=0.1)
    sgd = optax.sgd(1.0)
    a1, c1, s1 = run_update(models, exp, update_settings(micro_batch_size=4, **kw), sgd)
    a4, c4, s4 = run_update(models, exp, update_settings(micro_batch_size=1, **kw), sgd)
    for key in ("pg_loss", "entropy_loss", "kl_loss", "vf_loss", "clipfrac", "actor_grad_norm",
                "critic_grad_norm"):
        np.testing.assert_allclose(s1[key], s4[key], rtol=2e-5, atol=1e-7, err_msg=key)
    assert float(s1["kl_loss"][0, 0]) > 0.0 and float(s1["entropy_loss"][0, 0]) < 0.0
    for s1_params, s4_params in ((a1.params, a4.params), (c1.params, c4.params)):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6),
                     s1_params, s4_params)


def test_entropy_and_kl_loss_terms_have_their_exact_values(models):
    """First (and only) minibatch = the whole batch, where new log-probs equal the rollout's:
    entropy_loss = -c_ent * token-mean entropy, kl_loss = c_kl * token-mean k3(old, ref)."""
    exp = _with_ref_noise(experience(models)[0])
    settings = update_settings(ppo_epochs=1, mini_batch_size=B, micro_batch_size=2,
                              entropy_coef=0.05, kl_loss_coef=0.2)
    _, _, stats = run_update(models, exp, settings)
    np.testing.assert_allclose(stats["entropy_loss"][0, 0], -0.05 * stats["policy_entropy"][0, 0], rtol=1e-6)
    d = np.asarray(exp.logprobs, np.float64) - np.asarray(exp.ref_logprobs, np.float64)
    valid = np.asarray(exp.response_mask) > 0
    k3 = (np.exp(-d) + d - 1)[valid].mean()
    np.testing.assert_allclose(stats["kl_loss"][0, 0], 0.2 * k3, rtol=1e-5)
    _, _, off = run_update(models, exp, update_settings(ppo_epochs=1, mini_batch_size=B, micro_batch_size=2))
    assert float(off["entropy_loss"][0, 0]) == 0.0 and float(off["kl_loss"][0, 0]) == 0.0


def test_a_loss_sees_each_rows_group_id_through_shuffling_and_micro_batches(models):
    @register_policy_loss("group_id_loss")
    def group_id_loss(batch, **kw):
        return batch.group_ids[:, None].astype(jnp.float32) + 0.0 * batch.logprobs, {}

    try:
        exp, _, _ = experience(models)
        settings = update_settings(ppo_epochs=1, mini_batch_size=B, micro_batch_size=1,
                                  policy_loss="group_id_loss")
        _, _, stats = run_update(models, exp, settings)
        # rows 0..3 have 5, 3, 1, 4 tokens: token mean of the row index = 17 / 13
        assert float(stats["pg_loss"][0, 0]) == pytest.approx(17 / 13, rel=1e-6)
    finally:
        unregister("policy loss", "group_id_loss")


def test_a_registered_reward_shaping_replaces_the_kl_penalty(models):
    from ppo_jax.core import register_reward_shaping

    @register_reward_shaping("score_only_test")
    def score_only(scores, ended, logprobs, ref_logprobs, mask, *, bonus=0.0, **unused):
        last = jnp.arange(mask.shape[1]) == jnp.sum(mask, axis=1, keepdims=True) - 1
        rewards = jnp.where(last, scores[:, None] + bonus, 0.0)
        return rewards, jnp.zeros_like(rewards), scores + bonus

    try:
        ag, ap, cg, cp = models
        q, qm, r, rm = rollout()
        kl = init_kl_controller("fixed", 5.0)  # ignored by this shaping
        settings = experience_settings(forward=forward_settings(micro_batch_size=4),
                                      reward_shaping="score_only_test",
                                      reward_shaping_kwargs=(("bonus", 1.0),))
        ref = jax.tree.map(lambda x: x * 1.01, ap)
        exp, _, stats = make_experience(
            models_of(ag, ap, ref, cg, cp, None, None),
            Rollout(q, qm, r, rm), kl, jnp.ones(B), jnp.ones(B, bool),
            settings=settings)
        np.testing.assert_allclose(np.asarray(exp.rewards).sum(1), 2.0)
        np.testing.assert_allclose(np.asarray(exp.scores), 2.0)
        assert float(stats["non_score_reward"]) == 0.0 and float(stats["kl"]) != 0.0
    finally:
        unregister("reward shaping", "score_only_test")


def _assert_trees_close(x, y, rtol=1e-5, atol=1e-6):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=rtol, atol=atol), x, y)


CHUNK = 64  # the tiny vocabulary is not a multiple: a ragged last block


@pytest.mark.slow  # default-run budget (15 min on 2 cores)
def test_chunked_logprobs_give_the_same_experience_and_update(models):
    """model.logprob_chunk_size: rollout / reference log-probs and entropies, then a PPO update
    with an entropy bonus, equal the full-logits path's to float32 rounding."""
    exp, _, stats = experience(models)
    exp_c, _, stats_c = experience(models, experience_settings(
        forward=forward_settings(micro_batch_size=2, logprob_chunk_size=CHUNK)))
    _assert_trees_close(exp_c, exp)
    _assert_trees_close(stats_c, stats)
    kw = dict(ppo_epochs=2, mini_batch_size=2, micro_batch_size=1, entropy_coef=0.05)
    sgd = optax.sgd(0.05)
    a0, c0, s0 = run_update(models, exp, update_settings(**kw), sgd)
    a1, c1, s1 = run_update(models, exp, update_settings(logprob_chunk_size=CHUNK, **kw), sgd)
    _assert_trees_close(s1, s0)
    _assert_trees_close(a1.params, a0.params)
    _assert_trees_close(c1.params, c0.params)
    assert float(jnp.abs(s0["entropy_loss"]).min()) > 0.0


@pytest.mark.slow  # default-run budget (15 min on 2 cores)
def test_chunked_logprobs_in_the_shared_critic_update(models, shared_model):
    ag, ap, _, _ = models
    sg, shared = shared_model
    q, qm, r, rm = rollout()
    kl = init_kl_controller("fixed", 0.1)
    sgd = optax.sgd(0.05)
    out = []
    for chunk in (0, CHUNK):
        exp, _, _ = make_experience(
            PPOModels(Model(sg, shared), Model(ag, ap)),
            Rollout(q, qm, r, rm), kl, jnp.asarray([1.0, -0.5, 0.25, 0.0]), jnp.ones(B, bool),
            settings=experience_settings(shared_critic=True, forward=forward_settings(
                micro_batch_size=2, logprob_chunk_size=chunk)))
        settings = update_settings(ppo_epochs=2, mini_batch_size=2, micro_batch_size=2,
                                  shared_critic=True, vf_coef=0.5, entropy_coef=0.05,
                                  logprob_chunk_size=chunk)
        state, _, stats = jax.jit(lambda a, e: ppo_update(
            a, None, None, e, jax.random.PRNGKey(0), actor_graphdef=sg, critic_graphdef=None,
            actor_tx=sgd, critic_tx=None, settings=settings))(TrainState.create(shared, sgd), exp)
        out.append((exp, stats, state.params))
    for got, want in zip(out[1], out[0]):
        _assert_trees_close(got, want)


def _padded_rollout(wide_p: int, wide_n: int):
    """Left-padded prompts of 6, 4, 5, 2 tokens in `wide_p` columns; responses of 4, 2, 0
    (empty) and 3 tokens in `wide_n` columns (pad id 0 after each)."""
    rng = np.random.default_rng(5)
    q, r = (rng.integers(4, 200, (B, w)).astype(np.int32) for w in (wide_p, wide_n))
    qm = (np.arange(wide_p)[None] >= wide_p - np.array([6, 4, 5, 2])[:, None]).astype(np.int32)
    rm = (np.arange(wide_n)[None] < np.array([4, 2, 0, 3])[:, None]).astype(np.int32)
    return np.where(qm > 0, q, 0), qm, np.where(rm > 0, r, 0), rm


@pytest.mark.slow  # default-run budget (15 min on 2 cores)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_all_pad_columns_change_no_experience_or_update_value(models, mode):
    """`trainer.stages.ppo.step_data` drops columns that are padding in every row (leading prompt columns,
    trailing response columns). Experience (log-probs, values, missing-EOS penalty, whitened
    rewards, GAE, whitened advantages, KL and the logged stats) and the update (losses, stats,
    params) agree with the full width, an empty response row included; seq-mean-token-sum
    keeps its constant T through `UpdateSettings.max_response_length`."""
    ag, ap, cg, cp = models
    wide_p, wide_n, p_used, n_used = 9, 8, 6, 4
    full = tuple(jnp.asarray(x) for x in _padded_rollout(wide_p, wide_n))
    q, qm, r, rm = full
    cut = (q[:, -p_used:], qm[:, -p_used:], r[:, :n_used], rm[:, :n_used])
    kl = init_kl_controller("fixed", 0.1)
    settings = experience_settings(forward=forward_settings(micro_batch_size=2), missing_eos_penalty=0.5,
                                  whiten_rewards=True, gamma=0.9, lam=0.8)
    scores, ended = jnp.asarray([1.0, -0.5, 0.25, 0.0]), jnp.asarray([True, False, False, True])

    def make(rollout):
        return jax.jit(lambda ap, cp: make_experience(
            models_of(ag, ap, ap, cg, cp, None, None),
            Rollout(*rollout), kl, scores, ended,
            settings=settings))(ap, cp)

    (exp_w, _, stats_w), (exp_n, _, stats_n) = make(full), make(cut)
    assert exp_n.response_ids.shape == (B, n_used) and exp_n.query_ids.shape == (B, p_used)
    for field in ("logprobs", "ref_logprobs", "values", "rewards", "advantages", "returns"):
        wide, narrow = np.asarray(getattr(exp_w, field)), np.asarray(getattr(exp_n, field))
        np.testing.assert_allclose(narrow, wide[:, :n_used], rtol=1e-5, atol=1e-6, err_msg=field)
    np.testing.assert_allclose(exp_n.scores, exp_w.scores, rtol=1e-6)
    for key in stats_w:
        np.testing.assert_allclose(stats_n[key], stats_w[key], rtol=1e-5, atol=1e-6, err_msg=key)

    upd = update_settings(ppo_epochs=2, mini_batch_size=2, micro_batch_size=1, loss_aggregation=mode,
                         entropy_coef=0.01, kl_loss_coef=0.1, max_response_length=wide_n)
    (a_w, c_w, s_w), (a_n, c_n, s_n) = (run_update(models, e, upd) for e in (exp_w, exp_n))
    for key in s_w:
        np.testing.assert_allclose(s_n[key], s_w[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert float(np.abs(s_w["pg_loss"]).max()) > 0
    for narrow, wide in ((a_n.params, a_w.params), (c_n.params, c_w.params)):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), narrow, wide)


def test_the_sampler_log_probs_are_kept_and_their_mismatch_logged(models):
    """`make_experience(rollout_logprobs=...)` stores them and logs `mismatch/*`; without them
    the experience's rollout log-probs are its own log-probs and nothing is logged."""
    ag, ap, cg, cp = models
    exp, _, stats = experience(models)
    np.testing.assert_array_equal(exp.rollout_logprobs, exp.logprobs)
    assert not any(key.startswith("mismatch/") for key in stats)
    shift = np.where(np.asarray(exp.response_mask) > 0, 0.1, np.nan).astype(np.float32)
    shift[0, 0] = -0.2
    sampled = exp.logprobs - jnp.asarray(shift)  # NaN in the padding
    exp2, _, stats2 = make_experience(
        models_of(ag, ap, ap, cg, cp), Rollout(*rollout()), init_kl_controller("fixed", 0.1),
        jnp.asarray([1.0, -0.5, 0.25, 0.0]), jnp.ones(B, bool),
        settings=experience_settings(forward=forward_settings(micro_batch_size=4)),
        rollout_logprobs=sampled)
    np.testing.assert_array_equal(exp2.rollout_logprobs, sampled)
    d = np.asarray(exp2.logprobs - sampled, np.float64)[np.asarray(exp.response_mask) > 0]
    np.testing.assert_allclose(d, np.where(np.arange(d.size) == 0, -0.2, 0.1), atol=2e-5)
    np.testing.assert_allclose(stats2["mismatch/abs_logprob_diff"], np.abs(d).mean(), rtol=1e-4)
    np.testing.assert_allclose(stats2["mismatch/k3_kl"], (np.exp(d) - d - 1).mean(), rtol=1e-3)
    np.testing.assert_allclose(stats2["mismatch/max_ratio"], np.exp(d.max()), rtol=1e-4)
    np.testing.assert_allclose(stats2["mismatch/min_ratio"], np.exp(-0.2), rtol=1e-4)


@pytest.mark.slow  # default-run budget (21 s; each correction's weights stay in the default run); `make test-slow`
def test_a_rollout_correction_on_equal_log_probs_leaves_the_update_bit_identical(models):
    """rollout_logprobs == logprobs (no sampler log-probs): tis and mis weigh every token
    exactly 1, so losses, stats and params equal those without a correction bit for bit."""
    exp, _, _ = experience(models)
    kw = dict(ppo_epochs=1, mini_batch_size=2, micro_batch_size=1)
    a0, c0, s0 = run_update(models, exp, update_settings(**kw))
    assert not any(key.startswith("rollout_correction/") for key in s0)
    for mode in ("tis", "mis"):
        a1, c1, s1 = run_update(models, exp, update_settings(rollout_correction=mode, **kw))
        for key, value in s0.items():
            np.testing.assert_array_equal(s1[key], value, err_msg=f"{mode} {key}")
        np.testing.assert_allclose(s1["rollout_correction/weight_mean"], 1.0, rtol=1e-6)
        assert float(jnp.abs(s1["rollout_correction/truncated_fraction"]).max()) == 0.0
        jax.tree.map(np.testing.assert_array_equal, (a1.params, c1.params), (a0.params, c0.params))


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_a_rollout_correction_weighs_each_tokens_pg_loss(models, mode):
    """One minibatch (the whole batch), one epoch, micro-batches of one row: new log-probs
    equal old ones, so the per-token PPO loss is -A and pg_loss = sum_t w_t (-A_t) / N with the
    hand-computed weights of old - rollout = shift (rows of 5, 3, 1 and 4 tokens)."""
    exp, _, _ = experience(models)
    valid = np.asarray(exp.response_mask) > 0
    if mode == "tis":  # token ratios e^1 (truncated at 2), e^-0.5, e^0.3
        shift = np.random.default_rng(3).choice([1.0, -0.5, 0.3], valid.shape)
        weights, truncated = np.minimum(np.exp(shift), 2.0), (np.exp(shift) >= 2.0)[valid].mean()
    else:  # row log-ratios 0.5, 0.9 (> log 2: rejected), -0.2, 0.2
        shift = np.broadcast_to(np.array([0.1, 0.3, -0.2, 0.05])[:, None], valid.shape)
        rho = np.exp((shift * valid).sum(1))
        weights, truncated = np.where(rho <= 2.0, rho, 0.0)[:, None] * valid, 0.25
    exp = exp.replace(rollout_logprobs=exp.logprobs - jnp.asarray(shift, jnp.float32))
    settings = update_settings(ppo_epochs=1, mini_batch_size=B, micro_batch_size=1,
                              rollout_correction=mode, rollout_correction_cap=2.0)
    _, _, stats = run_update(models, exp, settings)
    adv = np.asarray(exp.advantages, np.float64)
    want = (weights * -adv)[valid].sum() / valid.sum()
    np.testing.assert_allclose(stats["pg_loss"][0, 0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["rollout_correction/weight_mean"][0, 0],
                               weights[valid].mean(), rtol=1e-5)
    np.testing.assert_allclose(stats["rollout_correction/truncated_fraction"][0, 0], truncated,
                               rtol=1e-6)
    assert 0 < truncated < 1


def test_decoupled_lambdas_reach_the_experience_and_the_critic_explained_variance_is_logged(models):
    """`critic_lam` / `lam_length_alpha` (ppo.*): the experience's returns take the critic's
    lambda, its advantages VAPO's per-row lambda (lengths 5, 3, 1, 4 with alpha 0.5: 0.6, 1/3,
    0, 0.5); `values_explained_variance` is `1 - Var(R - V) / Var(R)` over the response tokens;
    a critic-free estimator logs none."""
    from ppo_jax import core

    ag, ap, cg, cp = models
    head = cp["value_head"]["kernel"]  # a random value head: values that explain something
    cp = {**cp, "value_head": {**cp["value_head"], "kernel": jnp.asarray(
        np.random.default_rng(0).normal(size=head.shape) * 0.5, head.dtype)}}
    models = (ag, ap, cg, cp)
    base = dict(forward=forward_settings(micro_batch_size=2), whiten_advantages=False)
    plain, _, plain_stats = experience(models, experience_settings(**base))
    exp, _, stats = experience(models, experience_settings(**base, critic_lam=1.0,
                                                          lam_length_alpha=0.5))
    np.testing.assert_array_equal(exp.values, plain.values)
    mask = np.asarray(exp.action_mask)
    lam_rows = jnp.asarray([0.6, 1 / 3, 0.0, 0.5])
    adv, _ = core.compute_gae(exp.values, exp.rewards, mask, gamma=1.0, lam=lam_rows)
    _, ret = core.compute_gae(exp.values, exp.rewards, mask, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(exp.advantages, adv, atol=1e-5)
    np.testing.assert_allclose(exp.returns, ret, atol=1e-5)
    assert not np.allclose(exp.returns, plain.returns) and not np.allclose(exp.advantages,
                                                                          plain.advantages)
    for e, s in ((exp, stats), (plain, plain_stats)):
        v, r = np.asarray(e.values)[mask > 0], np.asarray(e.returns)[mask > 0]
        np.testing.assert_allclose(s["values_explained_variance"], 1 - np.var(r - v) / np.var(r),
                                   rtol=1e-4, atol=1e-5)
    _, _, free = experience(models, experience_settings(**base, advantage_estimator="rloo"))
    assert "values_explained_variance" not in free and "values_mean" in free


def test_a_critic_with_several_samples_per_prompt_logs_its_group_baseline_reference(models):
    """`samples_per_prompt` > 1 (rows 0-1 and 2-3 one prompt each): the stats add
    `group_baseline_explained_variance`, the returns explained by the other sample's first-token
    return, here recomputed in numpy; with one sample per prompt, or a critic-free estimator,
    it is absent."""
    ag, ap, cg, cp = models
    q, qm, r, rm = rollout()
    kl = init_kl_controller("fixed", 0.0, 6.0, 10000)
    settings = experience_settings(forward=forward_settings(micro_batch_size=2), gamma=1.0, lam=1.0,
                                  samples_per_prompt=2)
    exp, _, stats = jax.jit(lambda ap, cp: make_experience(
        models_of(ag, ap, ap, cg, cp), Rollout(q, qm, r, rm), kl, jnp.asarray([1.0, 0.0, 1.0, 1.0]),
        jnp.ones(B, bool), settings=settings, group_ids=jnp.asarray([0, 0, 1, 1], jnp.int32)))(ap, cp)
    mask, ret = np.asarray(exp.action_mask) > 0, np.asarray(exp.returns, np.float64)
    first = ret[:, 0]  # every row's first token is real
    baseline = first[[1, 0, 3, 2]]  # the other sample of the same prompt
    pred = np.broadcast_to(baseline[:, None], ret.shape)[mask]
    want = 1 - np.var(ret[mask] - pred) / np.var(ret[mask])
    np.testing.assert_allclose(stats["group_baseline_explained_variance"], want, rtol=1e-4,
                               atol=1e-5)
    _, _, one = experience(models)
    assert "group_baseline_explained_variance" not in one and "values_explained_variance" in one
    free = experience_settings(forward=forward_settings(micro_batch_size=2), advantage_estimator="rloo",
                              samples_per_prompt=2)
    _, _, free_stats = experience(models, free)
    assert "group_baseline_explained_variance" not in free_stats
