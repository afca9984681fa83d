"""The environment side of one batch's episodes: the `rollout.turns.TurnService` that the
engine's turn loop hands each ended turn to (`EpisodeRunner.play`).

Every call goes through the run's `environments.CallPool` (`env.concurrency` places, each call
under `env.timeout_s` from its own start), so nothing here blocks the engine:

- a row's `reset` starts when the batch does (`EpisodeSteps(...)`), all rows at once up to the
  pool's places; generation does not wait for them;
- `submit(rows, turns)`: each turn is decoded and its `step` queued; a turn that comes before
  its row's `reset` has returned waits for it (its step starts when the reset is in);
- `ready()`: the finished calls, recorded (`record`: rewards, info, the observation ids), their
  answers handed to the engine once; an expired or failed call fails its own episode only
  (answer None), whatever the other rows do;
- `wait(timeout_s)`: blocks on the pool until a call of this batch finishes (or expires);
- `drain()`: after the engine, every call still in flight (the turns the budget cut), waited
  for.

Only this process's rows are here (`rollout.engine.turn_rows`); `episodes.gathered` gives
the other processes their records.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from ppo_jax.trainer.environments import (
    CallPool, EpisodeFailure, call_outcome, checked_reset, checked_step,
)


class EpisodeSteps:
    """The `TurnService` of one batch (module doc).

    Args:
      env: the environment; env_name: its name in errors.
      pool: the run's `CallPool`.
      rows: `{batch row: prompt record}`, the rows this process plays.
      decode: `fn(turn ids) -> text`.
      record: `fn(episode, turn ids, StepResult | EpisodeFailure) -> None | observation ids`
        (`EpisodeRunner._record`); new_episode: `fn() -> Episode`.
    """

    def __init__(self, env, env_name: str, pool: CallPool, rows: dict[int, dict], *,
                 decode: Callable, record: Callable, new_episode: Callable):
        self.env, self.name, self.pool = env, env_name, pool
        self.decode, self.record = decode, record
        self.episodes = {b: new_episode() for b in rows}
        self.calls: dict[int, tuple[str, Any, Optional[list[int]]]] = {
            b: ("reset", pool.submit(env.reset, row), None) for b, row in rows.items()}
        self.queued: dict[int, list[int]] = {}  # row -> a turn waiting for its reset
        self.answers: dict[int, Optional[list[int]]] = {}

    # ------------------------------------------------------------------ TurnService
    def submit(self, rows: list[int], turns: list[list[int]]) -> None:
        """Queue each row's step on its turn (after its reset, if that is still running)."""
        for b, turn in zip(rows, turns):
            ep = self.episodes[b]
            if b in self.calls:  # its reset is still running
                self.queued[b] = turn
            elif ep.failure is not None or ep.done:
                self.answers[b] = None
            else:
                self._step(b, turn)

    def ready(self) -> dict[int, Optional[list[int]]]:
        """The answers of the calls finished since the last call (module doc)."""
        self.pool.poll()
        for b, (kind, call, turn) in list(self.calls.items()):
            if call.finished:
                del self.calls[b]
                self._finish(b, kind, call, turn)
        out, self.answers = self.answers, {}
        return out

    def wait(self, timeout_s: Optional[float]) -> None:
        """Until a call of this batch finishes or `timeout_s` passes; with none in flight
        (another process's turns pending) a sleep of `timeout_s`, so the engine's idle
        rounds do not spin."""
        if self.answers:
            return
        calls = [call for _, call, _ in self.calls.values()]
        if calls:
            self.pool.wait(calls, timeout_s)
        elif timeout_s:
            time.sleep(timeout_s)

    # ------------------------------------------------------------------ the batch's end
    def drain(self) -> None:
        """Wait for every call still in flight and record it (answers are dropped)."""
        while True:
            self.ready()
            if not self.calls:
                self.answers = {}
                return
            self.pool.wait([call for _, call, _ in self.calls.values()])

    # ------------------------------------------------------------------ calls
    def _step(self, b: int, turn: list[int]) -> None:
        text = self.decode(turn)
        self.calls[b] = ("step", self.pool.submit(self.env.step, self.episodes[b].state, text),
                         turn)

    def _finish(self, b: int, kind: str, call, turn) -> None:
        ep, timeout = self.episodes[b], self.pool.timeout_s
        if kind == "step":
            out = checked_step(call_outcome(call, self.name, "step", timeout), self.name)
            self.answers[b] = self.record(ep, turn, out)
            return
        out = checked_reset(call_outcome(call, self.name, "reset", timeout), self.name)
        if isinstance(out, EpisodeFailure):
            ep.failure = out.error
        else:
            ep.state = out[0]
        if b in self.queued:  # the turn that waited for this reset
            self.submit([b], [self.queued.pop(b)])
