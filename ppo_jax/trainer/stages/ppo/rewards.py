"""A PPO step's reward function, on the host: decoding response rows (`decode_responses`),
scoring them with each prompt's record into a `[B]` batch on the mesh with the reward parts'
means (`text_scores`: `reward/<name>` metrics), the last step's decoded samples
(`sample_records`), the EOS id a reward model reads at (`reward_eos_id`); and user code that
fails mid-run, named: the reward function (`reward_faults`: a `UserCodeError` naming
`reward.function`, the step and the checkpoint kept) and a fork's registered formulas when a
step's losses are not finite (`finite_hint`). Load-time faults are `load_checks`'s
ConfigErrors.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.core import (
    get_advantage_estimator, get_policy_loss, get_reward_shaping, get_value_loss, uses_critic,
)
from ppo_jax.parallel.host import local_rows
from ppo_jax.trainer.environments import ENVIRONMENTS
from ppo_jax.trainer.faults import UserCodeError, checkpoint_kept
from ppo_jax.trainer.rewards.calls import RewardFunction, RewardFunctionError, score_texts
from ppo_jax.trainer.rewards.functions import REWARD_FUNCTIONS
from ppo_jax.trainer.stages.ppo.step_data import LastRollout


def decode_responses(tokenizer, prefix: str, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """Response rows `ids`, `mask` `[n, N]` as n strings, special tokens skipped, `prefix`
    (`data.response_prefix`) in front: the assistant's turn as the user reads it."""
    return [prefix + tokenizer.decode(row[m > 0].tolist(), skip_special_tokens=True)
            for row, m in zip(ids, mask)]


def reward_eos_id(eos_at_end: bool, tokenizer, stop_ids) -> Optional[int]:
    """The tokenizer's EOS id (the first stop id, in an abstract build: no tokenizer) when
    `reward.eos_at_end` (the reward model reads every response at an EOS), else None."""
    if not eos_at_end:
        return None
    if tokenizer is None:
        return int(stop_ids[0]) if stop_ids else 0
    return int(tokenizer.eos_token_id)


@dataclass(frozen=True)
class TextScores:
    """A batch scored by the reward function (`text_scores`): this process's rows decoded,
    the `[B]` float32 scores on the mesh, and each reward component's batch mean as a float
    (`{"reward/<name>": mean}`)."""

    responses: list[str]
    scores: jax.Array
    components: dict[str, float]


def text_scores(reward_fn: RewardFunction, decode: Callable, place, prompts: list[str], ids,
                mask, rows: Optional[list[dict]] = None) -> TextScores:
    """This process's rows of the responses `ids`, `mask` (`[B, N]` on the mesh), decoded with
    `decode(ids, mask) -> strings` and scored by `reward_fn` against their `prompts` with
    `rewards.calls.score_texts`. A function that takes prompt records also gets `rows`.

    Raises:
      RewardFunctionError: the reward function raised, timed out or returned something that
        is not one finite number per row (`rewards.calls.call_reward_function`).
    """
    texts, local, parts = score_texts(reward_fn, decode, prompts, local_rows(ids),
                                      local_rows(mask), rows)
    size = (ids.shape[0],)
    means = {f"reward/{k}": float(jnp.mean(place.put_rows(v, size))) for k, v in parts.items()}
    return TextScores(texts, place.put_rows(local, size), means)


def sample_records(last: Optional[LastRollout], decode: Callable) -> list[dict]:
    """This process's rows of the last step as `{"prompt", "response", "score"}` dicts (the
    responses decoded with `decode` when the reward model scored them); [] before any step."""
    if last is None:
        return []
    responses = last.responses
    if responses is None:
        responses = decode(local_rows(last.rollout.response_ids),
                           local_rows(last.rollout.response_mask))
    return [{"prompt": p, "response": r, "score": float(s)}
            for p, r, s in zip(last.prompts, responses, local_rows(last.scores))]



@contextmanager
def reward_faults(name: str, when: str, checkpointer) -> Iterator[None]:
    """Run the block; a `RewardFunctionError` raised in it (the reward function raised, timed
    out or returned something unusable) becomes a UserCodeError.

    Args:
      name: `reward.function`.
      when: the moment, e.g. "step 3" or "the evaluation at step 2".
      checkpointer: the run's `Checkpointer` (its latest step is the one kept), or None.

    Raises:
      UserCodeError: "reward.function='name' failed at <when>: it <what it did>; stopped before
        saving (<the checkpoint kept>)".
    """
    try:
        yield
    except RewardFunctionError as e:
        last = None if checkpointer is None else checkpointer.latest_step()
        raise UserCodeError(f"reward.function={name!r} failed at {when}: it {e}; stopped before "
                            f"saving ({checkpoint_kept(last)})") from e


def forks_in_play(cfg) -> list[str]:
    """The config's registered functions that a fork registered (module outside `ppo_jax`), as
    `"ppo.policy_loss='name' (module.function)"`: reward shaping, the advantage estimator, the
    policy loss, the value loss when the estimator trains a critic, and the reward function's
    or the environment's factory (their scores reach the losses)."""
    p = cfg.ppo
    estimator = get_advantage_estimator(p.advantage_estimator)
    used = [("ppo.reward_shaping", p.reward_shaping, get_reward_shaping(p.reward_shaping)),
            ("ppo.advantage_estimator", p.advantage_estimator, estimator),
            ("ppo.policy_loss", p.policy_loss, get_policy_loss(p.policy_loss))]
    if uses_critic(estimator):
        used.append(("ppo.value_loss", p.value_loss, get_value_loss(p.value_loss)))
    if cfg.env.name:
        used.append(("env.name", cfg.env.name, ENVIRONMENTS.get(cfg.env.name)))
    elif cfg.reward.kind == "function":
        used.append(("reward.function", cfg.reward.function,
                     REWARD_FUNCTIONS.get(cfg.reward.function)))
    forks = []
    for key, name, fn in used:
        module = getattr(fn, "__module__", None) or "?"
        if not module.startswith("ppo_jax."):
            forks.append(f"{key}={name!r} ({module}.{getattr(fn, '__qualname__', fn)})")
    return forks


def finite_hint(cfg, advice: str) -> str:
    """The words ending a non-finite stop of the run `cfg`: the loop's `advice`
    (`StageTrainer.finite_hint`), after the fork's formulas in play when there are any
    (`forks_in_play`), since a new formula is the likelier cause."""
    forks = forks_in_play(cfg)
    if not forks:
        return advice
    return (f"A fork's registered function is in play, {', '.join(forks)}: check what it "
            f"returns first. {advice}")
