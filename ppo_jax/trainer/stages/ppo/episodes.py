"""Multi-turn episodes of a PPO step (`env.*`, docs/environments.md): the actor's turns alternate
with a registered environment's observations in one sequence per row (the run's
`rollout.sampler.Sampler` with turns: the engine's turn loop, `rollout.turns`), and the
episode's rewards become its score.

Per row: `reset(row)` starts the episode (its prompt was templated and tokenised when the
prompts loaded: `environments.episode_prompts`); at each turn end the turn's text (decoded,
its stop string included) goes to `env.step` within `env.timeout_s`. The calls run in the
run's `environments.CallPool` (`env.concurrency` at once, each under `env.timeout_s` from its
own start), asynchronously (`episode_steps.EpisodeSteps`, the engine's `TurnService`): a turn
that ends starts its step and the engine decodes the other rows meanwhile, taking the answer
in at the first chunk boundary it is ready, so one hanging tool costs its own episode, not the
batch's time; an observation is cut to `env.max_observation_tokens` in the chat template's
frame (`rollout.observations.observation_tokens`) and appended; `done`, a failure or
`env.max_turns` ends the row; a turn the budget cuts is still handed to `env.step`, to be
scored. The score is the sum of the episode's reward parts (a final verifier's and per-turn
ones), at the last action token; a failed episode (the environment raised, timed out or
returned garbage) scores 0 and is counted and reported with the environment's name and the
error, and training goes on, until every episode of `env.max_failed_steps` steps in a row
failed: then the run stops (`FailureStreak`: a `UserCodeError` before that step's update, so
the checkpoints written stay as they were).

Several processes: each plays the episodes of the rows it owns (`rollout.engine.turn_rows`:
the rows it feeds, a row block held by several processes played by the lowest), its calls in
its own pool; the engine exchanges the answers so every process runs the same programs
(`rollout.turns`), and at the end the episodes' records (rewards, info, failure) are gathered
(`parallel.host.allgather_json`), so every process holds all B and logs the same figures: two
processes give one process's step.

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

from ppo_jax.parallel.host import allgather_json, local_rows, row_range
from ppo_jax.rollout.draws import Generation, SamplingSettings, TurnSettings
from ppo_jax.rollout.engine import turn_rows
from ppo_jax.rollout.forward import Rollout
from ppo_jax.rollout.observations import observation_tokens
from ppo_jax.rollout.sampler import Sampler, engine_metrics
from ppo_jax.trainer.environments import (
    ALL_STOP_STRINGS, CallPool, EpisodeFailure, build_environment,
)
from ppo_jax.trainer.config import ConfigError
from ppo_jax.trainer.faults import UserCodeError, checkpoint_kept
from ppo_jax.trainer.stages.ppo.episode_steps import EpisodeSteps
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
    observed: bool = False  # the row holds an observation token
    length: int = 0  # its response tokens, observations included


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
    prompt_mask, rows, key)` -> `(Generation, scores [B] float32, stats)` (module doc).

    Args:
      env_cfg: the `env` section; sampling: the run's `SamplingSettings`; tokenizer.
      pool: the `CallPool` to run the environment's calls in (None: a new one of
        `env.concurrency` places; the evaluator shares the training runner's).
    """

    def __init__(self, env_cfg, sampling: SamplingSettings, tokenizer,
                 pool: Optional[CallPool] = None):
        self.cfg, self.tokenizer = env_cfg, tokenizer
        self.last_stats = None  # the paged engine's `EngineStats` of the last batch
        check_observation_room(env_cfg, tokenizer)
        self.env = build_environment(env_cfg.name, env_cfg.kwargs, timeout_s=env_cfg.timeout_s)
        self.pool = pool or CallPool(env_cfg.concurrency, env_cfg.timeout_s)
        stops = env_cfg.stop_strings
        if stops is None:
            stops = getattr(self.env, "stop_strings", ALL_STOP_STRINGS)
        self.settings = turn_settings(sampling, tokenizer, stops, env_cfg.max_turns)
        self.stop_ids = set(sampling.stop_token_ids)
        self.streak = FailureStreak(self.env_name, env_cfg.max_failed_steps)

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

    def play(self, sampler: Sampler, actor, prompt_ids, prompt_mask, rows: list[dict], key, *,
             first_row: int = 0) -> tuple[Generation, list[Episode]]:
        """The batch's episodes: the sampler's `Generation` and every row's host record (all
        B, on every process; `state` only in the rows this process played).

        `rows`: the prompt records of this process's rows, batch rows `first_row` on (all B
        with one process).

        Raises:
          ValueError: `rows` do not hold the rows this process plays (`turn_rows`).
        """
        batch = prompt_ids.shape[0]
        lo, hi = turn_rows(self.settings.mesh, batch)
        if lo < first_row or hi > first_row + len(rows):
            raise ValueError(f"this process plays rows [{lo}, {hi}) but holds the records of "
                             f"[{first_row}, {first_row + len(rows)})")
        steps = EpisodeSteps(self.env, self.env_name, self.pool,
                             {b: rows[b - first_row] for b in range(lo, hi)},
                             decode=self._decode, record=self._record, new_episode=Episode)
        out = sampler(actor, prompt_ids, prompt_mask, key, self.settings, steps)
        self.last_stats = sampler.last_stats
        cut = cut_turns(out, lo, hi)  # turns the budget ended: the environment still scores them
        steps.submit(list(cut), list(cut.values()))
        steps.drain()
        note_rows(steps.episodes, out)
        episodes = gathered(steps, batch)
        if jax.process_index() == 0:
            self._report(episodes)
        return out, episodes

    def _decode(self, turn: list[int]) -> str:
        return self.tokenizer.decode(turn, skip_special_tokens=True)

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


def local_batch_rows(x) -> tuple[np.ndarray, int]:
    """This process's rows of a batch array `[B, ...]` (numpy) and the first one's index."""
    first = 0 if jax.process_count() == 1 else row_range(x.sharding, x.shape[0])[0]
    return local_rows(x), first


def note_rows(episodes: dict[int, Episode], out: Generation) -> None:
    """Record in each played row's episode whether it holds an observation token and its
    response length, read from this process's rows of `out`."""
    (mask, first), (actions, _) = (local_batch_rows(x) for x in (out.response_mask,
                                                                out.episodes.action_mask))
    for b, ep in episodes.items():
        ep.observed = bool(np.any(actions[b - first] != mask[b - first]))
        ep.length = int(mask[b - first].sum())


def gathered(steps: EpisodeSteps, batch: int) -> list[Episode]:
    """All B rows' episodes: every process's records but their states, gathered
    (`parallel.host.allgather_json`); a row played here keeps its own record."""
    mine = [[b, ep.rewards, ep.info, ep.failure, ep.done, ep.observed, ep.length]
            for b, ep in sorted(steps.episodes.items())]
    episodes: list[Optional[Episode]] = [None] * batch
    for part in allgather_json(mine):
        for b, rewards, info, failure, done, observed, length in part:
            episodes[b] = steps.episodes[b] if b in steps.episodes else Episode(
                None, rewards, info, failure, done, observed, length)
    missing = [b for b, ep in enumerate(episodes) if ep is None]
    if missing:
        raise RuntimeError(f"no process played the episodes of rows {missing}")
    return episodes


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
    lo, hi = place.row_range(batch_size)
    out, episodes = runner.play(sampler, actor, batch.ids, batch.mask, batch.rows, gen_key,
                                first_row=lo)
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
        rows=batch.rows, scores=place.put_rows(scores[lo:hi], (batch_size,)), reward_stats=stats,
        rollout_logprobs=columns.cut(out.logprobs, width),
        engine_stats=engine_metrics(runner.last_stats),
        action_mask=columns.cut(ep.action_mask, width) if has_observations(episodes) else None,
        ended=place.put_rows(np.asarray(ep.ended[lo:hi], bool), (batch_size,)))


def has_observations(episodes: list[Episode]) -> bool:
    """Whether any row holds an observation token (a response token that is not an action)."""
    return any(ep.observed for ep in episodes)


def cut_turns(out: Generation, lo: int, hi: int) -> dict[int, list[int]]:
    """The tokens of each last turn the budget cut in rows `[lo, hi)` (this process's: the run
    of action tokens that ends the response, in a row that did not end): `{row: turn}`, rows
    that ended, or whose last token is an observation's, left out."""
    (ids, first), (mask, _), (actions, _) = (local_batch_rows(x) for x in (
        out.response_ids, out.response_mask, out.episodes.action_mask))
    turns = {}
    for b in range(lo, hi):
        i, n = b - first, int(mask[b - first].sum())
        if out.episodes.ended[b] or n == 0 or not actions[i, n - 1]:
            continue
        start = n - 1
        while start > 0 and actions[i, start - 1]:
            start -= 1
        turns[b] = ids[i, start:n].tolist()
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
    """The held-out evaluation of a multi-turn run: `eval.*`'s prompts (the `Evaluator`'s
    `EvalBatch`, padding rows last, on the mesh) played as episodes with the eval sampling
    settings and the fixed key `eval.seed`, by the run's sampler. `evaluator(actor,
    num_samples)` -> `(metrics, samples)`: `eval/reward_mean`, the `env/*` figures as `eval/*`
    (the reward parts' means as `eval/reward/<part>`), `eval/response_length`, `time/eval`;
    samples are whole conversations, observations included (this process's rows). Called as
    `Evaluator` is, with the run's `PPOModels` (only the actor plays)."""

    @classmethod
    def of(cls, cfg, evaluator, sampling: SamplingSettings, tokenizer, sampler: Sampler,
           pool: Optional[CallPool] = None) -> "EpisodeEvaluator":
        """The evaluator of run config `cfg` on the prompts of `evaluator`
        (`evaluation.Evaluator`: its batch, placed prompts and key), with the eval `sampling`;
        its calls in `pool` (the training runner's)."""
        runner = EpisodeRunner(cfg.env, sampling, tokenizer, pool)
        return cls(evaluator, runner, tokenizer, sampler)

    def __init__(self, evaluator, runner: EpisodeRunner, tokenizer, sampler: Sampler):
        self.batch, self.runner, self.tokenizer = evaluator.batch, runner, tokenizer
        self.q, self.qm, _, self.key = evaluator.inputs()
        self.lo, self.hi, self.sampler = evaluator.lo, evaluator.hi, sampler
        rows = list(self.batch.rows or [{"prompt": t} for t in self.batch.texts])
        rows = rows + [rows[0]] * (len(self.batch.ids) - len(rows))
        self.rows = rows[self.lo:self.hi]

    def __call__(self, models, num_samples: int = 0, sampling_actor=None):
        t0 = time.perf_counter()
        real = len(self.batch.texts)
        out, episodes = self.runner.play(self.sampler, sampling_actor or models.actor, self.q,
                                         self.qm, self.rows, self.key, first_row=self.lo)
        eps, scores = episodes[:real], episode_scores(episodes)
        stats = episode_stats(eps, out.episodes.turns)
        metrics = {f"eval/{k[len('env/'):]}": v for k, v in stats.items()}
        metrics["eval/reward_mean"] = float(np.mean(scores[:real]))
        metrics["eval/response_length"] = float(np.mean([ep.length for ep in eps]))
        metrics["time/eval"] = time.perf_counter() - t0
        (ids, first), (mask, _) = (local_batch_rows(x) for x in (out.response_ids,
                                                                 out.response_mask))
        shown = range(first, min(first + len(ids), real))[:num_samples]
        samples = [{"prompt": self.batch.texts[b], "eval": True, "score": float(scores[b]),
                    "response": self.tokenizer.decode(ids[b - first][mask[b - first] > 0])}
                   for b in shown]
        return metrics, samples
