"""Multi-turn episodes of a PPO step (`env.*`, docs/environments.md): the actor's turns alternate
with a registered environment's observations in one sequence per row (the run's
`rollout.sampler.Sampler` with turns: the engine's turn loop, `rollout.turns`), and the
episode's rewards become its score.

Per row: `reset(row)` starts the episode (its prompt was templated and tokenised when the
prompts loaded: `environments.episode_prompts`); at each turn end the turn's text (decoded,
its stop string included) goes to `env.step` within `env.timeout_s`. The calls of one moment
(the batch's resets; every turn that waits at one chunk boundary of the engine) run at once in
parallel threads with one deadline (`environments.run_resets` / `run_steps`), so failing calls
cost one `env.timeout_s` per turn, not one per row;
an observation is cut to `env.max_observation_tokens` in the chat template's frame
(`rollout.observations.observation_tokens`) and appended; `done`, a failure or `env.max_turns`
ends the row; a turn the budget cuts is still handed to `env.step`, to be scored. The score is
the sum of the episode's reward parts (a final verifier's and per-turn ones), at the last
action token; a failed episode
(the environment raised, timed out or returned garbage) scores 0 and is counted and reported
with the environment's name and the error, and training goes on, until every episode of
`env.max_failed_steps` steps in a row failed: then the run stops (`FailureStreak`: a
`UserCodeError` before that step's update, so the checkpoints written stay as they were).

Logged per step (`env/*`): turns per episode, failures, the share of episodes the environment
ended, the episodes, and what the environment reports: the mean over episodes of each `info`
key summed over the episode's turns (`env/<key>`) and of each reward part
(`env/reward/<part>`). The environment names its figures; this code names none.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import jax
import numpy as np

from ppo_jax.rollout.draws import Generation, SamplingSettings, TurnSettings
from ppo_jax.rollout.forward import Rollout
from ppo_jax.rollout.observations import observation_tokens
from ppo_jax.rollout.sampler import Sampler, engine_metrics
from ppo_jax.trainer.environments import (
    ALL_STOP_STRINGS, EpisodeFailure, build_environment, run_resets, run_steps,
)
from ppo_jax.trainer.config import ConfigError
from ppo_jax.trainer.faults import UserCodeError, checkpoint_kept
from ppo_jax.trainer.stages.ppo.step_data import Sampled, group_ids

MAX_REPORTED_FAILURES = 3  # per step, on stderr; all are counted in env/failures


@dataclass
class Episode:
    """The host record of one row's episode."""

    state: Any = None
    rewards: dict = field(default_factory=dict)  # reward part -> sum over the turns
    info: dict = field(default_factory=dict)  # info key -> sum over the turns
    failure: Optional[str] = None
    done: bool = False


def turn_settings(sampling: SamplingSettings, tokenizer, stop_strings, max_turns: int
                  ) -> SamplingSettings:
    """`sampling` with turns: the token sequences of `stop_strings` (each encoded without
    special tokens) and `max_turns`."""
    seqs = tuple(tuple(tokenizer.encode(s, add_special_tokens=False)) for s in stop_strings)
    return replace(sampling, turns=TurnSettings(tuple(s for s in seqs if s), max_turns))


def check_observation_room(env_cfg, tokenizer) -> None:
    """`env.max_observation_tokens` must leave room for text inside the chat template's frame
    around an observation (its ids count against the limit).

    Raises:
      ConfigError: naming `env.max_observation_tokens`, the frame's length and what to give.
    """
    role = env_cfg.observation_role
    frame = len(observation_tokens(tokenizer, "", role=role, max_tokens=1 << 30))
    if env_cfg.max_observation_tokens <= frame:
        raise ConfigError(f"env.max_observation_tokens={env_cfg.max_observation_tokens} leaves "
                          f"no room for an observation's text: the chat template's frame around "
                          f"a {role!r} observation takes {frame} ids; give at least {frame + 1}")


class EpisodeRunner:
    """Runs a batch's episodes with the run's sampler: `runner(sampler, actor, prompt_ids,
    prompt_mask, rows, key)` -> `(Generation, scores [B] float32, stats)` (module doc)."""

    def __init__(self, env_cfg, sampling: SamplingSettings, tokenizer):
        self.cfg, self.tokenizer = env_cfg, tokenizer
        self.last_stats = None  # the paged engine's `EngineStats` of the last batch
        check_observation_room(env_cfg, tokenizer)
        self.env = build_environment(env_cfg.name, env_cfg.kwargs, timeout_s=env_cfg.timeout_s)
        stops = env_cfg.stop_strings
        if stops is None:
            stops = getattr(self.env, "stop_strings", ALL_STOP_STRINGS)
        self.settings = turn_settings(sampling, tokenizer, stops, env_cfg.max_turns)
        self.stop_ids = set(sampling.stop_token_ids)
        self.streak = FailureStreak(self.env_name, env_cfg.max_failed_steps)

    def _start(self, rows: list[dict]) -> list[Episode]:
        """The batch's episodes, their resets run at once (`run_resets`, one deadline)."""
        return [Episode(failure=out.error) if isinstance(out, EpisodeFailure)
                else Episode(state=out[0])
                for out in run_resets(self.env, rows, timeout_s=self.cfg.timeout_s)]

    def _answer(self, episodes: list[Episode], turns: list[list[int]]
                ) -> list[Optional[list[int]]]:
        """Turn ends of several rows (`episodes[i]` ended the turn `turns[i]`): the steps of
        the live episodes run at once (`run_steps`: parallel threads, one deadline), each
        recorded; per row the observation ids, or None (the episode ended or failed)."""
        live = [i for i, ep in enumerate(episodes) if ep.failure is None and not ep.done]
        texts = [self.tokenizer.decode(turns[i], skip_special_tokens=True) for i in live]
        outs = run_steps(self.env, [episodes[i].state for i in live], texts,
                         timeout_s=self.cfg.timeout_s)
        answers: list[Optional[list[int]]] = [None] * len(episodes)
        for i, out in zip(live, outs):
            answers[i] = self._record(episodes[i], turns[i], out)
        return answers

    def _record(self, ep: Episode, turn: list[int], out) -> Optional[list[int]]:
        """One row's step result, recorded in `ep`; the observation ids or None."""
        if isinstance(out, EpisodeFailure):
            ep.failure = out.error
            return None
        ep.state = out.state
        for k, v in out.rewards.items():
            ep.rewards[k] = ep.rewards.get(k, 0.0) + float(v)
        for k, v in (out.info or {}).items():
            ep.info[k] = ep.info.get(k, 0) + v
        if out.done or out.observation is None:
            ep.done = True
            return None
        ids = observation_tokens(self.tokenizer, out.observation, role=self.cfg.observation_role,
                                 max_tokens=self.cfg.max_observation_tokens)
        if turn and turn[-1] in self.stop_ids and ids and ids[0] == turn[-1]:
            ids = ids[1:]  # the turn ended on the end-of-turn token: the frame's own is extra
        return ids

    def play(self, sampler: Sampler, actor, prompt_ids, prompt_mask, rows: list[dict], key
             ) -> tuple[Generation, list[Episode]]:
        """The batch's episodes: the sampler's `Generation` and each row's host record."""
        episodes = self._start(rows)

        def on_turn_end(batch_rows, turns):  # one call per chunk boundary: one deadline
            return self._answer([episodes[b] for b in batch_rows], turns)

        out = sampler(actor, prompt_ids, prompt_mask, key, self.settings, on_turn_end)
        self.last_stats = sampler.last_stats
        cut = cut_turns(out)  # turns the budget ended: the environment still scores them
        rows = [b for b, turn in enumerate(cut) if turn]
        self._answer([episodes[b] for b in rows], [cut[b] for b in rows])
        self._report(episodes)
        return out, episodes

    def __call__(self, sampler: Sampler, actor, prompt_ids, prompt_mask, rows: list[dict], key):
        out, episodes = self.play(sampler, actor, prompt_ids, prompt_mask, rows, key)
        return out, episode_scores(episodes), episode_stats(episodes, out.episodes.turns)

    def _report(self, episodes: list[Episode]) -> None:
        failed = [ep.failure for ep in episodes if ep.failure]
        for error in failed[:MAX_REPORTED_FAILURES]:
            print(f"env {self.env_name}: episode failed (reward 0): {error}", file=sys.stderr)
        more = len(failed) - MAX_REPORTED_FAILURES
        if more > 0:
            print(f"env {self.env_name}: {more} more episode{'s' if more > 1 else ''} failed "
                  "this step", file=sys.stderr)

    @property
    def env_name(self) -> str:
        return getattr(self.env, "name", self.cfg.name)


class FailureStreak:
    """The steps in a row whose every episode failed, against `env.max_failed_steps` (`limit`):
    `count(episodes, step, last_checkpoint)` after each training step's episodes, before its
    update. A step with one episode that did not fail starts the count again."""

    def __init__(self, env_name: str, limit: int):
        self.env_name, self.limit = env_name, limit
        self.steps, self.first = 0, None  # the streak's length and its first failure's text

    def count(self, episodes: list[Episode], step: int,
              last_checkpoint: Callable[[], Optional[int]]) -> None:
        """Count step `step`'s `episodes`; `last_checkpoint()`: the newest checkpoint's step,
        or None (called only to stop).

        Raises:
          UserCodeError: the `limit`-th step in a row whose every episode failed, naming the
            environment, the step, the count, the streak's first failure and the checkpoint
            kept (as `StageTrainer._stop_if_not_finite`): raised before the step's update and
            save, so nothing written changes; train.py prints it as one line, exit 1.
        """
        failures = [ep.failure for ep in episodes if ep.failure is not None]
        if not failures or len(failures) < len(episodes):
            self.steps, self.first = 0, None
            return
        self.steps, self.first = self.steps + 1, self.first or failures[0]
        if self.steps < self.limit:
            return
        kept = checkpoint_kept(last_checkpoint())
        raise UserCodeError(
            f"step {step}: every episode of environment {self.env_name!r} failed for "
            f"{self.steps} steps in a row (env.max_failed_steps={self.limit}); stopped before "
            f"its update ({kept}). The first failure: {self.first}")


def sampled_episodes(runner: EpisodeRunner, sampler: Sampler, actor, batch, gen_key, update_key,
                     rng, *, columns, place, batch_size: int, n: int, step: int,
                     last_checkpoint: Callable[[], Optional[int]]) -> Sampled:
    """The `step_data.Sampled` of a batch of episodes (`PPOTrainer.episode_rollout`): the
    prompts `batch` (`step_data.PromptBatch`) played by `sampler` with `gen_key`, responses
    cut to their bucket width (`columns`), the environment's scores, `env/*` stats, the action mask (None when no row
    holds an observation: today's single-turn experience, to the bit) and the ended flags.

    Raises:
      UserCodeError: step `step` is the `env.max_failed_steps`-th in a row whose every episode
        failed (`FailureStreak.count`; `last_checkpoint()` names the checkpoint kept).
    """
    out, episodes = runner.play(sampler, actor, batch.ids, batch.mask, batch.rows, gen_key)
    runner.streak.count(episodes, step, last_checkpoint)
    ep = out.episodes
    scores, stats = episode_scores(episodes), episode_stats(episodes, ep.turns)
    resp, resp_mask, width = columns(out.response_ids, out.response_mask)
    return Sampled(
        prompts=batch.texts,
        rollout=Rollout(batch.ids, batch.mask, resp, resp_mask,
                        None if out.routes is None else columns.cut(out.routes, width)),
        group_ids=group_ids(place, batch_size, n), baseline_scores=None, update_key=update_key,
        rng=rng, prompt_width=batch.width, response_width=int(width), end=time.perf_counter(),
        rows=batch.rows, scores=place.put_rows(scores, (batch_size,)), reward_stats=stats,
        rollout_logprobs=columns.cut(out.logprobs, width),
        engine_stats=engine_metrics(runner.last_stats),
        action_mask=columns.cut(ep.action_mask, width) if has_observations(out) else None,
        ended=place.put_rows(np.asarray(ep.ended, bool), (batch_size,)))


def has_observations(out: Generation) -> bool:
    """Whether any row holds an observation token (a response token that is not an action)."""
    return bool(np.any(np.asarray(out.episodes.action_mask) != np.asarray(out.response_mask)))


def cut_turns(out: Generation) -> list[list[int]]:
    """Per row, the tokens of a last turn the budget cut (the run of action tokens that ends
    the response, in a row that did not end), or [] (the row ended, or its last token is an
    observation's)."""
    ids, mask, actions = (np.asarray(x) for x in (out.response_ids, out.response_mask,
                                                  out.episodes.action_mask))
    turns = []
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        if out.episodes.ended[b] or n == 0 or not actions[b, n - 1]:
            turns.append([])
            continue
        start = n - 1
        while start > 0 and actions[b, start - 1]:
            start -= 1
        turns.append(ids[b, start:n].tolist())
    return turns


def episode_scores(episodes: list[Episode]) -> np.ndarray:
    """`[B]` float32: each episode's summed reward parts; 0 for a failed one."""
    return np.array([0.0 if ep.failure else sum(ep.rewards.values()) for ep in episodes],
                    np.float32)


def episode_stats(episodes: list[Episode], turns) -> dict[str, float]:
    """`env/*` means over the batch's episodes (module docstring): turns, failures, the share
    the environment ended, and per episode the sums of each `info` key (`env/<key>`) and each
    reward part (`env/reward/<part>`), an episode without a key counting 0."""
    n = len(episodes)
    stats = {
        "env/turns": float(np.mean(np.asarray(turns)[:n])),
        "env/failures": float(sum(ep.failure is not None for ep in episodes)),
        "env/done_fraction": float(np.mean([ep.done for ep in episodes])),
    }
    for k in sorted({k for ep in episodes for k in ep.info}):
        stats[f"env/{k}"] = float(np.mean([ep.info.get(k, 0) for ep in episodes]))
    for k in sorted({k for ep in episodes for k in ep.rewards}):
        stats[f"env/reward/{k}"] = float(np.mean([ep.rewards.get(k, 0.0) for ep in episodes]))
    stats["env/episodes"] = float(n)
    return stats


class EpisodeEvaluator:
    """The held-out evaluation of a multi-turn run: `eval.*`'s prompts (`evaluation.EvalBatch`,
    padding rows last) played as episodes with the eval sampling settings and the fixed key
    `eval.seed`, by the run's sampler. `evaluator(actor, num_samples)` -> `(metrics, samples)`:
    `eval/reward_mean`, the `env/*` figures as `eval/*` (the reward parts' means as
    `eval/reward/<part>`), `eval/response_length`, `time/eval`; samples are whole
    conversations, observations included. Called as `Evaluator` is, with the run's `PPOModels`
    (only the actor plays)."""

    @classmethod
    def of(cls, cfg, batch, sampling: SamplingSettings, tokenizer,
           sampler: Sampler) -> "EpisodeEvaluator":
        """The evaluator of run config `cfg` on the eval batch, with the eval `sampling`."""
        runner = EpisodeRunner(cfg.env, sampling, tokenizer)
        return cls(batch, runner, jax.random.PRNGKey(cfg.eval.seed), tokenizer, sampler)

    def __init__(self, batch, runner: EpisodeRunner, key, tokenizer, sampler: Sampler):
        self.batch, self.runner, self.key, self.tokenizer = batch, runner, key, tokenizer
        self.sampler = sampler
        rows = list(batch.rows or [{"prompt": t} for t in batch.texts])
        self.rows = rows + [rows[0]] * (len(batch.ids) - len(rows))

    def __call__(self, models, num_samples: int = 0, sampling_actor=None):
        t0 = time.perf_counter()
        real = len(self.batch.texts)
        out, episodes = self.runner.play(self.sampler, sampling_actor or models.actor,
                                         self.batch.ids, self.batch.mask, self.rows, self.key)
        eps, scores = episodes[:real], episode_scores(episodes)
        stats = episode_stats(eps, out.episodes.turns)
        metrics = {f"eval/{k[len('env/'):]}": v for k, v in stats.items()}
        metrics["eval/reward_mean"] = float(np.mean(scores[:real]))
        mask = np.asarray(out.response_mask)[:real]
        metrics["eval/response_length"] = float(mask.sum(axis=1).mean())
        metrics["time/eval"] = time.perf_counter() - t0
        ids = np.asarray(out.response_ids)
        samples = [{"prompt": self.batch.texts[i], "eval": True, "score": float(scores[i]),
                    "response": self.tokenizer.decode(ids[i][mask[i] > 0])}
                   for i in range(min(num_samples, real))]
        return metrics, samples
