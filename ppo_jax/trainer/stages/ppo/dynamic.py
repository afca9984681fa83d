"""DAPO's dynamic sampling for `PPOTrainer` (a mixin; `ppo.dynamic_sampling`): a group of
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
"""

from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.core import group_rows, informative_groups, select_groups
from ppo_jax.rollout.scoring import Rollout
from ppo_jax.trainer.stages.ppo.parts import Sampled


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


class DynamicSampling:
    """`dynamic_rollout()` of a built `PPOTrainer` (its sampler, reward function, placement)."""

    def _build_dynamic(self) -> None:
        rows, rep = self.place.rows, self.place.replicated
        n = self.cfg.generation.samples_per_prompt
        groups = self.cfg.ppo.batch_size // n
        self._informative = jax.jit(partial(informative_groups, num_groups=groups,
                                            samples_per_prompt=n), out_shardings=rep)
        self._select = jax.jit(partial(select_rollout, keep=groups, n=n),
                               out_shardings=(rows, rows, rep, rep))

    def _draw_round(self, key, actor):
        """The next batch of prompts at full width, sampled with `key` and scored: `(whole
        prompt indices, Rollout, scores, reward means, informative groups)`."""
        place, batch, n = self.place, self.cfg.ppo.batch_size, self.cfg.generation.samples_per_prompt
        lo, hi = place.row_range(batch)
        whole = np.repeat(self.prompt_order.next_indices(batch // n), n)
        idx, width = whole[lo:hi], self.prompt_columns.full
        q = place.put_rows(self.prompts.ids[idx], (batch, width))
        qm = place.put_rows(self.prompts.mask[idx], (batch, width))
        resp, mask, logprobs = jax.block_until_ready(self._generate(actor, q, qm, key))
        _, scores, means = self._text_scores([self.prompts.texts[i] for i in idx], resp, mask,
                                             self._rows_of(idx))
        informative = int(np.sum(jax.device_get(self._informative(scores))))
        return whole, (Rollout(q, qm, resp, mask), logprobs), scores, means, informative

    def dynamic_rollout(self) -> Sampled:
        """A `Sampled` batch of informative groups (module doc), its scores and reward means
        attached (`Sampled.scores`, `Sampled.reward_stats`)."""
        place, batch, n = self.place, self.cfg.ppo.batch_size, self.cfg.generation.samples_per_prompt
        rng, key, upd_key = self._split(self.state["rng"])
        actor = self.rollout_actor()
        drawn, found = [], 0
        while True:
            drawn.append(self._draw_round(key, actor))
            found += drawn[-1][4]
            if found >= batch // n or len(drawn) == self.cfg.ppo.max_sampling_rounds:
                break
            rng, key, _ = self._split(rng)
        (rollout, logprobs), scores, rows, kept = self._select(tuple(d[1] for d in drawn),
                                                               tuple(d[2] for d in drawn))
        source = np.concatenate([d[0] for d in drawn])[np.asarray(jax.device_get(rows))]
        lo, hi = place.row_range(batch)
        idx = source[lo:hi]
        resp, resp_mask, resp_width = self.response_columns(rollout.response_ids,
                                                            rollout.response_mask)
        groups = place.put_rows((np.arange(batch, dtype=np.int32) // n)[lo:hi], (batch,))
        stats = {k: float(np.mean([d[3][k] for d in drawn])) for k in drawn[0][3]}
        stats.update({"dynamic_sampling/rounds": float(len(drawn)),
                      "dynamic_sampling/kept_fraction": found / (len(drawn) * (batch // n)),
                      "dynamic_sampling/filled_fraction": 1 - int(kept) / (batch // n)})
        return Sampled([self.prompts.texts[i] for i in idx],
                       Rollout(rollout.query_ids, rollout.query_mask, resp, resp_mask), groups,
                       None, upd_key, rng, int(self.prompt_columns.full), int(resp_width),
                       time.perf_counter(), self._rows_of(idx), scores, stats,
                       rollout_logprobs=self.response_columns.cut(logprobs, resp_width))
