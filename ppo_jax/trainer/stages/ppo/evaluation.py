"""Held-out evaluation of the actor during PPO (`eval.*`): how the policy does on prompts it is
not trained on, with everything but its params fixed.

One evaluation: the first `eval.num_prompts` prompts of `eval.prompts` (tokenised like the
training prompts, padded with copies of prompt 0 to a multiple of the mesh's batch shards and
of `ppo.micro_batch_size`; the copies are left out of every figure) -> the run's sampler
(`rollout.sampler.Sampler`: `generation.engine` as in training) with the fixed key `eval.seed`
-> the run's reward (the reward function on the decoded text, or the reward model inside the
next call, normalised as in training) -> one jitted call for the
actor and reference log-probs at the eval temperature and the statistics. The same key every
time makes two evaluations of the same params identical, and successive evaluations differ
only by the params (common random numbers).

Figures (`eval/`): reward mean / std over prompts (the raw score, as training's `score_mean`),
KL to the reference (mean over responses of the summed per-token `logprob - ref_logprob`, the
k1 estimate of training's `kl`), response length and the fraction of responses that emitted a
stop token. A reward function's components are logged as `eval/<name>` means; a verifier's
`accuracy` is `eval/accuracy`, and with `eval.samples_per_prompt` = k > 1 every prompt is
answered k times (adjacent rows, one group) and `eval/pass@k` is the fraction of prompts with
at least one fully right answer (accuracy 1). With `eval.plain_instruction` a second
`Evaluator` (`plain`) asks the same problems plainly (no tag named, no response prefix) with
the same key; its `accuracy_format_free` mean is `eval/accuracy_plain` (docs/rlvr.md).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ppo_jax.core import ended_rows, masked_mean, sequence_kl
from ppo_jax.parallel.host import local_rows
from ppo_jax.trainer.stages.ppo.experience import PPOModels
from ppo_jax.rollout.draws import SamplingSettings
from ppo_jax.rollout.sampler import Sampler
from ppo_jax.rollout.forward import Rollout, ForwardSettings, rollout_logprobs, rollout_scores
from ppo_jax.trainer.data.prompts import PromptSet
from ppo_jax.trainer.programs import Program, batch_shape
from ppo_jax.trainer.rewards.calls import score_texts


@dataclass(frozen=True)
class EvalSettings:
    """Static settings of an evaluation pass (hashable: a static jit argument): its sampling
    (`eval.*` temperature, greedy and length) and its forward passes (the log-prob temperature is the
    sampling temperature; `micro_batch_size` rows per forward pass)."""

    sampling: SamplingSettings
    forward: ForwardSettings


@dataclass
class EvalBatch:
    """The padded eval prompts: `ids` / `mask` `[B, P]` int32 (left-padded), `valid` `[B]`
    bool (False on the padding copies), `texts` the real rows' prompts (rows `0..n*k-1`:
    each of the n prompts `samples` = k times in a row), `rows` their prompt rows (record
    fields) or None."""

    ids: np.ndarray
    mask: np.ndarray
    valid: np.ndarray
    texts: list[str]
    rows: Optional[list[dict]] = None
    samples: int = 1


def eval_batch(prompts: PromptSet, num_prompts: int, multiple: int, samples: int = 1) -> EvalBatch:
    """The first `num_prompts` prompts (all when the set has fewer), each `samples` times in
    adjacent rows, padded with copies of prompt 0 to `B`, the next multiple of `multiple` and
    `samples`.

    Raises:
      ValueError: `num_prompts`, `multiple` or `samples` < 1.
    """
    if num_prompts < 1 or multiple < 1 or samples < 1:
        raise ValueError(f"num_prompts={num_prompts}, multiple={multiple} and samples={samples} "
                         "must be >= 1")
    n = min(num_prompts, len(prompts))
    real = np.repeat(np.arange(n), samples)
    multiple = math.lcm(multiple, samples)  # whole groups of copies: one shared prefill each
    rows = -(-len(real) // multiple) * multiple
    take = np.concatenate([real, np.zeros(rows - len(real), np.int64)])
    prompt_rows = None if prompts.rows is None else [prompts.rows[i] for i in real]
    return EvalBatch(prompts.ids[take], prompts.mask[take], np.arange(rows) < len(real),
                     [prompts.texts[i] for i in real], prompt_rows, samples)


def component_figures(parts: dict, valid, num_real: int, samples: int) -> dict:
    """Means over the valid rows of a reward function's components (`[B]` each, padding rows
    last), and `pass@k` (k = `samples` > 1) from `accuracy`: the fraction of the
    `num_real / samples` prompts whose k adjacent rows hold an accuracy of 1."""
    out = {k: masked_mean(v.astype(jnp.float32), valid) for k, v in parts.items()}
    if samples > 1 and "accuracy" in parts:
        solved = parts["accuracy"][:num_real].reshape(-1, samples) >= 1.0
        out[f"pass@{samples}"] = jnp.mean(jnp.any(solved, axis=1).astype(jnp.float32))
    return out


def eval_summary(scores, logprobs, ref_logprobs, response_mask, ended, valid) -> dict:
    """The eval figures over the valid rows (NaN-safe on padding rows and tokens).

    Args:
      scores: `[B]` float, the sequence scores.
      logprobs, ref_logprobs: `[B, N]` float, actor and reference log-probs of the responses.
      response_mask: `[B, N]` 0/1, 1 on real response tokens.
      ended: `[B]` bool, whether the response emitted a stop token.
      valid: `[B]` bool, False on padding rows.

    Returns:
      a dict of float32 scalars: "reward_mean"; "reward_std", the population std; "kl", the
      mean over rows of sum_t (lp - ref) over real tokens; "response_length";
      "ended_fraction".
    """
    valid = valid.astype(bool)
    scores = scores.astype(jnp.float32)
    mean = masked_mean(scores, valid)
    kl_rows = sequence_kl(logprobs, ref_logprobs, response_mask)
    return {
        "reward_mean": mean,
        "reward_std": jnp.sqrt(masked_mean(jnp.square(jnp.where(valid, scores - mean, 0.0)), valid)),
        "kl": masked_mean(kl_rows, valid),
        "response_length": masked_mean(jnp.sum(response_mask, axis=1).astype(jnp.float32), valid),
        "ended_fraction": masked_mean(ended.astype(jnp.float32), valid),
    }


def eval_stats(models: PPOModels, rollout: Rollout, scores, valid, *, settings: EvalSettings):
    """Score the eval responses and summarise them (jit with `settings` static).

    Args:
      models: the actor, the reference and (when `scores` is None) the reward model.
      rollout: the eval prompts `[B, P]` and responses `[B, N]` int32.
      scores: `[B]` float32 from the reward function, or None for the reward model.
      valid: `[B]` bool, False on padding rows.

    Returns:
      `(stats, scores)`: the `eval_summary` dict and the `[B]` float32 scores.

    Raises:
      ValueError: B is not a multiple of `settings.forward.micro_batch_size`.
    """
    s = settings.forward
    if scores is None:
        scores = rollout_scores(models.reward, rollout, s)
    scores = scores.astype(jnp.float32)
    ended = ended_rows(rollout.response_ids, rollout.response_mask,
                       settings.sampling.stop_token_ids)
    stats = eval_summary(scores, rollout_logprobs(models.actor, rollout, s),
                         rollout_logprobs(models.reference, rollout, s), rollout.response_mask,
                         ended, valid)
    return stats, scores


class Evaluator:
    """The evaluations of one PPO run. The eval prompts are placed on the mesh once, their
    rows split over the batch axes like a training batch's; the sampler's call and the jitted
    forward passes compile on first use.

    Args:
      batch: `eval_batch(...)`; B must be a multiple of the mesh's batch shards and of
        `settings.forward.micro_batch_size`.
      settings: `EvalSettings`.
      place: the run's `Placement`.
      shardings: `PPOModels` of the shardings of the actor, reference and reward model
        params, as `Placement.shardings` gives them; critic None.
      seed: `eval.seed`, the PRNG key of every evaluation.
      reward_fn: `fn(prompts, responses) -> [n] scores` on text (the run's, limited to
        `reward.timeout_s` a call), or None for the reward model.
      decode: `fn(ids [n, N], mask [n, N]) -> n strings`.
      plain: the `Evaluator` of the same problems under `eval.plain_instruction`, or None.
        Its reward function must report `accuracy_format_free`.
      sampler: the run's `Sampler`, laid out for the actor's trained params by
        `Sampler.laid_out`.
    """

    def __init__(self, batch: EvalBatch, settings: EvalSettings, place, shardings: PPOModels, *,
                 seed: int, reward_fn: Optional[Callable], decode: Callable,
                 sampler: Sampler, plain: Optional["Evaluator"] = None):
        self.batch, self.place, self.reward_fn, self.decode = batch, place, reward_fn, decode
        self.settings, self.plain, self.sampler = settings, plain, sampler
        by_row, rep = place.by_row, place.replicated
        size, width = batch.ids.shape
        self.lo, self.hi = place.row_range(size)
        self.q = place.put_rows(batch.ids[self.lo:self.hi], (size, width))
        self.qm = place.put_rows(batch.mask[self.lo:self.hi], (size, width))
        self.valid = place.put_rows(batch.valid[self.lo:self.hi], (size,))
        self.key = place.replicate(jax.random.PRNGKey(seed))

        def stats(models, q, qm, r, rm, scores, valid):
            return eval_stats(models, Rollout(q, qm, r, rm), scores, valid, settings=settings)

        self._stats = jax.jit(stats, in_shardings=(shardings,) + (by_row,) * 6,
                              out_shardings=(rep, by_row))

    def inputs(self) -> tuple:
        """The eval prompts, validity mask and key this evaluator holds on the devices."""
        return self.q, self.qm, self.valid, self.key

    def programs(self, models: PPOModels, *, per_step: float, sampling_actor=None) -> list:
        """Its jitted calls with abstract arguments (`trainer.programs.Program`): the eval
        sampler's (`Sampler.programs`, prefixed `eval_`, sampling `sampling_actor` or
        `models.actor`) and the forward passes, responses `settings.sampling.max_new_tokens`
        long; with `plain`, its own as well (`eval_plain_`)."""
        size, new = self.batch.ids.shape[0], self.settings.sampling.max_new_tokens
        resp = batch_shape(self.place, (size, new), jnp.int32)
        scores = None if self.reward_fn is None else batch_shape(self.place, (size,), jnp.float32)
        note = f"every {round(1 / per_step)} steps" if per_step else ""
        out = [Program(p["name"], p["fn"], p["args"], p["per_step"] * per_step, note,
                       while_trips=p["while_trips"])
               for p in self.sampler.programs(sampling_actor or models.actor, self.q, self.qm,
                                              self.key, self.settings.sampling, prefix="eval_")]
        out.append(Program("eval_forward", self._stats, (models, self.q, self.qm, resp, resp,
                                                         scores, self.valid), per_step, note))
        if self.plain is not None:  # eval_plain_sampler, eval_plain_forward
            out += [replace(p, name=p.name.replace("eval_", "eval_plain_"))
                    for p in self.plain.programs(models, per_step=per_step,
                                                 sampling_actor=sampling_actor)]
        return out

    def __call__(self, models: PPOModels, num_samples: int = 0, sampling_actor=None):
        """Evaluate the actor (a CausalLM's params in `models.actor`) against the reference.
        The responses are sampled from `sampling_actor` when given (`generation.placement:
        split`: the rollout group's copy of the same weights), else from `models.actor`.

        Returns:
          `(metrics, samples)`: `{"eval/reward_mean", "eval/reward_std", "eval/kl",
          "eval/response_length", "eval/ended_fraction", "time/eval"}` as floats (not
          necessarily finite), the reward components' `eval/<name>` and, with `plain`,
          `eval/accuracy_plain`; and this process's first `num_samples` real rows as
          `{"prompt", "response", "score", "eval": True}` dicts.

        Raises:
          ValueError: `plain` is set but its reward function reports no `accuracy_format_free`.
          RewardFunctionError: the reward function failed on the eval responses
            (`rewards.calls.call_reward_function`; the trainer names it and the step).
        """
        t0 = time.perf_counter()
        resp, resp_mask = self.sampler(sampling_actor or models.actor, self.q, self.qm,
                                       self.key, self.settings.sampling)[:2]
        texts, scores = None, None
        parts = {}
        if self.reward_fn is not None:
            texts, local_scores, local_parts = self._score_text(local_rows(resp),
                                                                local_rows(resp_mask))
            size = (self.batch.ids.shape[0],)
            scores = self.place.put_rows(local_scores, size)
            parts = component_figures({k: self.place.put_rows(v, size) for k, v in local_parts.items()},
                                      self.valid, len(self.batch.texts), self.batch.samples)
        stats, scores = self._stats(models, self.q, self.qm, resp, resp_mask, scores, self.valid)
        metrics = {f"eval/{k}": float(v) for k, v in jax.device_get({**stats, **parts}).items()}
        samples = self._samples(num_samples, resp, resp_mask, scores, texts)
        if self.plain is not None:
            metrics["eval/accuracy_plain"] = self._plain_accuracy(models, sampling_actor)
        metrics["time/eval"] = time.perf_counter() - t0
        return metrics, samples

    def _plain_accuracy(self, models: PPOModels, sampling_actor=None) -> float:
        """The plain evaluator's format-free accuracy (its `eval/accuracy_format_free`)."""
        figures, _ = self.plain(models, sampling_actor=sampling_actor)
        if "eval/accuracy_format_free" not in figures:
            raise ValueError("eval.plain_instruction scores the plain answers with the reward "
                             "function's accuracy_format_free part; this reward function "
                             f"reports {sorted(k[5:] for k in figures if k.startswith('eval/'))}")
        return figures["eval/accuracy_format_free"]

    def _real_rows(self) -> int:
        """How many of this process's rows are real prompts (they come first)."""
        return max(0, min(self.hi, len(self.batch.texts)) - self.lo)

    def _score_text(self, resp: np.ndarray, resp_mask: np.ndarray):
        """Decode and score this process's real rows; padding rows score 0 (left out later),
        and so do their reward components."""
        n, b = self._real_rows(), self.batch
        rows = None if b.rows is None else b.rows[self.lo:self.lo + n]
        texts, real, parts = score_texts(self.reward_fn, self.decode, b.texts[self.lo:self.lo + n],
                                         resp[:n], resp_mask[:n], rows)
        pad = lambda x: np.concatenate([x, np.zeros(len(resp) - n, np.float32)])  # noqa: E731
        return texts, pad(real), {k: pad(v) for k, v in parts.items()}

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
