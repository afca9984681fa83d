"""Issue 59: the loss menu (CISPO, SAPO, GMPO, GSPO-token, Clip-Cov, KL-Cov) against float64
plain-loop references written from the papers' equations.

Hand-made batches: ratios just inside and just beyond each clip edge (1e-6 either side: the
gradient at the exact edge is not defined) and far beyond it, and the exact edges for the
values; positive, negative, zero and in-row varying advantages; an empty row, padded rows, a
multi-turn action mask (zeros inside a response), NaN in every masked slot. Each reference
gives the per-token loss and its Jacobian in the log-probs; reduced by a loop over the three
aggregation modes it must equal the jitted loss and `jax.grad` of it. x64 only in this module.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax import core

pytestmark = pytest.mark.usefixtures("x64")
NAN, D = float("nan"), 1e-6
TOL = dict(rtol=1e-9, atol=1e-12)
MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 1], [0] * 5, [1, 0, 0, 0, 0]])
B, T = MASK.shape
LP = np.array([[-2.0, -1.5, -0.4, -2.5, -0.9], [-3.0, -0.1, -1.2, NAN, NAN],
               [-0.6, -2.2, NAN, NAN, -0.05], [NAN] * 5, [-1.8, NAN, NAN, NAN, NAN]])


def token_ratios(d):
    """Token ratios around PPO's edges 0.8 / 1.28: at them (d = 0) or d inside / beyond."""
    return np.array([[0.8 - d, 0.8 + d, 1.28 - d, 1.28 + d, 1.0], [0.5, 2.0, 1.1, NAN, NAN],
                     [2.0, 0.5, NAN, NAN, 0.9], [NAN] * 5, [1.28 + d, NAN, NAN, NAN, NAN]])


TOKEN_ADV = np.array([[-1.0, -0.7, 0.9, 1.2, 0.5], [-1.5, 2.0, -0.3, NAN, NAN],
                      [-0.8, 0.6, NAN, NAN, 1.0], [NAN] * 5, [-2.0, NAN, NAN, NAN, NAN]])


def gmpo_log_ratios(d):
    """Log-ratios around GMPO's log-space edges -0.4 / +0.3 (cliprange 0.4, cliprange_high 0.3)."""
    return np.array([[0.3 - d, 0.3 + d, -0.4 - d, 0.8, 0.0], [-0.4 + d, -0.4 - d, 0.5, NAN, NAN],
                     [0.35, -1.0, NAN, NAN, 0.1], [NAN] * 5, [0.5, NAN, NAN, NAN, NAN]])


# rows: A > 0 constant; A < 0 constant; mixed signs, mean > 0; empty; A = 0 (sign 0)
GMPO_ADV = np.array([[1.0] * 5, [-0.5, -0.5, -0.5, NAN, NAN], [0.6, -0.2, NAN, NAN, 1.0],
                     [NAN] * 5, [0.0, NAN, NAN, NAN, NAN]])


def gspo_log_ratios(d):
    """Token log-ratios whose row means put s_i at / beyond 1.28 and 0.8, inside, and at 2."""
    offsets = np.array([0.05, -0.1, 0.2, -0.1, -0.05])
    means = [math.log(1.28 + d), math.log(0.8 - d), math.log(1.1), 0.0, math.log(2.0)]
    out = np.full((B, T), NAN)
    for b in range(B):
        valid = [t for t in range(T) if MASK[b, t]]
        if not valid:
            continue
        off = offsets[:len(valid)] - offsets[:len(valid)].mean()
        for k, t in enumerate(valid):
            out[b, t] = means[b] + off[k]
    return out


GSPO_ADV = np.array([[1.0, -0.5, 2.0, 0.3, -1.2], [-1.0, 0.5, -0.2, NAN, NAN],
                     [0.4, -0.4, NAN, NAN, 1.0], [NAN] * 5, [-1.0, NAN, NAN, NAN, NAN]])


def valid_tokens():
    return [(b, t) for b in range(B) for t in range(T) if MASK[b, t]]


# ----------------------------------------------------------------- float64 plain-loop references
# Each returns (per-token loss [B, T], Jacobian J[b, t, b2, t2] = d loss[b, t] / d lp[b2, t2]).
def ref_cispo(lp, old, adv, lo, hi):
    # verl core_algos.py 1753-1758: pg = -sg(clamp(r, 1 - lo, 1 + hi)) * A * log_prob
    loss, jac = np.zeros((B, T)), np.zeros((B, T, B, T))
    for b, t in valid_tokens():
        w = min(max(math.exp(lp[b, t] - old[b, t]), 1 - lo), 1 + hi)
        loss[b, t] = -w * adv[b, t] * lp[b, t]
        jac[b, t, b, t] = -w * adv[b, t]
    return loss, jac


def ref_sapo(lp, old, adv, tau_pos, tau_neg):
    # verl core_algos.py 1364-1388, TRL grpo_trainer.py 3093-3095: -(4/tau) sigmoid(tau (r-1)) A
    loss, jac = np.zeros((B, T)), np.zeros((B, T, B, T))
    for b, t in valid_tokens():
        r = math.exp(lp[b, t] - old[b, t])
        tau = tau_pos if adv[b, t] > 0 else tau_neg
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        loss[b, t] = -(4 / tau) * s * adv[b, t]
        jac[b, t, b, t] = -4 * s * (1 - s) * r * adv[b, t]
    return loss, jac


def _row(b):
    return [t for t in range(T) if MASK[b, t]]


def ref_gmpo(lp, old, adv, lo, hi):
    # GMPO (arXiv:2507.20673) objective, sign of the sequence advantage; verl core_algos.py
    # 1684-1707 (the same on rows of constant advantage)
    loss, jac = np.zeros((B, T)), np.zeros((B, T, B, T))
    for b in range(B):
        ts = _row(b)
        if not ts:
            continue
        a = float(sum(adv[b, t] for t in ts) / len(ts))
        g = (a > 0) - (a < 0)
        c, free = {}, {}
        for t in ts:
            x = lp[b, t] - old[b, t]
            if g > 0:
                c[t], free[t] = (x, True) if x <= hi else (hi, False)
            elif g < 0:
                c[t], free[t] = (x, True) if x >= -lo else (-lo, False)
            else:
                c[t], free[t] = 0.0, False
        rho = math.exp(sum(c.values()) / len(ts))
        for t in ts:
            loss[b, t] = -a * rho
            for u in ts:
                jac[b, t, b, u] = -a * rho / len(ts) if free[u] else 0.0
    return loss, jac


def ref_gspo_token(lp, old, adv, lo, hi):
    # GSPO sec. 4.3; verl core_algos.py 1291-1304, TRL gspo_token/grpo_trainer.py 78-82:
    # value s_i, gradient s_i d lp_t, PPO's clip per token
    loss, jac = np.zeros((B, T)), np.zeros((B, T, B, T))
    for b in range(B):
        ts = _row(b)
        if not ts:
            continue
        s = math.exp(sum(lp[b, t] - old[b, t] for t in ts) / len(ts))
        for t in ts:
            pg1, pg2 = -adv[b, t] * s, -adv[b, t] * min(max(s, 1 - lo), 1 + hi)
            loss[b, t] = max(pg1, pg2)
            jac[b, t, b, t] = 0.0 if pg2 > pg1 else -adv[b, t] * s
    return loss, jac


def ref_covariance(lp, adv):
    n = len(valid_tokens())
    ma = sum(adv[b, t] for b, t in valid_tokens()) / n
    ml = sum(lp[b, t] for b, t in valid_tokens()) / n
    return {(b, t): (adv[b, t] - ma) * (lp[b, t] - ml) for b, t in valid_tokens()}


def ref_top(cov, eligible, ratio):
    # verl's count max(1, int(ratio * N)); largest covariance first, ties by flat index
    k = max(1, math.floor(ratio * len(valid_tokens())))
    order = sorted(eligible, key=lambda bt: (-cov[bt], bt[0] * T + bt[1]))
    return set(order[:k])


def ref_clip_cov(lp, old, adv, lo, hi, ratio, lb, ub):
    # verl core_algos.py 1517-1539: PPO's clipped loss, corr = 0 on the selected band tokens
    loss, jac = np.zeros((B, T)), np.zeros((B, T, B, T))
    cov, ppo, clipped = ref_covariance(lp, adv), {}, set()
    for b, t in valid_tokens():
        r = math.exp(lp[b, t] - old[b, t])
        pg1, pg2 = -adv[b, t] * r, -adv[b, t] * min(max(r, 1 - lo), 1 + hi)
        ppo[b, t] = (max(pg1, pg2), 0.0 if pg2 > pg1 else -adv[b, t] * r)
        if pg2 > pg1:
            clipped.add((b, t))
    band = [bt for bt in valid_tokens() if bt not in clipped and lb < cov[bt] < ub]
    chosen = ref_top(cov, band, ratio)
    for bt in valid_tokens():
        if bt not in chosen:
            loss[bt], jac[bt + bt] = ppo[bt]
    return loss, jac, chosen, band, clipped


def ref_kl_cov(lp, old, adv, ratio, coef):
    # verl core_algos.py 1601-1614: -A r, plus coef |log r| on the top-k covariance tokens
    loss, jac = np.zeros((B, T)), np.zeros((B, T, B, T))
    cov = ref_covariance(lp, adv)
    chosen = ref_top(cov, valid_tokens(), ratio)
    for b, t in valid_tokens():
        x = lp[b, t] - old[b, t]
        r = math.exp(x)
        loss[b, t] = -adv[b, t] * r + (coef * abs(x) if (b, t) in chosen else 0.0)
        jac[b, t, b, t] = -adv[b, t] * r + (coef * np.sign(x) if (b, t) in chosen else 0.0)
    return loss, jac, chosen


def ref_weights(mode):
    """The aggregation's per-token weights, by loop (core/aggregation.py's formulas)."""
    w, n = np.zeros((B, T)), len(valid_tokens())
    for b, t in valid_tokens():
        w[b, t] = {"token-mean": 1 / n, "seq-mean-token-mean": 1 / (B * len(_row(b))),
                   "seq-mean-token-sum": 1 / (B * T)}[mode]
    return w


# ----------------------------------------------------------------- the comparisons
def old_of(lp, log_ratio):
    return np.where(MASK > 0, lp - log_ratio, NAN)


CASES = {  # name -> (log-ratios(d), advantages, reference(lp, old, adv), loss kwargs)
    "cispo": (lambda d: np.log(token_ratios(d)), TOKEN_ADV,
              lambda lp, old, adv: ref_cispo(lp, old, adv, 0.2, 0.28),
              dict(cliprange=0.2, cliprange_high=0.28)),
    "sapo": (lambda d: np.log(token_ratios(d)), TOKEN_ADV,
             lambda lp, old, adv: ref_sapo(lp, old, adv, 1.0, 1.05),
             dict(cliprange=0.2, tau_pos=1.0, tau_neg=1.05)),
    "gmpo": (gmpo_log_ratios, GMPO_ADV, lambda lp, old, adv: ref_gmpo(lp, old, adv, 0.4, 0.3),
             dict(cliprange=0.4, cliprange_high=0.3)),
    "gspo_token": (gspo_log_ratios, GSPO_ADV,
                   lambda lp, old, adv: ref_gspo_token(lp, old, adv, 0.2, 0.28),
                   dict(cliprange=0.2, cliprange_high=0.28)),
    "clip_cov": (lambda d: np.log(token_ratios(d)), TOKEN_ADV,
                 lambda lp, old, adv: ref_clip_cov(lp, old, adv, 0.2, 0.28, 0.2, 0.1, 1.17)[:2],
                 dict(cliprange=0.2, cliprange_high=0.28, clip_cov_ratio=0.2, clip_cov_lb=0.1,
                      clip_cov_ub=1.17)),
    "kl_cov": (lambda d: np.log(token_ratios(d)), TOKEN_ADV,
               lambda lp, old, adv: ref_kl_cov(lp, old, adv, 0.2, 0.5)[:2],
               dict(cliprange=0.2, kl_cov_ratio=0.2, kl_cov_coef=0.5)),
}


def jitted(name, old, adv, kw, mode):
    fn = core.get_policy_loss(name)

    def scalar(lp):
        batch = core.LossInputs(mask=jnp.asarray(MASK), logprobs=lp, old_logprobs=jnp.asarray(old),
                                advantages=jnp.asarray(adv))
        per_token, _ = fn(batch, **kw)
        return core.aggregate(per_token, batch.mask, mode), per_token

    return jax.jit(jax.value_and_grad(scalar, has_aux=True))


@pytest.mark.parametrize("mode", core.LOSS_AGGREGATIONS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_loss_and_gradient_equal_the_float64_reference(name, mode):
    log_ratio, adv, ref, kw = CASES[name]
    old = old_of(LP, log_ratio(D))
    want, jac = ref(LP, old, adv)
    w = ref_weights(mode)
    (value, per_token), grad = jitted(name, old, adv, kw, mode)(jnp.asarray(LP))
    assert per_token.dtype == jnp.float64
    np.testing.assert_allclose(per_token, want, **TOL)
    np.testing.assert_allclose(value, (w * want).sum(), **TOL)
    np.testing.assert_allclose(grad, np.einsum("bt,btcu->cu", w, jac), **TOL)
    assert np.all(np.asarray(grad)[MASK == 0] == 0)


@pytest.mark.parametrize("name", sorted(set(CASES) - {"clip_cov"}))
def test_values_at_the_exact_clip_edges_equal_the_reference(name):
    """(clip_cov left out: at an exact edge, whether PPO's clip is active, which decides if a
    token may be selected, rests on the last bit of exp; the loss jumps with the selection.)"""
    log_ratio, adv, ref, kw = CASES[name]
    old = old_of(LP, log_ratio(0.0))
    (value, per_token), _ = jitted(name, old, adv, kw, "token-mean")(jnp.asarray(LP))
    np.testing.assert_allclose(per_token, ref(LP, old, adv)[0], rtol=1e-9, atol=1e-9)


def test_the_batches_reach_every_case_they_are_meant_to():
    """The clip-cov band holds more candidates than it selects, a clipped token with a
    covariance in the band is passed over, and a token above the band too."""
    old = old_of(LP, np.log(token_ratios(D)))
    _, _, chosen, band, clipped = ref_clip_cov(LP, old, TOKEN_ADV, 0.2, 0.28, 0.2, 0.1, 1.17)
    cov = ref_covariance(LP, TOKEN_ADV)
    assert len(chosen) == 2 and len(band) > 2
    assert any(0.1 < cov[bt] < 1.17 for bt in clipped)
    assert any(cov[bt] >= 1.17 for bt in valid_tokens() if bt not in clipped)
    grad = np.einsum("bt,btcu->cu", ref_weights("token-mean"), ref_gmpo(
        LP, old_of(LP, gmpo_log_ratios(D)), GMPO_ADV, 0.4, 0.3)[1])
    assert np.count_nonzero(grad[0]) == 3 and grad[4, 0] == 0  # 2 of 5 clipped; A = 0 row


def test_gspo_token_equals_gspo_for_constant_advantages_and_not_otherwise():
    old = old_of(LP, gspo_log_ratios(D))
    means = [[np.mean([GSPO_ADV[b, t] for t in _row(b)]) if _row(b) else NAN] for b in range(B)]
    row_adv = np.where(MASK > 0, np.array(means), NAN)
    kw = dict(cliprange=0.2, cliprange_high=0.28)
    for mode in core.LOSS_AGGREGATIONS:
        (_, a), ga = jitted("gspo_token", old, row_adv, kw, mode)(jnp.asarray(LP))
        (_, b), gb = jitted("gspo", old, row_adv, kw, mode)(jnp.asarray(LP))
        np.testing.assert_allclose(a, b, **TOL)
        np.testing.assert_allclose(ga, gb, **TOL)
        _, ga = jitted("gspo_token", old, GSPO_ADV, kw, mode)(jnp.asarray(LP))
        _, gb = jitted("gspo", old, GSPO_ADV, kw, mode)(jnp.asarray(LP))
        assert np.abs(np.asarray(ga) - np.asarray(gb)).max() > 1e-3


def test_covariance_selection_is_deterministic_largest_first_ties_by_index():
    """Four tokens, covariances (0.25, 1, 1, 0.25) by construction: kl_cov's top-2 are the
    tied middle ones; with ratio 0.25 (k = 1) the first of them; clip_cov's band (0.5, 0.9)
    holds none, (0.1, 0.9) only the outer two: k = 1 takes the first."""
    mask = np.ones((1, 4), np.int32)
    adv = np.array([[0.5, 1.0, -1.0, -0.5]])
    lp = np.array([[-0.5, -2.0, 0.0, -1.5]])  # mean -1: lp - mean = (0.5, -1, 1, -0.5)
    batch = core.LossInputs(mask=mask, logprobs=jnp.asarray(lp), old_logprobs=jnp.asarray(lp),
                            advantages=jnp.asarray(adv))
    cov = core.token_covariance(batch.logprobs, batch.advantages, jnp.asarray(mask) > 0)
    np.testing.assert_allclose(cov, [[0.25, -1.0, -1.0, 0.25]])
    _, stats = core.kl_cov_loss(batch, kl_cov_ratio=0.5)
    np.testing.assert_array_equal(stats["kl_cov_frac"], [[1, 0, 0, 1]])
    _, stats = core.kl_cov_loss(batch, kl_cov_ratio=0.25)
    np.testing.assert_array_equal(stats["kl_cov_frac"], [[1, 0, 0, 0]])
    # lp = old (a first minibatch): |lp - old| adds no gradient, as torch's abs in verl
    grad = jax.grad(lambda x: core.kl_cov_loss(batch._replace(logprobs=x), kl_cov_ratio=0.5)[0]
                    .sum())(batch.logprobs)
    np.testing.assert_allclose(grad, -adv, **TOL)
    _, stats = core.clip_cov_loss(batch, cliprange=0.2, clip_cov_ratio=0.25, clip_cov_lb=0.1,
                                  clip_cov_ub=0.9)
    np.testing.assert_array_equal(stats["cov_clipfrac"], [[1, 0, 0, 0]])


def test_covariance_losses_depend_on_the_micro_batch_split():
    """Documented: the centring and the count are the call's, so two micro-batches of rows
    differ from the whole minibatch (the other losses add up exactly)."""
    old = old_of(LP, np.log(token_ratios(D)))
    kw = dict(kl_cov_ratio=0.2)

    def total(rows, name, **kw):
        norms = core.loss_normalizers(MASK)
        batch = core.LossInputs(mask=MASK[rows], logprobs=LP[rows], old_logprobs=old[rows],
                                advantages=TOKEN_ADV[rows])
        return core.aggregate(core.get_policy_loss(name)(batch, **kw)[0], MASK[rows],
                              "token-mean", norms)

    halves = [slice(0, 2), slice(2, 5)]
    whole = total(slice(0, 5), "kl_cov", **kw)
    assert abs(sum(total(r, "kl_cov", **kw) for r in halves) - whole) > 1e-3
    whole = total(slice(0, 5), "cispo", cliprange=0.2)
    np.testing.assert_allclose(sum(total(r, "cispo", cliprange=0.2) for r in halves), whole, **TOL)


@pytest.mark.parametrize("name,kw,key", [
    ("sapo", dict(tau_pos=0.0), "tau_pos"), ("sapo", dict(tau_neg=-1.05), "tau_neg"),
    ("cispo", dict(cliprange=-0.1), "cliprange"), ("gmpo", dict(cliprange_high=-1), "cliprange_high"),
    ("clip_cov", dict(clip_cov_lb=6.0), "clip_cov_lb"),
    ("clip_cov", dict(clip_cov_ratio=1.5), "clip_cov_ratio"),
    ("kl_cov", dict(kl_cov_ratio=0.0), "kl_cov_ratio"), ("kl_cov", dict(kl_cov_coef=-1), "kl_cov_coef"),
])
def test_a_direct_call_refuses_a_bad_hyper_parameter_by_name(name, kw, key):
    batch = core.LossInputs(mask=MASK, logprobs=np.nan_to_num(LP), old_logprobs=np.nan_to_num(LP),
                            advantages=np.nan_to_num(TOKEN_ADV))
    kw = {"cliprange": 0.2, **kw}
    with pytest.raises(core.LossKwargError, match=f"^{key}=") as err:
        core.get_policy_loss(name)(batch, **kw)
    assert err.value.key == key
