"""The environment interface of multi-turn rollouts, its registry, and the fault wall around it.

An episode is a conversation between the policy and an environment:

    state, prompt = env.reset(row)                  # the first observation: the prompt text
    while True:
        text = <the policy's turn, sampled after the conversation so far>
        result = run_step(env, state, text, timeout_s=...)   # env.step in a worker thread
        if isinstance(result, EpisodeFailure) or result.done: break
        state = result.state                        # result.observation: the next user turn

A batch's calls go through `run_resets` / `run_steps`: every row's call in its own thread,
each under `timeout_s` from its own start (`pool.CallPool`), so a batch whose calls all hang
costs one `timeout_s`, not one per row. The episode driver (`stages.ppo.episode_steps`) keeps
one `CallPool` of `env.concurrency` places and hands it each turn as it ends.

The shape follows verl's agent loop (`ToolAgentLoop`) and OpenRLHF's `MultiTurnExecutor`
driving an `AgentInstanceBase`, after Gym's `reset` / `step`; the code is this project's own.
Two differences: the state is an explicit value passed in and returned, so one environment
object serves a whole batch from several threads; and a turn's reward is a dict of named parts
(`{"tool_cost": -0.05}`, the verifier's `{"correct": 1.0}`) that the driver sums and logs part
by part.

Faults: `run_step(s)` / `run_reset(s)` never raise for a fault of the environment. An
exception, a call slower than `timeout_s`, or a malformed return (not a `StepResult`, a reward
float32 cannot hold, an empty or non-text prompt, ...) becomes an `EpisodeFailure` naming the
environment and the problem: that episode fails, zero-scored and counted, and the run goes on.
At load, `episode_prompts` turns the first such failure into a ValueError, and
`get_environment` does the same for any exception of a factory.

Register a factory `(**kwargs) -> Environment` with `@register_environment("name")`; a fork
registers its own in a module that `train.py --import MODULE` imports (docs/environments.md).

The turn limit (`max_turns`) and the token budget of observations belong to the rollout
driver: an environment answers one turn at a time and never counts turns it did not see.
"""

from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence, Union

from ppo_jax.core.registry import Registry
from ppo_jax.trainer.environments.pool import EXPIRED, HUNG_PER_PLACE, REFUSED, Call, CallPool
from ppo_jax.trainer.rewards.deadline import Expired, call_with_deadline

TRUNCATION_MARKER = "...[truncated]"
ENVIRONMENTS = Registry("environment")  # name -> factory (**kwargs) -> Environment
LOAD_CHUNK = 64  # records whose `reset`s run at once at load: the first failing chunk stops it
FACTORY_TIMEOUT_S = 60.0  # a factory's least time at set-up (`build_environment`)
FLOAT32_MAX = 3.4028234663852886e38  # a reward or info value beyond it is inf where it is used


@dataclass(frozen=True)
class StepResult:
    """What an environment answers to one policy turn.

    Attributes:
      observation: the text of the next user or tool turn the policy sees; None when `done`.
      done: the episode is over (a final answer, the attempts used up).
      rewards: named reward parts of this turn, finite floats (`{"tool_cost": -0.05}`; the
        verifier's final reward under "correct"); `{}` for none. The driver sums them.
      state: the episode's state after this turn, passed to the next `step`.
      info: numbers of this turn to log, summed over the episode (`{"tool_call": 1}`).
    """

    observation: Optional[str]
    done: bool
    rewards: dict = field(default_factory=dict)
    state: Any = None
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EpisodeFailure:
    """An episode ended by a fault of its environment: `env_name` and the `error` text, e.g.
    `"environment 'calculator': step raised ZeroDivisionError: ..."`."""

    env_name: str
    error: str


class Environment:
    """Base class of environments; any object with these members will do.

    An environment holds only its configuration; everything of one episode is in the `state` value
    it returns. `step` must not mutate `self`, since the episodes of a batch share the object and
    may run in parallel threads.
    """

    name: str = "environment"

    def reset(self, row: dict) -> tuple[Any, str]:
        """Start an episode on the prompt record `row`: its `prompt` and other fields, such as an
        `answer` or a reasoning-gym `entry`.

        Returns:
          `(state, prompt)`: the episode's first state and the first observation, non-empty text
          (the row's prompt with any instruction the environment adds). Text, not chat messages:
          the run's chat template frames it.

        Raises:
          ValueError: a row without a field the environment reads.
        """
        raise NotImplementedError

    def step(self, state: Any, assistant_text: str) -> StepResult:
        """Answer the policy's turn `assistant_text` (decoded, its stop string included) in the
        episode `state`."""
        raise NotImplementedError


def register_environment(name: str, *, override: bool = False):
    """Decorator registering a factory `(**kwargs) -> Environment` under `name`. Registering the
    same factory again is a no-op.

    Raises:
      ValueError: empty name, or `name` taken by another factory and not `override`.
    """
    return ENVIRONMENTS.register(name, override=override)


def get_environment(name: str, **kwargs) -> Environment:
    """Build the registered environment `name`, its factory called with `kwargs`.

    Raises:
      ValueError: naming the environment: an unknown name (`"unknown environment 'x'; known:
        calculator, ..."`); keyword arguments the factory does not take; a factory that raised
        (`"environment 'x': its factory raised RuntimeError: ..."`, or its own ValueError as is
        when that names the environment); or a factory that returns no environment (no callable
        `reset` / `step`).
    """
    factory = ENVIRONMENTS.get(name)
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"environment kwargs {kwargs!r} do not fit environment {name!r}: "
                         f"{e}") from None
    try:
        env = factory(**kwargs)
    except Exception as e:  # noqa: BLE001 - a fork's factory failing is named, not a traceback
        named = isinstance(e, ValueError) and str(e).startswith(f"environment {name!r}")
        raise ValueError(str(e) if named else f"environment {name!r}: its factory raised "
                                              f"{type(e).__name__}: {e}") from None
    if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        raise ValueError(f"environment {name!r}: its factory returned {type(env).__name__}, "
                         "not an environment (an object with reset(row) and step(state, text))")
    return env


def build_environment(name: str, kwargs: dict, *, timeout_s: Optional[float]) -> Environment:
    """`get_environment(name, **kwargs)` within a set-up limit: the longer of `timeout_s` (a
    step's limit) and `FACTORY_TIMEOUT_S`, since a sandbox may take longer to start than to
    answer. In the main thread the factory is interrupted at the limit.

    Raises:
      ValueError: as `get_environment`, or the factory ran past the limit, naming it.
    """
    limit = max(timeout_s or 0.0, FACTORY_TIMEOUT_S)
    try:
        return call_with_deadline(lambda: get_environment(name, **kwargs), limit)
    except Expired:
        raise ValueError(f"environment {name!r}: its factory did not return within {limit:g} s "
                         f"(the set-up limit: the longer of env.timeout_s and "
                         f"{FACTORY_TIMEOUT_S:g} s)") from None


def environment_names() -> tuple[str, ...]:
    """The registered environment names, sorted."""
    return ENVIRONMENTS.names()


def _env_name(env) -> str:
    return str(getattr(env, "name", None) or type(env).__name__)


def _timed_calls(calls: Sequence[tuple[Callable, tuple]], timeout_s: Optional[float],
                 concurrency: Optional[int] = None) -> list[Call]:
    """Each `fn(*args)` of `calls` in a `CallPool` of `concurrency` places (None: all at
    once), each call under `timeout_s` from its own start; returns when every call has
    finished or expired. With every call started at once, B calls that all hang cost one
    `timeout_s`. An expired call's thread is left to finish (a daemon), its result dropped."""
    pool = CallPool(concurrency or max(len(calls), 1), timeout_s)
    handles = [pool.submit(fn, *args) for fn, args in calls]
    pool.wait(handles, every=True)
    return handles


def _check_timeout(timeout_s: Optional[float]) -> None:
    if timeout_s is not None and not (isinstance(timeout_s, numbers.Real) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got "
                         f"{timeout_s!r}")


def call_outcome(call: Call, name: str, what: str, timeout_s) -> Union[Any, EpisodeFailure]:
    """A finished pool call's value, or the EpisodeFailure of its exception, of its expiry
    (`"environment 'x': step took longer than 10 s"`) or of its refusal (too many hung calls,
    `pool.CallPool`)."""
    if call.status == EXPIRED or not call.finished:
        return EpisodeFailure(name, f"environment {name!r}: {what} took longer than "
                                    f"{timeout_s:g} s")
    if call.status == REFUSED:
        return EpisodeFailure(name, f"environment {name!r}: {what} not started: calls past "
                                    f"their timeout are still running (at the cap of "
                                    f"{HUNG_PER_PLACE} per place of env.concurrency)")
    if call.error is not None:
        return EpisodeFailure(name, f"environment {name!r}: {what} raised "
                                    f"{type(call.error).__name__}: {call.error}")
    return call.value


def step_problem(result: Any) -> Optional[str]:
    """What is wrong with an environment's `step` return, or None for a well-formed `StepResult`:
    a str observation unless done, a bool done, a dict of real rewards under non-empty str names,
    a dict info of numbers, every number finite in float32."""
    if not isinstance(result, StepResult):
        return f"step returned {type(result).__name__}, not a StepResult"
    if not isinstance(result.done, bool):
        return f"step returned done={result.done!r}, not a bool"
    if not result.done and not isinstance(result.observation, str):
        return (f"step returned done=False with observation {type(result.observation).__name__}"
                ", not a str (the next turn needs text)")
    if result.done and result.observation is not None and not isinstance(result.observation, str):
        return f"step returned observation {type(result.observation).__name__}, not a str or None"
    if not isinstance(result.rewards, dict):
        return f"step returned rewards {type(result.rewards).__name__}, not a dict"
    for key, value in result.rewards.items():
        if not isinstance(key, str) or not key:
            return f"step returned a reward named {key!r}, not a non-empty str"
        if isinstance(value, bool) or not _float32(value):
            return f"step returned reward {key!r}={value!r:.40}, not a finite float32 number"
    if not isinstance(result.info, dict):
        return f"step returned info {type(result.info).__name__}, not a dict"
    for key, value in result.info.items():  # summed over the episode: counts, numbers
        if not _float32(value):
            return (f"step returned info {key!r}={value!r:.40}, not a finite float32 number "
                    "(a count)")
    return None


def _float32(value: Any) -> bool:
    """`value` is a real number that float32 holds finite (|value| <= `FLOAT32_MAX`)."""
    try:
        return isinstance(value, numbers.Real) and abs(float(value)) <= FLOAT32_MAX
    except OverflowError:  # an int beyond float64
        return False


def run_step(env: Environment, state: Any, text: str, *, timeout_s: Optional[float]
             ) -> Union[StepResult, EpisodeFailure]:
    """`env.step(state, text)` in a worker thread within `timeout_s` seconds (None: no limit),
    its return checked.

    Returns:
      The `StepResult` (rewards as Python floats), or an `EpisodeFailure(env_name, error)` when
      the step raised, ran past `timeout_s` (its thread is left to finish, its result dropped), or
      returned something malformed.

    Raises:
      ValueError: `timeout_s` not positive.
    """
    return run_steps(env, [state], [text], timeout_s=timeout_s)[0]


def run_steps(env: Environment, states: Sequence[Any], texts: Sequence[str], *,
              timeout_s: Optional[float], concurrency: Optional[int] = None
              ) -> list[Union[StepResult, EpisodeFailure]]:
    """`run_step` for a batch of episodes at once: `env.step(states[i], texts[i])` for every i in
    parallel threads sharing the environment object, at most `concurrency` at once (None: all),
    each under `timeout_s` from its own start, so B hanging steps started together cost one
    `timeout_s`. Returns `[B]` results in the order of `states`.

    Raises:
      ValueError: `timeout_s` not positive, or `states` and `texts` of different lengths.
    """
    _check_timeout(timeout_s)
    if len(states) != len(texts):
        raise ValueError(f"run_steps: {len(states)} states but {len(texts)} texts")
    name = _env_name(env)
    calls = _timed_calls([(env.step, (s, t)) for s, t in zip(states, texts)], timeout_s,
                         concurrency)
    return [checked_step(call_outcome(c, name, "step", timeout_s), name) for c in calls]


def checked_step(out: Any, name: str) -> Union[StepResult, EpisodeFailure]:
    """A step's outcome (`call_outcome`) checked: an `EpisodeFailure` as it is, a malformed
    return (`step_problem`) as one naming the problem, a `StepResult` with float rewards."""
    if isinstance(out, EpisodeFailure):
        return out
    problem = step_problem(out)
    if problem is not None:
        return EpisodeFailure(name, f"environment {name!r}: {problem}")
    return replace(out, rewards={k: float(v) for k, v in out.rewards.items()})


def reset_problem(out: Any) -> Optional[str]:
    """What is wrong with an environment's `reset` return, or None for a pair `(state, prompt)`
    whose prompt is non-empty text. Chat messages are refused: the run's chat template frames the
    prompt."""
    if not (isinstance(out, tuple) and len(out) == 2):
        return f"reset returned {out!r:.80}, not (state, prompt text)"
    prompt = out[1]
    if isinstance(prompt, list):
        return ("reset returned a list as its prompt (chat messages?); reset returns the prompt "
                "as text, which the run's chat template frames (data.use_chat_template)")
    if not isinstance(prompt, str):
        return f"reset returned a prompt of type {type(prompt).__name__}, not text"
    if not prompt.strip():
        return f"reset returned an empty prompt ({prompt!r})"
    return None


def run_reset(env: Environment, row: dict, *, timeout_s: Optional[float]
              ) -> Union[tuple[Any, str], EpisodeFailure]:
    """`env.reset(row)` with `run_step`'s fault handling: `(state, prompt)`, or an
    `EpisodeFailure` when it raised, ran past `timeout_s`, or returned something `reset_problem`
    refuses.

    Raises:
      ValueError: `timeout_s` not positive.
    """
    return run_resets(env, [row], timeout_s=timeout_s)[0]


def run_resets(env: Environment, rows: Sequence[dict], *, timeout_s: Optional[float],
               concurrency: Optional[int] = None) -> list[Union[tuple[Any, str], EpisodeFailure]]:
    """`run_reset` for a batch of rows at once, in parallel threads as `run_steps`. Returns `[B]`
    results in the order of `rows`.

    Raises:
      ValueError: `timeout_s` not positive.
    """
    _check_timeout(timeout_s)
    name = _env_name(env)
    calls = _timed_calls([(env.reset, (row,)) for row in rows], timeout_s, concurrency)
    return [checked_reset(call_outcome(c, name, "reset", timeout_s), name) for c in calls]


def checked_reset(out: Any, name: str) -> Union[tuple[Any, str], EpisodeFailure]:
    """A reset's outcome (`call_outcome`) checked: an `EpisodeFailure` as it is, a return that
    `reset_problem` refuses as one naming the problem, else `(state, prompt)`."""
    if isinstance(out, EpisodeFailure):
        return out
    problem = reset_problem(out)
    return out if problem is None else EpisodeFailure(name, f"environment {name!r}: {problem}")


def truncate_observation(text: str, max_chars: int) -> str:
    """`text` cut to at most `max_chars` characters, ending with `TRUNCATION_MARKER` when cut so
    that the policy sees something is missing. The rollout driver cuts again by tokens.

    Raises:
      ValueError: `max_chars` shorter than the marker.
    """
    if max_chars < len(TRUNCATION_MARKER):
        raise ValueError(f"max_chars={max_chars} is shorter than the truncation marker "
                         f"{TRUNCATION_MARKER!r} ({len(TRUNCATION_MARKER)} characters)")
    if len(text) <= max_chars:
        return text
    return text[:max_chars - len(TRUNCATION_MARKER)] + TRUNCATION_MARKER


def truncate_tokens(ids: Sequence[int], max_tokens: int, marker_ids: Sequence[int] = ()
                    ) -> list[int]:
    """The token ids `ids` cut to at most `max_tokens`; when cut, the last `len(marker_ids)` of
    them are `marker_ids`, the tokenised `TRUNCATION_MARKER` or nothing.

    Raises:
      ValueError: `max_tokens` negative or shorter than `marker_ids`.
    """
    if max_tokens < len(marker_ids) or max_tokens < 0:
        raise ValueError(f"max_tokens={max_tokens} leaves no room for {len(marker_ids)} marker "
                         "tokens")
    ids = list(ids)
    if len(ids) <= max_tokens:
        return ids
    return ids[:max_tokens - len(marker_ids)] + list(marker_ids)


def episode_prompts(env: Environment, texts: list[str], rows: Optional[list[dict]], key: str,
                    *, timeout_s: Optional[float], concurrency: Optional[int] = None
                    ) -> tuple[list[str], list[dict]]:
    """The first observation of each prompt record's episode, called when the prompts load.

    Returns `(prompts, rows)`: prompt i is the text of `env.reset({**rows[i], "prompt":
    texts[i]})`, the record's prompt with the environment's instruction; row i keeps the record's
    own prompt under `prompt`, so that a later `reset(row)` starts the same episode.

    Resets run in chunks of `LOAD_CHUNK` records (at most `concurrency`, `env.concurrency`),
    all of a chunk at once, each under `timeout_s`, and the first chunk holding a failure stops
    the load, so a `reset` that hangs on every record costs one `timeout_s`, not one per record.

    Raises:
      ValueError: naming `key`, the record (from 0) and the environment, for the first record
        whose `reset` raised, ran past `timeout_s`, or returned no `(state, prompt)` pair with a
        non-empty text prompt.
    """
    given = rows or [{}] * len(texts)
    rows = [{**(given[i] or {}), "prompt": text} for i, text in enumerate(texts)]
    prompts, chunk = [], min(LOAD_CHUNK, concurrency or LOAD_CHUNK)
    for start in range(0, len(rows), chunk):
        outs = run_resets(env, rows[start:start + chunk], timeout_s=timeout_s)
        for i, out in enumerate(outs, start):
            if isinstance(out, EpisodeFailure):
                raise ValueError(f"{key}: record {i}: {out.error}")
            prompts.append(out[1])
    return prompts, rows
