"""Held-out evaluation of the actor during PPO (`eval.*`): how the policy does on prompts it is
not trained on, with everything but its params fixed.

One evaluation: the first `eval.num_prompts` prompts of `eval.prompts` (tokenised like the
training prompts, padded with copies of prompt 0 to a multiple of the mesh's batch shards and
of `ppo.micro_batch_size`; the copies are left out of every figure) -> one jitted sampling call
with the fixed key `eval.seed` -> the run's reward (the reward function on the decoded text, or
the reward model inside the next call, normalised as in training) -> one jitted call for the
actor and reference log-probs at the eval temperature and the statistics. The same key every
time makes two evaluations of the same params identical, and successive evaluations differ
only by the params (common random numbers).

Figures (`eval/`): reward mean / std over prompts (the raw score, as training's `score_mean`),
KL to the reference (mean over responses of the summed per-token `logprob - ref_logprob`, the
k1 estimate of training's `kl`), response length and the fraction of responses that emitted a
stop token.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ppo_jax.core import masked_mean
from ppo_jax.parallel.host import local_rows
from ppo_jax.rollout.sampler import generate
from ppo_jax.rollout.scoring import map_in_chunks, policy_logprobs, reward_model_scores
from ppo_jax.trainer.data import PromptSet
from ppo_jax.trainer.programs import Program, batch_shape


@dataclass(frozen=True)
class EvalSettings:
    """Static settings of an evaluation pass (hashable: a static jit argument)."""

    max_new_tokens: int
    temperature: float = 1.0  # sampling (unless greedy) and log-prob temperature
    greedy: bool = False
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    micro_batch_size: int = 1  # rows per forward pass of the log-prob / reward-model chunks
    mesh: Optional[Mesh] = None
    score_normalizer: Optional[tuple[float, float]] = None  # reward model (mean, std)
    reward_eos_id: Optional[int] = None  # reward.eos_at_end (see ExperienceSettings)
    logprob_chunk_size: int = 0  # model.logprob_chunk_size (scoring.head_logprobs)


@dataclass
class EvalBatch:
    """The padded eval prompts: `ids` / `mask` `[B, P]` int32 (left-padded), `valid` `[B]`
    bool (False on the padding copies), `texts` the `n` real prompts (rows `0..n-1`)."""

    ids: np.ndarray
    mask: np.ndarray
    valid: np.ndarray
    texts: list[str]


def eval_batch(prompts: PromptSet, num_prompts: int, multiple: int) -> EvalBatch:
    """The first `num_prompts` prompts (all when the set has fewer), padded with copies of
    prompt 0 to `B`, the next multiple of `multiple`.

    Raises:
      ValueError: `num_prompts` or `multiple` < 1.
    """
    if num_prompts < 1 or multiple < 1:
        raise ValueError(f"num_prompts={num_prompts} and multiple={multiple} must be >= 1")
    n = min(num_prompts, len(prompts))
    rows = -(-n // multiple) * multiple
    take = np.concatenate([np.arange(n), np.zeros(rows - n, np.int64)])
    return EvalBatch(prompts.ids[take], prompts.mask[take], np.arange(rows) < n,
                     list(prompts.texts[:n]))


def sample_eval_responses(graphdef, params, query_ids, query_mask, key, *,
                          settings: EvalSettings):
    """The actor's responses to the eval prompts (`rollout.sampler.generate` with the eval
    settings): `[B, P]` prompts -> `(response_ids [B, N], response_mask [B, N])` int32."""
    s = settings
    return generate(graphdef, params, query_ids, query_mask, key, max_new_tokens=s.max_new_tokens,
                    temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, greedy=s.greedy,
                    stop_token_ids=s.stop_token_ids, pad_token_id=s.pad_token_id, mesh=s.mesh)


def eval_summary(scores, logprobs, ref_logprobs, response_mask, ended, valid) -> dict:
    """The eval figures over the valid rows (NaN-safe on padding rows and tokens).

    Args:
      scores: `[B]` float, the sequence scores.
      logprobs, ref_logprobs: `[B, N]` float, actor and reference log-probs of the responses.
      response_mask: `[B, N]` 0/1, 1 on real response tokens.
      ended: `[B]` bool, whether the response emitted a stop token.
      valid: `[B]` bool, False on padding rows.

    Returns:
      `{"reward_mean", "reward_std" (population), "kl" (mean over rows of
      sum_t (lp - ref) over real tokens), "response_length", "ended_fraction"}`, float32 scalars.
    """
    valid = valid.astype(bool)
    scores = scores.astype(jnp.float32)
    mean = masked_mean(scores, valid)
    kl_rows = jnp.sum(jnp.where(response_mask > 0, logprobs - ref_logprobs, 0.0), axis=1)
    return {
        "reward_mean": mean,
        "reward_std": jnp.sqrt(masked_mean(jnp.square(jnp.where(valid, scores - mean, 0.0)), valid)),
        "kl": masked_mean(kl_rows, valid),
        "response_length": masked_mean(jnp.sum(response_mask, axis=1).astype(jnp.float32), valid),
        "ended_fraction": masked_mean(ended.astype(jnp.float32), valid),
    }


def eval_stats(actor_graphdef, actor_params, ref_graphdef, ref_params, reward_graphdef,
               reward_params, query_ids, query_mask, response_ids, response_mask, scores, valid,
               *, settings: EvalSettings):
    """Score the eval responses and summarise them (jit with `settings` static).

    Args:
      *_graphdef, *_params: split CausalLMs (actor, reference) and the reward model (None
        when `scores` come from a reward function).
      query_ids, query_mask: `[B, P]`; response_ids, response_mask: `[B, N]` int32.
      scores: `[B]` float32 from the reward function, or None for the reward model.
      valid: `[B]` bool, False on padding rows.

    Returns:
      `(eval_summary(...) dict, scores [B] float32)`.

    Raises:
      ValueError: B is not a multiple of `settings.micro_batch_size`.
    """
    s = settings
    rollout = (query_ids, query_mask, response_ids, response_mask)
    chunks = partial(map_in_chunks, mesh=s.mesh)

    def logprobs_of(graphdef, params):
        return chunks(lambda *r: policy_logprobs(graphdef, params, *r, temperature=s.temperature,
                                                 logprob_chunk_size=s.logprob_chunk_size,
                                                 mesh=s.mesh),
                      s.micro_batch_size, *rollout)

    if scores is None:
        scores = chunks(lambda *r: reward_model_scores(reward_graphdef, reward_params, *r,
                                                          eos_id=s.reward_eos_id),
                        s.micro_batch_size, *rollout)
        if s.score_normalizer is not None:
            mean, std = s.score_normalizer
            scores = (scores - mean) / std
    scores = scores.astype(jnp.float32)
    stops = jnp.asarray(s.stop_token_ids or (-1,), jnp.int32)
    ended = jnp.isin(response_ids, stops).any(axis=1) & (response_mask.sum(axis=1) > 0)
    stats = eval_summary(scores, logprobs_of(actor_graphdef, actor_params),
                         logprobs_of(ref_graphdef, ref_params), response_mask, ended, valid)
    return stats, scores


class Evaluator:
    """The evaluations of one PPO run: the eval prompts placed on the mesh once (rows split
    over ("data", "fsdp"), as a training batch), the two jitted calls compiled on first use.

    Args:
      batch: `eval_batch(...)`; B must be a multiple of the mesh's batch shards and of
        `settings.micro_batch_size`.
      settings: `EvalSettings`.
      place: the run's `Placement`.
      graphdefs: (actor, reference, reward model or None) graph definitions.
      shardings: the shardings of the (actor, reference, reward model) params the call gets.
      seed: `eval.seed`, the PRNG key of every evaluation.
      reward_fn: `fn(prompts, responses) -> [n] scores` on text, or None for the reward model.
      decode: `fn(ids [n, N], mask [n, N]) -> n strings`.
    """

    def __init__(self, batch: EvalBatch, settings: EvalSettings, place, graphdefs, shardings, *,
                 seed: int, reward_fn: Optional[Callable], decode: Callable):
        self.batch, self.place, self.reward_fn, self.decode = batch, place, reward_fn, decode
        self.settings = settings
        rows, rep = place.rows, place.replicated
        size, width = batch.ids.shape
        self.lo, self.hi = place.row_range(size)
        self.q = place.put_rows(batch.ids[self.lo:self.hi], (size, width))
        self.qm = place.put_rows(batch.mask[self.lo:self.hi], (size, width))
        self.valid = place.put_rows(batch.valid[self.lo:self.hi], (size,))
        self.key = place.replicate(jax.random.PRNGKey(seed))
        actor_gd, ref_gd, reward_gd = graphdefs
        actor_sh, ref_sh, reward_sh = shardings

        def stats(actor, ref, reward, q, qm, r, rm, scores, valid):
            return eval_stats(actor_gd, actor, ref_gd, ref, reward_gd, reward, q, qm, r, rm,
                              scores, valid, settings=settings)

        self._sample = jax.jit(partial(sample_eval_responses, actor_gd, settings=settings),
                               in_shardings=(actor_sh, rows, rows, rep), out_shardings=(rows, rows))
        self._stats = jax.jit(stats, in_shardings=(actor_sh, ref_sh, reward_sh) + (rows,) * 6,
                              out_shardings=(rep, rows))

    def inputs(self) -> tuple:
        """The eval prompts, validity mask and key this evaluator holds on the devices."""
        return self.q, self.qm, self.valid, self.key

    def programs(self, actor_params, ref_params, reward_params, *, per_step: float) -> list:
        """Its two jitted calls with abstract arguments (`trainer.programs.Program`): the eval
        sampler and the scoring, responses `settings.max_new_tokens` long."""
        size, new = self.batch.ids.shape[0], self.settings.max_new_tokens
        resp = batch_shape(self.place, (size, new), jnp.int32)
        scores = None if self.reward_fn is None else batch_shape(self.place, (size,), jnp.float32)
        note = f"every {round(1 / per_step)} steps" if per_step else ""
        return [Program("eval_sampler", self._sample, (actor_params, self.q, self.qm, self.key),
                        per_step, note, while_trips=new - 1),
                Program("eval_scoring", self._stats, (actor_params, ref_params, reward_params,
                                                      self.q, self.qm, resp, resp, scores,
                                                      self.valid), per_step, note)]

    def __call__(self, actor_params, ref_params, reward_params, num_samples: int = 0):
        """Evaluate the actor params (a CausalLM's) against the reference.

        Returns:
          `(metrics, samples)`: `{"eval/reward_mean", "eval/reward_std", "eval/kl",
          "eval/response_length", "eval/ended_fraction", "time/eval"}` as floats (not
          necessarily finite), and this process's first `num_samples` real rows as
          `{"prompt", "response", "score", "eval": True}` dicts.
        """
        t0 = time.perf_counter()
        resp, resp_mask = self._sample(actor_params, self.q, self.qm, self.key)
        texts, scores = None, None
        if self.reward_fn is not None:
            texts, local_scores = self._score_text(local_rows(resp), local_rows(resp_mask))
            scores = self.place.put_rows(local_scores, (self.batch.ids.shape[0],))
        stats, scores = self._stats(actor_params, ref_params, reward_params, self.q, self.qm, resp,
                                    resp_mask, scores, self.valid)
        metrics = {f"eval/{k}": float(v) for k, v in jax.device_get(stats).items()}
        samples = self._samples(num_samples, resp, resp_mask, scores, texts)
        metrics["time/eval"] = time.perf_counter() - t0
        return metrics, samples

    def _real_rows(self) -> int:
        """How many of this process's rows are real prompts (they come first)."""
        return max(0, min(self.hi, len(self.batch.texts)) - self.lo)

    def _score_text(self, resp: np.ndarray, resp_mask: np.ndarray):
        """Decode and score this process's real rows; padding rows score 0 (left out later)."""
        n = self._real_rows()
        texts = self.decode(resp[:n], resp_mask[:n])
        scores = np.zeros(len(resp), np.float32)
        scores[:n] = np.asarray(self.reward_fn(self.batch.texts[self.lo:self.lo + n], texts),
                                np.float32)
        return texts, scores

    def _samples(self, num: int, resp, resp_mask, scores, texts) -> list[dict]:
        n = min(num, self._real_rows())
        if n == 0:
            return []
        if texts is None:
            texts = self.decode(local_rows(resp)[:n], local_rows(resp_mask)[:n])
        local_scores = local_rows(scores)
        return [{"prompt": self.batch.texts[self.lo + i], "response": texts[i],
                 "score": float(local_scores[i]), "eval": True} for i in range(n)]


def eval_rows_multiple(batch_shards: int, micro_batch_size: int) -> int:
    """The eval batch is padded to a multiple of this: the mesh's batch shards (rows split
    evenly) and the forward-pass chunk (`map_in_chunks`)."""
    return math.lcm(batch_shards, micro_batch_size)
