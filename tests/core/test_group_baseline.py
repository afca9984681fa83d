"""The critic's reference, ``outcome.group_baseline_explained_variance``: the explained variance
of the returns by the leave-one-out mean first-token return of the prompt's other samples.

A hand-computed case, a float64 plain numpy loop on random ragged batches (groups, a group of
one, an empty row, returns that vary along the row), and the -1/(n-1) of prompts that do not
differ.
"""

import numpy as np
import pytest

from ppo_jax.core import outcome


def prefix_mask(lengths, t):
    return (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)


def reference(returns, group_ids, mask):
    """Plain numpy, float64, written from the docstring's definition."""
    returns, mask = np.asarray(returns, np.float64), np.asarray(mask) > 0
    rows = [i for i in range(len(mask)) if mask[i].any()]
    first = {i: returns[i, np.argmax(mask[i])] for i in rows}
    overall = np.mean([first[i] for i in rows])
    pred, target = [], []
    for i in rows:
        others = [first[j] for j in rows if j != i and group_ids[j] == group_ids[i]]
        b = np.mean(others) if others else overall
        for t in np.flatnonzero(mask[i]):
            pred.append(b)
            target.append(returns[i, t])
    pred, target = np.asarray(pred), np.asarray(target)
    return 1 - np.var(target - pred) / np.var(target)


def test_worked_case():
    """Groups [1, 0, 0, 1] and [1, 1], one token each: b = [1/3, 2/3, 2/3, 1/3, 1, 1],
    Var(R) = 2/9, Var(R - b) = 8/27, so 1 - (8/27) / (2/9) = -1/3. Padding columns (mask 0)
    hold NaN and count for nothing."""
    returns = np.array([[1, np.nan], [0, np.nan], [0, np.nan], [1, np.nan], [1, np.nan],
                        [1, np.nan]], np.float32)
    mask = prefix_mask([1] * 6, 2)
    got = outcome.group_baseline_explained_variance(returns, np.array([0, 0, 0, 0, 1, 1]), mask)
    np.testing.assert_allclose(got, -1 / 3, rtol=1e-6)


def test_a_baseline_that_knows_the_prompts_explains_their_difference():
    """Two prompts, one always right and one always wrong: the others' mean is the row's own
    score, so it explains everything (1)."""
    mask = prefix_mask([2, 3, 1, 2], 3)
    returns = np.where(mask > 0, np.array([1.0, 1.0, 0.0, 0.0])[:, None], 0.0).astype(np.float32)
    got = outcome.group_baseline_explained_variance(returns, np.array([0, 0, 1, 1]), mask)
    np.testing.assert_allclose(got, 1.0, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_a_numpy_loop_in_float64(x64, seed):
    """Random ragged batch: groups of 4 with shuffled ids, a group of one, an empty row (NaN
    in it), per-token returns that differ along the row (KL in the rewards)."""
    rng = np.random.default_rng(seed)
    b, t = 14, 6
    group_ids = np.concatenate([np.repeat(np.arange(3), 4), [3, 4]])
    rng.shuffle(group_ids)
    lengths = rng.integers(1, t + 1, size=b)
    lengths[rng.integers(b)] = 0
    mask = prefix_mask(lengths, t)
    returns = rng.normal(size=(b, t)) + rng.integers(0, 2, size=b)[:, None]
    returns[mask == 0] = np.nan
    got = outcome.group_baseline_explained_variance(returns, group_ids, mask)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, reference(returns, group_ids, mask), rtol=1e-10)


def test_prompts_that_do_not_differ_give_about_minus_one_over_n_minus_one():
    """Every score an independent coin of one mean: leave-one-out, the baseline holds nothing
    of the row, and Var(R - b) = Var(R) (1 + 1/(n-1)): about -1/7 for n = 8."""
    rng = np.random.default_rng(0)
    n, groups = 8, 4000
    scores = (rng.random(n * groups) < 0.4).astype(np.float32)
    mask = np.ones((n * groups, 1), np.int32)
    got = outcome.group_baseline_explained_variance(scores[:, None], np.repeat(np.arange(groups), n),
                                                     mask)
    np.testing.assert_allclose(got, -1 / (n - 1), atol=0.01)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="returns"):
        outcome.group_baseline_explained_variance(np.ones((2, 3), np.int32), np.zeros(2, np.int32),
                                                  np.ones((2, 3)))
    with pytest.raises(ValueError, match="group_ids"):
        outcome.group_baseline_explained_variance(np.ones((2, 3), np.float32), np.zeros(3, np.int32),
                                                  np.ones((2, 3)))
    with pytest.raises(ValueError, match="mask"):
        outcome.group_baseline_explained_variance(np.ones((2, 3), np.float32), np.zeros(2, np.int32),
                                                  np.ones((2, 4)))
