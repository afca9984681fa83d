"""Python reward functions on decoded text, registered by name.

A reward function takes the decoded prompts and responses of a batch and returns one float per
sample: `fn(prompts: list[str], responses: list[str]) -> np.ndarray [B] float32`. Register a
new one with `@register_reward_function("name")` (a factory returning the function, so heavy set-up
runs only when selected) and select it with `reward.function=name`.
"""

from __future__ import annotations

from typing import Callable, Literal

import numpy as np

from ppo_jax.core.registry import Registry

REWARD_KINDS = ("function", "model")  # reward.kind: a registered function | a reward model
RewardKind = Literal[REWARD_KINDS]
RewardFunction = Callable[[list[str], list[str]], np.ndarray]
REWARD_FUNCTIONS = Registry("reward function")  # name -> factory () -> RewardFunction


def register_reward_function(name: str, *, override: bool = False):
    """Decorator registering a factory `() -> RewardFunction` under `name` (the registry
    convention of `ppo_jax.core.registry`: the same factory again is a no-op).

    Raises:
      ValueError: empty name, or `name` taken by another factory and not `override`.
    """
    return REWARD_FUNCTIONS.register(name, override=override)


def get_reward_function(name: str) -> RewardFunction:
    """Build the registered reward function `name`.

    Raises:
      ValueError: unknown name (`"unknown reward function 'x'; known: ..."`).
    """
    return REWARD_FUNCTIONS.get(name)()


@register_reward_function("vader")
def vader_sentiment() -> RewardFunction:
    """VADER compound sentiment of the response, in [-1, 1] (Hutto & Gilbert 2014).

    The lexicon ships inside the `vadersentiment` wheel; nothing is downloaded.
    """
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()

    def score(prompts: list[str], responses: list[str]) -> np.ndarray:
        del prompts
        return np.asarray([analyzer.polarity_scores(r)["compound"] for r in responses], np.float32)

    return score


@register_reward_function("length")
def response_length() -> RewardFunction:
    """Number of whitespace-separated words of the response divided by 10 (a debugging reward)."""

    def score(prompts: list[str], responses: list[str]) -> np.ndarray:
        del prompts
        return np.asarray([len(r.split()) / 10.0 for r in responses], np.float32)

    return score


def score_texts(reward_fn: RewardFunction, decode: Callable, prompts: list[str], ids: np.ndarray,
                mask: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Decode response rows `ids`, `mask` `[n, N]` (this process's) with `decode(ids, mask) ->
    n strings` and score them against their `prompts` with `reward_fn`.

    Returns:
      `(responses, scores [n] float32)`.
    """
    responses = decode(ids, mask)
    return responses, np.asarray(reward_fn(prompts, responses), np.float32)
