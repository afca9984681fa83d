"""Response-length samplers for the schedule simulator (`aot.async_sim`): a `Lengths` is
`(rng, n) -> n ints in [1, N]`, N the run's `max_new_tokens`."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

Lengths = Callable[[np.random.Generator, int], np.ndarray]


def fixed_lengths(values) -> Lengths:
    """Lengths taken in turn from `values` (cycling): for hand-checked cases."""
    values, state = list(values), {"i": 0}

    def draw(rng, n):
        out = [values[(state["i"] + j) % len(values)] for j in range(n)]
        state["i"] += n
        return np.asarray(out, np.int64)

    return draw


def truncated_exponential_rate(mean: float) -> float:
    """The rate `a` of the density `a e^(a x) / (e^a - 1)` on [0, 1] whose mean is `mean`: the
    maximum-entropy distribution on an interval with a given mean (Jaynes 1957). `a` < 0
    for a mean below 1/2, 0 (uniform) at 1/2.

    Raises:
      ValueError: `mean` outside (0, 1)."""
    if not 0.0 < mean < 1.0:
        raise ValueError(f"mean={mean}: must be in (0, 1)")

    def mean_of(a):
        return 0.5 if abs(a) < 1e-9 else 1.0 / (-math.expm1(-a)) - 1.0 / a

    lo, hi = -700.0, 700.0
    for _ in range(200):  # bisection: the mean rises with the rate
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mean_of(mid) < mean else (lo, mid)
    return 0.5 * (lo + hi)


def _truncated_exponential(rng, a: float, n: int) -> np.ndarray:
    u = rng.random(n)
    if abs(a) < 1e-9:
        return u
    return np.log1p(u * np.expm1(a)) / a


def step_mixture_lengths(steps, max_new_tokens: int) -> Lengths:
    """Lengths shaped as logged steps of a run, rescaled to `max_new_tokens`.

    Args:
      steps: `[(mean fraction of the budget of the responses that ended, fraction cut at the
        budget), ...]`, one per logged step; each draw picks a step at random, then a sample is
        cut at the budget with that step's fraction, else drawn from the maximum-entropy
        (truncated exponential) distribution on the budget with that step's mean.
      max_new_tokens: the budget the fractions are scaled to.
    """
    rates = [truncated_exponential_rate(min(max(m, 1e-3), 1 - 1e-3)) for m, _ in steps]
    cut = np.asarray([c for _, c in steps])

    def draw(rng, n):
        pick = rng.integers(len(steps), size=n)
        x = np.asarray([_truncated_exponential(rng, rates[p], 1)[0] for p in pick])
        out = np.clip(np.ceil(x * max_new_tokens), 1, max_new_tokens).astype(np.int64)
        out[rng.random(n) < cut[pick]] = max_new_tokens
        return out

    return draw


def lognormal_lengths(median: float, sigma: float, max_new_tokens: int) -> Lengths:
    """Log-normal lengths (the shape reported for reasoning RL's response lengths) cut at the
    budget: `min(ceil(median e^(sigma z)), max_new_tokens)`, z standard normal."""

    def draw(rng, n):
        x = np.ceil(median * np.exp(sigma * rng.standard_normal(n)))
        return np.clip(x, 1, max_new_tokens).astype(np.int64)

    return draw
