"""DAPO's dynamic sampling (`ppo.dynamic_sampling`), as functions of explicit values: a group of
samples whose rewards are all equal has zero advantage under GRPO-style estimators and carries
no policy gradient, so the step over-samples and trains on informative groups.

One step (Yu et al. 2025, "DAPO", sec. 3.2 and Algorithm 1, with static shapes):

1. Sample a batch as usual (`ppo.batch_size` rows: batch_size / n prompts x n samples) and
   score it with the reward function; count its informative groups (`core.informative_groups`:
   rewards not all equal).
2. While fewer than batch_size / n informative groups were found and fewer than
   `ppo.max_sampling_rounds` batches were drawn, draw the next batch of prompts (the data
   order advances: a resumed run draws the same ones) and score it.
3. Train on batch_size / n groups: the informative ones in the order drawn, and, when the cap
   left too few, the first uninformative ones to fill the batch (`core.select_groups`), so
   every step has the same shapes. The first round uses the key a plain step uses, so one
   round equals the plain step's sampling.

Logged: `dynamic_sampling/rounds`, `dynamic_sampling/kept_fraction` (informative groups /
groups drawn), `dynamic_sampling/filled_fraction` (uninformative groups in the batch / its
groups). `reward/<name>` means are over every row drawn in the step.

`PPOTrainer.dynamic_rollout` runs it: `draw_rounds` (step 1-2, one `draw_round` each) and
`informative_rollout` (step 3: `select_rollout`, jitted, and the `Sampled` batch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.core import group_rows, informative_groups, select_groups
from ppo_jax.models.functional import Model
from ppo_jax.rollout.forward import Rollout
from ppo_jax.trainer.data.prompts import PromptSet
from ppo_jax.trainer.stages.ppo.step_data import ResponseColumns
from ppo_jax.trainer.stages.ppo.step_data import PromptBatch, Sampled, group_ids, prompt_rows
from ppo_jax.trainer.stages.ppo.rewards import TextScores


def select_rollout(rollouts: tuple, scores: tuple, *, keep: int, n: int):
    """The training batch from several drawn rounds: `(rollout, scores, rows, kept)`.

    Args:
      rollouts: per round a pytree of `[B, ...]` rows (the `Rollout`, prompts at one width and
        responses at max_new_tokens, and the sampler's log-probs), the rows of a group adjacent.
      scores: per round the `[B]` scores.
      keep: groups in the batch (B / n); n: samples per prompt.

    Returns:
      the selected rows of that pytree and `[B]` scores, `rows [B]` int32 (indices into the rounds
      concatenated), `kept` (informative groups in the batch, int32).
    """
    both = jax.tree.map(lambda *x: jnp.concatenate(x), *rollouts)
    all_scores = jnp.concatenate(scores)
    informative = informative_groups(all_scores, all_scores.shape[0] // n, n)
    groups, kept = select_groups(informative, keep)
    rows = group_rows(groups, n)
    return jax.tree.map(lambda x: x[rows], both), all_scores[rows], rows, kept


@dataclass(frozen=True)
class DrawnRound:
    """One round of dynamic sampling (`draw_round`).

    Attributes:
      indices: `[B]` the whole batch's prompt indices.
      rollout: prompts `[B, P]` at the set's full width, responses `[B, N]` (max_new_tokens).
      logprobs: `[B, N]` the sampler's log-probs of its draws.
      scores: `[B]` float32 on the mesh.
      reward_means: the reward components' batch means (`reward/<name>`).
      informative: informative groups among the round's B / n.
    """

    indices: np.ndarray
    rollout: Rollout
    logprobs: jax.Array
    scores: jax.Array
    reward_means: dict[str, float]
    informative: int


def draw_round(batch: PromptBatch, actor: Model, key, *, sample: Callable,
               score: Callable[..., TextScores], informative: Callable) -> DrawnRound:
    """`batch` sampled by `actor` with `key`, scored on the host, its informative groups counted.

    `sample` is the run's sampler with the step's settings, `sample(actor, ids, mask, key) ->
    Generation`; `score(texts, ids, mask, rows) -> TextScores`; `informative` maps `[B]` scores
    to `[B / n]` bool, jitted."""
    out = jax.block_until_ready(sample(actor, batch.ids, batch.mask, key))
    resp, mask, logprobs = out.response_ids, out.response_mask, out.logprobs
    scored = score(batch.texts, resp, mask, batch.rows)
    found = int(np.sum(jax.device_get(informative(scored.scores))))
    return DrawnRound(indices=batch.indices,
                      rollout=Rollout(batch.ids, batch.mask, resp, mask, out.routes),
                      logprobs=logprobs, scores=scored.scores, reward_means=scored.components,
                      informative=found)


def draw_rounds(draw: Callable[[jax.Array], DrawnRound], rng, key, *, split_keys: Callable,
                groups: int, max_rounds: int) -> tuple[list[DrawnRound], jax.Array]:
    """Rounds `draw(key)` until `groups` informative groups were found or `max_rounds` were
    drawn (module doc, steps 1-2); the first with `key`, each next one with a key split from
    `rng`. Returns `(rounds, rng)`, `rng` the next step's key."""
    drawn, found = [], 0
    while True:
        drawn.append(draw(key))
        found += drawn[-1].informative
        if found >= groups or len(drawn) == max_rounds:
            return drawn, rng
        rng, key, _ = split_keys(rng)


def sampling_stats(drawn: list[DrawnRound], kept: int, groups: int) -> dict[str, float]:
    """The reward means over every round and `dynamic_sampling/*` (module doc) of `drawn`
    rounds of `groups` groups each, `kept` informative groups in the batch."""
    found = sum(d.informative for d in drawn)
    stats = {k: float(np.mean([d.reward_means[k] for d in drawn])) for k in drawn[0].reward_means}
    stats.update({"dynamic_sampling/rounds": float(len(drawn)),
                  "dynamic_sampling/kept_fraction": found / (len(drawn) * groups),
                  "dynamic_sampling/filled_fraction": 1 - kept / groups})
    return stats


def informative_rollout(drawn: list[DrawnRound], rng, update_key, *, select: Callable,
                        response_columns: ResponseColumns, prompts: PromptSet, place, n: int,
                        prompt_width: int) -> Sampled:
    """The `Sampled` batch of the informative groups of `drawn` (module doc, step 3; `select`:
    `select_rollout` jitted), responses cut to their bucket (`stages.ppo.step_data`), its scores
    and `sampling_stats` attached (`Sampled.scores`, `Sampled.reward_stats`)."""
    (rollout, logprobs), scores, rows, kept = select(
        tuple((d.rollout, d.logprobs) for d in drawn), tuple(d.scores for d in drawn))
    source = np.concatenate([d.indices for d in drawn])[np.asarray(jax.device_get(rows))]
    batch = source.shape[0]
    lo, hi = place.row_range(batch)
    idx = source[lo:hi]
    resp, resp_mask, resp_width = response_columns(rollout.response_ids, rollout.response_mask)
    return Sampled(
        prompts=[prompts.texts[i] for i in idx],
        rollout=Rollout(rollout.query_ids, rollout.query_mask, resp, resp_mask,
                        None if rollout.routes is None
                        else response_columns.cut(rollout.routes, resp_width)),
        group_ids=group_ids(place, batch, n), baseline_scores=None, update_key=update_key,
        rng=rng, prompt_width=prompt_width, response_width=int(resp_width),
        end=time.perf_counter(), rows=prompt_rows(prompts, idx), scores=scores,
        reward_stats=sampling_stats(drawn, int(kept), batch // n),
        rollout_logprobs=response_columns.cut(logprobs, resp_width))
