"""The reward-function side of `PPOTrainer` (a mixin): decoding responses, scoring them on the
host with the run's reward function (and each prompt's row: an `answer`, a task's problem),
the reward components it reports (`reward/<name>` metrics), ReMax's greedy baseline, and the
decoded samples of the last step.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np

from ppo_jax.core import get_advantage_estimator, needs_greedy_baseline
from ppo_jax.models.functional import Model
from ppo_jax.parallel.host import local_rows
from ppo_jax.rollout.scoring import Rollout
from ppo_jax.trainer.rewards.functions import score_texts


class PPORewards:
    """Host-side scoring of a built `PPOTrainer` (its tokenizer, reward function, placement)."""

    def _decode(self, ids: np.ndarray, mask: np.ndarray) -> list[str]:
        """Response rows `[n, N]` as text, `data.response_prefix` in front (the assistant's
        turn as the user reads it)."""
        prefix = self.cfg.data.response_prefix or ""
        return [prefix + self.tokenizer.decode(row[m > 0].tolist(), skip_special_tokens=True)
                for row, m in zip(ids, mask)]

    def _rows_of(self, idx) -> Optional[list[dict]]:
        """The prompt rows (other fields of each prompt record) of prompt indices `idx`."""
        rows = self.prompts.rows
        return None if rows is None else [rows[i] for i in idx]

    def _text_scores(self, prompts: list[str], ids, mask, rows=None):
        """This process's rows of responses `ids`, `mask` decoded and scored by the reward
        function: `(responses, scores, components)`, the scores a `[B]` batch on the mesh,
        the components' batch means as floats (`reward/<name>`)."""
        texts, local, parts = score_texts(self.reward_fn, self._decode, prompts, local_rows(ids),
                                          local_rows(mask), rows)
        size = (self.cfg.ppo.batch_size,)
        means = {f"reward/{k}": float(jnp.mean(self.place.put_rows(v, size)))
                 for k, v in parts.items()}
        return texts, self.place.put_rows(local, size), means

    def _greedy_baseline(self, actor: Model, q, qm, key, prompts: list[str], rows=None):
        """ReMax: the score of the greedy response to each row's prompt (`[B]` rows), or None
        when the advantage estimator does not need it."""
        if not needs_greedy_baseline(get_advantage_estimator(self.cfg.ppo.advantage_estimator)):
            return None
        g_resp, g_mask, _ = self._generate_greedy(actor, q, qm, key)
        if self.reward_fn is None:
            reward = Model(self.models.reward.graphdef, self.place.onload(self.reward_params))
            return self._rm_scores(reward, Rollout(q, qm, g_resp, g_mask))
        return self._text_scores(prompts, g_resp, g_mask, rows)[1]

    @property
    def last_samples(self) -> list[dict]:
        """This process's rows of the last step as `{"prompt", "response", "score"}` dicts
        (decoded on demand when the reward came from a reward model)."""
        if getattr(self, "_last_rollout", None) is None:
            return []
        prompts, responses, rollout, scores = self._last_rollout
        if responses is None:
            responses = self._decode(local_rows(rollout.response_ids),
                                     local_rows(rollout.response_mask))
        return [{"prompt": p_, "response": r_, "score": float(s_)}
                for p_, r_, s_ in zip(prompts, responses, local_rows(scores))]
