"""Host-side reward scoring of a PPO step, as functions of explicit values: decoding response
rows (`decode_responses`), scoring them with the run's reward function and each prompt's
record (an `answer`, a task's problem) into a `[B]` batch on the mesh and the reward
components' means (`text_scores`: `reward/<name>` metrics), the decoded samples of the last
step (`sample_records`), and the EOS id a reward model reads at (`reward_eos_id`). ReMax's
greedy baseline is `PPOTrainer.greedy_baseline`; the reward model scores inside the
experience pass (`stages.ppo.steps`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.parallel.host import local_rows
from ppo_jax.trainer.rewards.calls import RewardFunction, score_texts
from ppo_jax.trainer.stages.ppo.parts import LastRollout


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
    """This process's rows of the responses `ids`, `mask` (`[B, N]` on the mesh) decoded with
    `decode(ids, mask) -> strings` and scored by `reward_fn` against their `prompts` (and
    prompt records `rows`, for a function that takes them; `rewards.functions.score_texts`).

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
