"""The values of a PPO step: the prompt batch it draws (`next_prompts`, `PromptBatch`), its
three named parts (`PPOTrainer.sample_rollout`, `score_rollout`, `learn`: `Sampled`, `Scored`,
`Learned`), what it keeps for the decoded samples (`LastRollout`), and its metrics assembled
from the parts (`step_metrics`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import numpy as np

from ppo_jax.rollout.experience import Experience
from ppo_jax.rollout.forward import Rollout
from ppo_jax.trainer.data.order import DataOrder
from ppo_jax.trainer.data.prompts import PromptSet
from ppo_jax.trainer.stages.ppo.columns import PromptColumns


def _mean_stats(stats: dict) -> dict:
    """Means over epochs x minibatches; the first minibatch's ratio and approxkl (the PPO
    invariant: 1 and 0) when the policy loss reports them."""
    out = {k: float(np.mean(np.asarray(v))) for k, v in stats.items()}
    for key in ("ratio", "approxkl"):
        if key in stats:
            out[f"{key}_first_minibatch"] = float(np.asarray(stats[key])[0, 0])
    return out


@dataclass(frozen=True)
class PromptBatch:
    """The next batch of prompts (`next_prompts`): B rows, the `n` samples of a prompt adjacent.

    Attributes:
      indices: `[B]` the whole batch's prompt indices (every process knows them).
      ids, mask: `[B, W]` int32 on the mesh, left-padded, `W` = `width`.
      width: the prompt columns kept (a bucket width, or the set's full width).
      texts: this process's rows' prompt texts.
      rows: this process's rows' prompt records (their other fields), or None.
    """

    indices: np.ndarray
    ids: jax.Array
    mask: jax.Array
    width: int
    texts: list[str]
    rows: Optional[list[dict]]


def next_prompts(prompts: PromptSet, order: DataOrder, columns: PromptColumns, place, *,
                 batch: int, n: int, bucketed: bool = True) -> PromptBatch:
    """The next `batch // n` prompts of `order`, each repeated `n` times, put on the mesh.

    Column buckets (`stages.ppo.columns`): with `bucketed`, the batch's widest prompt rounded
    up to a bucket (read from the whole batch's indices, so every process agrees); else the
    set's full width (dynamic sampling concatenates rounds). Advances `order`.
    """
    lo, hi = place.row_range(batch)
    whole = np.repeat(order.next_indices(batch // n), n)
    idx = whole[lo:hi]  # this process's rows
    width = int(columns.width(whole) if bucketed else columns.full)
    ids = place.put_rows(columns.cut(prompts.ids[idx], width), (batch, width))
    mask = place.put_rows(columns.cut(prompts.mask[idx], width), (batch, width))
    return PromptBatch(indices=whole, ids=ids, mask=mask, width=width,
                       texts=[prompts.texts[i] for i in idx], rows=prompt_rows(prompts, idx))


def prompt_rows(prompts: PromptSet, idx) -> Optional[list[dict]]:
    """The prompt records (each prompt's other fields) of prompt indices `idx`, or None when the
    set has none."""
    return None if prompts.rows is None else [prompts.rows[i] for i in idx]


def group_ids(place, batch: int, n: int) -> jax.Array:
    """`[B]` int32 on the mesh: each row's prompt group, `row // n`."""
    lo, hi = place.row_range(batch)
    return place.put_rows((np.arange(batch, dtype=np.int32) // n)[lo:hi], (batch,))


@dataclass
class Sampled:
    """The rollout part of a step: this process's prompt texts, the batch's prompts and
    responses on the mesh (cut to their bucket widths), prompt groups, the ReMax baseline
    scores (or None), the RNG keys for the update and the next step, when it ended, and the
    prompts' rows (their records' other fields) for a reward function that reads them."""

    prompts: list[str]
    rollout: Rollout
    group_ids: jax.Array
    baseline_scores: Optional[jax.Array]
    update_key: jax.Array
    rng: jax.Array
    prompt_width: int
    response_width: int
    end: float
    rows: Optional[list[dict]] = None  # the prompts' rows (record fields) for the reward function
    scores: Optional[jax.Array] = None  # [B], when already scored (dynamic sampling)
    reward_stats: Optional[dict] = None  # the reward means of those scores
    rollout_logprobs: Optional[jax.Array] = None  # [B, N] the sampler's log-probs of its draws
    engine_stats: Optional[dict] = None  # the paged engine's `rollout/*` figures
    action_mask: Optional[jax.Array] = None  # [B, N] multi-turn: 1 on drawn tokens (env.*)
    ended: Optional[jax.Array] = None  # [B] multi-turn: the episodes that ended


@dataclass
class Scored:
    """The experience part: the experience, the updated KL controller, the experience stats and
    token counts (host values), the decoded responses (reward function only), when it ended."""

    experience: Experience
    kl_state: Any
    stats: dict
    tokens: dict
    responses: Optional[list[str]]
    end: float


@dataclass
class Learned:
    """The learning part: the new train states, the update's stats (host arrays `[epochs,
    minibatches]`), whether it was a critic warm-up step, when it ended."""

    actor: Any
    critic: Any
    stats: dict
    critic_warmup: bool
    end: float


@dataclass(frozen=True)
class LastRollout:
    """What a step keeps for its decoded samples (`rewards.sample_records`): this process's
    prompt texts, its decoded responses (None when a reward model scored: decoded on demand),
    the batch's `Rollout` and its `[B]` scores."""

    prompts: list[str]
    responses: Optional[list[str]]
    rollout: Rollout
    scores: jax.Array


def step_metrics(t0: float, sampled: Sampled, scored: Scored, learned: Learned,
                 data_position: int) -> dict:
    """The step's metrics (floats) from its three parts: the experience stats, the update's
    means (`_mean_stats`), phase times (`time/generation`, `time/experience`, `time/update`,
    `time/step`, seconds from `t0`), token rates, the data position and the column widths."""
    t_gen, t_score, t_update = sampled.end, scored.end, learned.end
    gen_tokens = float(scored.tokens["response"])
    total_tokens = float(scored.tokens["prompt"]) + gen_tokens
    metrics = {k: float(v) for k, v in scored.stats.items()}
    metrics.update(_mean_stats(learned.stats))
    metrics.update(sampled.engine_stats or {})
    metrics.update({
        "time/generation": t_gen - t0, "time/experience": t_score - t_gen,
        "time/update": t_update - t_score, "time/step": t_update - t0,
        "tokens_per_s/generation": gen_tokens / max(t_gen - t0, 1e-9),
        "tokens_per_s/step": total_tokens / max(t_update - t0, 1e-9),
        "data_position": data_position, "critic_warmup": float(learned.critic_warmup),
        "prompt_width": float(sampled.prompt_width),
        "response_width": float(sampled.response_width),
    })
    return metrics
