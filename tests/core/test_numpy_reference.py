"""Issue 2 acceptance item 7: every function equals an independent plain-numpy loop, in float64.

Random ragged batches (B up to 16, T up to 64, trailing padding, empty and full rows, NaN/inf
in padded slots), gamma and lam in {1, 0.95}, every KL estimator, every GAE method; and
``jax.jit``, ``jax.vmap`` and ``jax.grad`` of each loss. x64 is enabled only inside this module
(the fixture restores the previous setting).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax import core

TOL = dict(rtol=1e-6, atol=1e-6)
GAMMA_LAM = [(1.0, 1.0), (1.0, 0.95), (0.95, 1.0), (0.95, 0.95)]
SHAPES = [(16, 64, 5), (7, 33, 4), (3, 1, 3)]  # (B, T, V); T=33 is not a multiple of the chunk

pytestmark = pytest.mark.usefixtures("x64")


def ragged_batch(seed, b, t, v):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, t + 1, size=b)
    lengths[0] = 0  # an empty row
    if b > 1:
        lengths[1] = t  # a full row
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.int32)
    pad = mask == 0

    def masked_garbage(x, fill):
        x = x.copy()
        x[pad] = fill
        return x

    lp = -np.abs(rng.normal(1.0, 1.0, (b, t)))
    return dict(
        mask=mask,
        logits=rng.normal(0.0, 2.0, (b, t, v)),
        ref_logits=rng.normal(0.0, 2.0, (b, t, v)),
        tokens=rng.integers(0, v, (b, t)).astype(np.int32),
        scores=rng.normal(0.0, 2.0, b),
        logprobs=masked_garbage(lp, np.nan),
        ref_logprobs=masked_garbage(lp + rng.normal(0.0, 0.3, (b, t)), np.inf),
        old_logprobs=masked_garbage(lp + rng.normal(0.0, 0.3, (b, t)), np.nan),
        values=masked_garbage(rng.normal(0.0, 1.0, (b, t)), 1e30),
        old_values=masked_garbage(rng.normal(0.0, 1.0, (b, t)), np.nan),
        returns=masked_garbage(rng.normal(0.0, 1.0, (b, t)), -np.inf),
        advantages=masked_garbage(rng.normal(0.0, 1.0, (b, t)), np.nan),
    )


# ----------------------------------------------------------------- plain-loop references
def ref_logprob_entropy(logits, tokens, temperature):
    b, t, v = logits.shape
    lp, ent = np.zeros((b, t)), np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            z = [logits[i, j, k] / temperature for k in range(v)]
            m = max(z)
            lse = m + math.log(sum(math.exp(zk - m) for zk in z))
            lp[i, j] = z[tokens[i, j]] - lse
            ent[i, j] = -sum(math.exp(zk - lse) * (zk - lse) for zk in z)
    return lp, ent


def ref_full_kl(logits, ref_logits, temperature):
    b, t, v = logits.shape
    out = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            z = [x / temperature for x in logits[i, j]]
            w = [x / temperature for x in ref_logits[i, j]]
            lz = max(z) + math.log(sum(math.exp(x - max(z)) for x in z))
            lw = max(w) + math.log(sum(math.exp(x - max(w)) for x in w))
            out[i, j] = sum(math.exp(z[k] - lz) * ((z[k] - lz) - (w[k] - lw)) for k in range(v))
    return out


def ref_kl(lp, ref, estimator):
    d = lp - ref
    return {"kl": d, "abs": abs(d), "mse": 0.5 * d * d, "low_var_kl": math.exp(-d) + d - 1}[estimator]


def ref_rewards(scores, lp, ref, mask, kl_coef, estimator, reward_clip):
    b, t = mask.shape
    rewards, non_score = np.zeros((b, t)), np.zeros((b, t))
    for i in range(b):
        last = -1
        for j in range(t):
            if mask[i, j]:
                non_score[i, j] = -kl_coef * ref_kl(lp[i, j], ref[i, j], estimator)
                rewards[i, j] = non_score[i, j]
                last = j
        if last >= 0:
            s = scores[i] if reward_clip is None else min(max(scores[i], -reward_clip), reward_clip)
            rewards[i, last] += s
    return rewards, non_score


def ref_gae(values, rewards, mask, gamma, lam):
    b, t = mask.shape
    adv, ret = np.zeros((b, t)), np.zeros((b, t))
    for i in range(b):
        v = [values[i, j] if mask[i, j] else 0.0 for j in range(t)]
        r = [rewards[i, j] if mask[i, j] else 0.0 for j in range(t)]
        last = 0.0
        for j in reversed(range(t)):
            next_v = v[j + 1] if j + 1 < t else 0.0
            last = r[j] + gamma * next_v - v[j] + gamma * lam * last
            if mask[i, j]:
                adv[i, j] = last
                ret[i, j] = last + v[j]
    return adv, ret


def ref_mean_var(x, mask, unbiased=True):
    items = [x[i, j] for i in range(x.shape[0]) for j in range(x.shape[1]) if mask[i, j]]
    n = len(items)
    mean = sum(items) / n if n else 0.0
    var = sum((e - mean) ** 2 for e in items) / n if n else 0.0
    if unbiased and n > 1:
        var *= n / (n - 1)
    return mean, var


def ref_whiten(x, mask, shift_mean=True):
    mean, var = ref_mean_var(x, mask)
    out = np.zeros(x.shape)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            if mask[i, j]:
                out[i, j] = (x[i, j] - mean) / math.sqrt(var + 1e-8) + (0.0 if shift_mean else mean)
    return out


def ref_policy_loss(lp, old, adv, mask, eps, eps_high, dual_clip):
    """Loss, d loss / d lp, and stats by loops; ties (ratio strictly inside the clip) share grads."""
    n = int(mask.sum())
    loss, grad = 0.0, np.zeros(lp.shape)
    sums = dict(clipfrac=0.0, dual_clipfrac=0.0, approxkl=0.0, policykl=0.0, ratio=0.0)
    hi = eps if eps_high is None else eps_high
    for i, j in zip(*np.nonzero(mask)):
        a, r = adv[i, j], math.exp(lp[i, j] - old[i, j])
        rc = min(max(r, 1 - eps), 1 + hi)
        l1, l2 = -a * r, -a * rc
        l, g = (l1, -a * r) if l1 >= l2 else (l2, -a * r if rc == r else 0.0)
        if dual_clip is not None and a < 0 and l > -a * dual_clip:
            l, g = -a * dual_clip, 0.0
            sums["dual_clipfrac"] += 1
        loss += l
        grad[i, j] = g / n
        sums["clipfrac"] += float(l2 > l1)
        sums["approxkl"] += 0.5 * (lp[i, j] - old[i, j]) ** 2
        sums["policykl"] += old[i, j] - lp[i, j]
        sums["ratio"] += r
    return loss / n, grad, {k: s / n for k, s in sums.items()}


def ref_value_loss(v, old, ret, mask, c):
    n = int(mask.sum())
    loss, grad = 0.0, np.zeros(v.shape)
    sums = dict(vf_clipfrac=0.0, value_error=0.0, vpred=0.0)
    for i, j in zip(*np.nonzero(mask)):
        vc = min(max(v[i, j], old[i, j] - c), old[i, j] + c)
        e1, e2 = (v[i, j] - ret[i, j]) ** 2, (vc - ret[i, j]) ** 2
        loss += 0.5 * max(e1, e2)
        inside = old[i, j] - c < v[i, j] < old[i, j] + c
        grad[i, j] = ((v[i, j] - ret[i, j]) if e1 >= e2 else (vc - ret[i, j]) * inside) / n
        sums["vf_clipfrac"] += float(e2 > e1)
        sums["value_error"] += e1
        sums["vpred"] += v[i, j]
    return loss / n, grad, {k: s / n for k, s in sums.items()}


# ----------------------------------------------------------------- jitted entry points
# One compile per shape and static option (gamma, lam, kl_coef are traced): far cheaper than
# op-by-op execution of the same code.
@functools.partial(jax.jit, static_argnames=("estimator", "reward_clip"))
def jit_rewards(scores, lp, ref, mask, kl_coef, estimator, reward_clip):
    rewards, non_score = core.compute_rewards(scores, lp, ref, mask, kl_coef=kl_coef, estimator=estimator,
                                              reward_clip=reward_clip)
    return rewards, non_score, core.masked_sum(core.kl_penalty(lp, ref, estimator), mask)


@functools.partial(jax.jit, static_argnames=("method",))
def jit_gae(values, rewards, mask, gamma, lam, method):
    return core.compute_gae(values, rewards, mask, gamma=gamma, lam=lam, method=method, chunk=8)


@jax.jit
def jit_logit_functions(logits, ref_logits, tokens, temperature):
    return (core.logprobs_from_logits(logits, tokens, temperature),
            core.entropy_from_logits(logits, temperature),
            core.full_kl(logits, ref_logits, temperature))


@jax.jit
def jit_masked_stats(x, mask):
    return dict(mean=core.masked_mean(x, mask), var=core.masked_var(x, mask),
                var_biased=core.masked_var(x, mask, unbiased=False), whiten=core.masked_whiten(x, mask),
                whiten_keep_mean=core.masked_whiten(x, mask, shift_mean=False),
                row_means=core.masked_mean(x, mask, axis=1))


# ----------------------------------------------------------------- tests
@pytest.mark.parametrize("seed,shape", list(enumerate(SHAPES)))
def test_logprobs_entropy_and_full_kl_match_numpy_loops(seed, shape):
    d = ragged_batch(seed, *shape)
    for temperature in (1.0, 0.7):
        lp, ent = ref_logprob_entropy(d["logits"], d["tokens"], temperature)
        got_lp, got_ent, got_kl = jit_logit_functions(jnp.asarray(d["logits"]), jnp.asarray(d["ref_logits"]),
                                                      jnp.asarray(d["tokens"]), temperature)
        assert got_lp.dtype == jnp.float64
        np.testing.assert_allclose(got_lp, lp, **TOL)
        np.testing.assert_allclose(got_ent, ent, **TOL)
        np.testing.assert_allclose(got_kl, ref_full_kl(d["logits"], d["ref_logits"], temperature), **TOL)


@pytest.mark.parametrize("seed,shape", list(enumerate(SHAPES)))
def test_rewards_and_gae_match_numpy_loops_for_every_estimator_gamma_lam_and_method(seed, shape):
    d = ragged_batch(seed, *shape)
    j = {k: jnp.asarray(x) for k, x in d.items()}
    for estimator in core.KL_ESTIMATORS:
        reward_clip = None if estimator != "abs" else 1.5
        want_r, want_ns = ref_rewards(d["scores"], d["logprobs"], d["ref_logprobs"], d["mask"], 0.05,
                                      estimator, reward_clip)
        got_r, got_ns, kl_sum = jit_rewards(j["scores"], j["logprobs"], j["ref_logprobs"], j["mask"], 0.05,
                                            estimator, reward_clip)
        np.testing.assert_allclose(got_r, want_r, **TOL, err_msg=estimator)
        np.testing.assert_allclose(got_ns, want_ns, **TOL, err_msg=estimator)
        valid = d["mask"] > 0
        pairs = zip(d["logprobs"][valid], d["ref_logprobs"][valid])
        want_kl_sum = sum(ref_kl(a, b, estimator) for a, b in pairs)
        np.testing.assert_allclose(kl_sum, want_kl_sum, **TOL)
        for gamma, lam in GAMMA_LAM:
            want_a, want_ret = ref_gae(d["values"], want_r, d["mask"], gamma, lam)
            for method in core.GAE_METHODS:
                got_a, got_ret = jit_gae(j["values"], got_r, j["mask"], gamma, lam, method)
                msg = f"{estimator} gamma={gamma} lam={lam} {method}"
                np.testing.assert_allclose(got_a, want_a, **TOL, err_msg=msg)
                np.testing.assert_allclose(got_ret, want_ret, **TOL, err_msg=msg)


@pytest.mark.parametrize("seed,shape", list(enumerate(SHAPES)))
def test_masked_statistics_match_numpy_loops(seed, shape):
    d = ragged_batch(seed, *shape)
    got = jit_masked_stats(jnp.asarray(d["values"]), jnp.asarray(d["mask"]))
    mean, var = ref_mean_var(d["values"], d["mask"])
    np.testing.assert_allclose(got["mean"], mean, **TOL)
    np.testing.assert_allclose(got["var"], var, **TOL)
    _, var_biased = ref_mean_var(d["values"], d["mask"], unbiased=False)
    np.testing.assert_allclose(got["var_biased"], var_biased, **TOL)
    np.testing.assert_allclose(got["whiten"], ref_whiten(d["values"], d["mask"]), **TOL)
    np.testing.assert_allclose(got["whiten_keep_mean"], ref_whiten(d["values"], d["mask"], shift_mean=False),
                               **TOL)
    row_means = [ref_mean_var(d["values"][i:i + 1], d["mask"][i:i + 1])[0] for i in range(shape[0])]
    np.testing.assert_allclose(got["row_means"], row_means, **TOL)


@pytest.mark.parametrize("eps_high,dual_clip", [(None, None), (0.28, None), (None, 1.5)])
def test_policy_loss_value_gradient_and_stats_match_numpy_loops(eps_high, dual_clip):
    d = ragged_batch(11, 16, 64, 5)
    noise = np.random.default_rng(1).normal(0, 0.4, (16, 64))
    d["logprobs"] = np.where(d["mask"] > 0, d["old_logprobs"] + noise, np.nan)
    j = {k: jnp.asarray(x) for k, x in d.items()}
    kw = dict(cliprange=0.2, cliprange_high=eps_high, dual_clip=dual_clip)
    want_loss, want_grad, want_stats = ref_policy_loss(d["logprobs"], d["old_logprobs"], d["advantages"],
                                                       d["mask"], 0.2, eps_high, dual_clip)
    assert 0 < want_stats["clipfrac"] < 1  # the clip is exercised
    if dual_clip:
        assert want_stats["dual_clipfrac"] > 0

    def loss_fn(lp, old, adv, mask):
        return core.policy_loss(lp, old, adv, mask, **kw)

    args = (j["logprobs"], j["old_logprobs"], j["advantages"], j["mask"])
    (loss, stats), grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(*args)
    np.testing.assert_allclose(loss, want_loss, **TOL)
    np.testing.assert_allclose(grad, want_grad, **TOL)
    for k, v in want_stats.items():
        np.testing.assert_allclose(stats[k], v, **TOL, err_msg=k)
    np.testing.assert_allclose(stats["pg_loss"], want_loss, **TOL)

    # vmap over a stack of two batches (the second reversed) equals the two separate calls.
    stacked = [jnp.stack([a, a[::-1]]) for a in args]
    vloss, vstats = jax.jit(jax.vmap(loss_fn))(*stacked)
    np.testing.assert_allclose(vloss[0], want_loss, **TOL)
    want_reversed = ref_policy_loss(*[a[::-1] for a in (d["logprobs"], d["old_logprobs"], d["advantages"])],
                                    d["mask"][::-1], 0.2, eps_high, dual_clip)[0]
    np.testing.assert_allclose(vloss[1], want_reversed, **TOL)
    assert vstats["clipfrac"].shape == (2,)


def test_value_loss_value_gradient_and_stats_match_numpy_loops():
    d = ragged_batch(12, 16, 64, 5)
    j = {k: jnp.asarray(x) for k, x in d.items()}
    noise = np.random.default_rng(2).normal(0, 0.3, (16, 64))
    d["values"] = np.where(d["mask"] > 0, d["old_values"] + noise, 1e30)
    j["values"] = jnp.asarray(d["values"])
    want_loss, want_grad, want_stats = ref_value_loss(d["values"], d["old_values"], d["returns"], d["mask"],
                                                      0.2)
    assert 0 < want_stats["vf_clipfrac"] < 1

    def loss_fn(v, old, ret, mask):
        return core.value_loss(v, old, ret, mask, cliprange_value=0.2)

    args = (j["values"], j["old_values"], j["returns"], j["mask"])
    (loss, stats), grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(*args)
    np.testing.assert_allclose(loss, want_loss, **TOL)
    np.testing.assert_allclose(grad, want_grad, **TOL)
    for k, v in want_stats.items():
        np.testing.assert_allclose(stats[k], v, **TOL, err_msg=k)

    stacked = [jnp.stack([a, a[::-1]]) for a in args]
    vloss, vstats = jax.jit(jax.vmap(loss_fn))(*stacked)
    np.testing.assert_allclose(vloss[0], want_loss, **TOL)
    reversed_rows = [a[::-1] for a in (d["values"], d["old_values"], d["returns"], d["mask"])]
    want_reversed = ref_value_loss(*reversed_rows, 0.2)[0]
    np.testing.assert_allclose(vloss[1], want_reversed, **TOL)
    assert vstats["vf_clipfrac"].shape == (2,)
