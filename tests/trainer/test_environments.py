"""The environment interface (issue 38): the registry, the fault wall (`run_step` /
`run_reset` turn an exception, a timeout or a malformed return into an `EpisodeFailure`, never
an exception), observation truncation, and `scripts/play_environment.py` with a fork's
environment loaded by `--import` (examples/my_environment.py)."""

from __future__ import annotations

import importlib.util
import math
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ppo_jax.trainer.environments import (
    ENVIRONMENTS, TRUNCATION_MARKER, Environment, EpisodeFailure, StepResult, environment_names,
    get_environment, register_environment, run_reset, run_step, truncate_observation,
    truncate_tokens,
)

ROOT = Path(__file__).resolve().parents[2]


class Scripted(Environment):
    """A test environment whose `step` does what the test tells it (`behaviour(state, text)`)."""

    name = "scripted"

    def __init__(self, behaviour=None):
        self.behaviour = behaviour

    def reset(self, row):
        return 0, row["prompt"]

    def step(self, state, assistant_text):
        return self.behaviour(state, assistant_text)


@pytest.fixture
def registered():
    """"test_scripted" registered for one test, removed after."""
    @register_environment("test_scripted")
    def factory(echo: str = "ok"):
        return Scripted(lambda state, text: StepResult(f"{echo}: {text}", False, {}, state + 1))

    yield factory
    ENVIRONMENTS.unregister("test_scripted")


# --- registry ------------------------------------------------------------------------------
def test_built_in_environments_are_registered():
    assert {"calculator", "reasoning_gym_retry"} <= set(environment_names())


def test_a_registered_environment_is_found_by_name_with_its_kwargs(registered):
    assert "test_scripted" in environment_names()
    env = get_environment("test_scripted", echo="seen")
    state, prompt = env.reset({"prompt": "hi"})
    assert (state, prompt) == (0, "hi")
    assert run_step(env, state, "x", timeout_s=5) == StepResult("seen: x", False, {}, 1, {})


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError) as e:
        get_environment("no_such_env")
    assert str(e.value) == ("unknown environment 'no_such_env'; known: "
                            + ", ".join(environment_names()))
    assert "calculator, reasoning_gym_retry" in str(e.value)


def test_kwargs_the_factory_does_not_take_are_named(registered):
    with pytest.raises(ValueError, match=r"environment kwargs \{'colour': 1\} do not fit "
                                         r"environment 'test_scripted'"):
        get_environment("test_scripted", colour=1)


def test_a_factory_returning_no_environment_is_refused():
    register_environment("test_not_an_env")(lambda: 42)
    try:
        with pytest.raises(ValueError, match="its factory returned int, not an environment"):
            get_environment("test_not_an_env")
    finally:
        ENVIRONMENTS.unregister("test_not_an_env")


@pytest.mark.parametrize("error, message", [
    (RuntimeError("cannot start the sandbox"),
     "environment 'test_failing': its factory raised RuntimeError: cannot start the sandbox"),
    (TypeError("level must be int, got 'abc'"),
     "environment 'test_failing': its factory raised TypeError: level must be int, got 'abc'"),
    (ValueError("level must be >= 0"),
     "environment 'test_failing': its factory raised ValueError: level must be >= 0"),
    (ValueError("environment 'test_failing': level=-1 must be >= 0"),  # named: kept as is
     "environment 'test_failing': level=-1 must be >= 0"),
])
def test_any_exception_of_a_factory_is_a_value_error_naming_the_environment(error, message):
    def factory():
        raise error

    register_environment("test_failing")(factory)
    try:
        with pytest.raises(ValueError) as e:
            get_environment("test_failing")
    finally:
        ENVIRONMENTS.unregister("test_failing")
    assert type(e.value) is ValueError and str(e.value) == message


def test_the_calculators_own_messages_are_not_prefixed_twice():
    with pytest.raises(ValueError) as e:
        get_environment("calculator", format="xml")
    assert str(e.value) == "environment 'calculator': format='xml'; known: calc, tool_call"


def test_another_factory_under_a_taken_name_needs_override(registered):
    with pytest.raises(ValueError, match="environment 'test_scripted' is already registered"):
        register_environment("test_scripted")(lambda: Scripted())
    register_environment("test_scripted")(registered)  # the same factory again: a no-op


# --- the fault wall ------------------------------------------------------------------------
def test_an_exception_in_step_fails_the_episode_not_the_run():
    def boom(state, text):
        raise ZeroDivisionError("the environment divided by zero")

    out = run_step(Scripted(boom), 0, "text", timeout_s=5)
    assert out == EpisodeFailure("scripted", "environment 'scripted': step raised "
                                             "ZeroDivisionError: the environment divided by zero")


def test_a_step_past_the_timeout_fails_the_episode_at_the_timeout():
    release = threading.Event()

    def slow(state, text):
        release.wait(10.0)
        return StepResult("late", False, {}, state)

    start = time.perf_counter()
    out = run_step(Scripted(slow), 0, "text", timeout_s=0.2)
    elapsed = time.perf_counter() - start
    release.set()  # let the stray thread finish; its result is dropped
    assert out == EpisodeFailure("scripted", "environment 'scripted': step took longer than "
                                             "0.2 s")
    assert 0.2 <= elapsed < 2.0


def test_an_environment_that_raises_a_timeout_itself_is_reported_as_raising():
    def own_timeout(state, text):
        raise TimeoutError("socket")

    out = run_step(Scripted(own_timeout), 0, "t", timeout_s=5)
    assert out.error == "environment 'scripted': step raised TimeoutError: socket"


@pytest.mark.parametrize("returned, problem", [
    (None, "step returned NoneType, not a StepResult"),
    ((None, True, {}), "step returned tuple, not a StepResult"),
    (StepResult("o", None, {}), "step returned done=None, not a bool"),
    (StepResult(None, False, {}), "step returned done=False with observation NoneType, not a "
                                  "str (the next turn needs text)"),
    (StepResult(3, True, {}), "step returned observation int, not a str or None"),
    (StepResult(None, True, [1.0]), "step returned rewards list, not a dict"),
    (StepResult(None, True, {"correct": math.nan}), "step returned reward 'correct'=nan, not "
                                                   "a finite float32 number"),
    (StepResult(None, True, {"correct": math.inf}), "step returned reward 'correct'=inf, not "
                                                   "a finite float32 number"),
    (StepResult(None, True, {"correct": "1"}), "step returned reward 'correct'='1', not a "
                                               "finite float32 number"),
    (StepResult(None, True, {"correct": True}), "step returned reward 'correct'=True, not a "
                                                "finite float32 number"),
    # finite in Python, inf once the trainer sums it in float32 (the loss would be blamed)
    (StepResult(None, True, {"correct": 1e300}), "step returned reward 'correct'=1e+300, not "
                                                 "a finite float32 number"),
    (StepResult(None, True, {"correct": -3.5e38}), "step returned reward 'correct'=-3.5e+38, "
                                                   "not a finite float32 number"),
    (StepResult(None, True, {"correct": 10 ** 400}), "step returned reward 'correct'="
                                                     f"{str(10 ** 400)[:40]}, not a finite "
                                                     "float32 number"),
    (StepResult(None, True, {"": 1.0}), "step returned a reward named '', not a non-empty str"),
    (StepResult(None, True, {}, info=None), "step returned info NoneType, not a dict"),
    (StepResult(None, True, {}, info={"calls": "one"}), "step returned info 'calls'='one', not "
                                                        "a finite float32 number (a count)"),
    (StepResult(None, True, {}, info={"calls": math.nan}), "step returned info 'calls'=nan, "
                                                           "not a finite float32 number (a "
                                                           "count)"),
    (StepResult(None, True, {}, info={"calls": 1e300}), "step returned info 'calls'=1e+300, "
                                                        "not a finite float32 number (a count)"),
])
def test_a_malformed_return_fails_the_episode_naming_the_problem(returned, problem):
    out = run_step(Scripted(lambda state, text: returned), 0, "t", timeout_s=5)
    assert out == EpisodeFailure("scripted", f"environment 'scripted': {problem}")


def test_numpy_rewards_come_back_as_python_floats():
    returned = StepResult(None, True, {"correct": np.float32(0.5), "bonus": 2,
                                       "edge": float(np.finfo(np.float32).max)})
    out = run_step(Scripted(lambda state, text: returned), 0, "t", timeout_s=None)
    assert out.rewards == {"correct": 0.5, "bonus": 2.0,
                           "edge": float(np.finfo(np.float32).max)}
    assert all(type(v) is float for v in out.rewards.values())


def test_run_reset_has_the_same_wall():
    class BadReset(Scripted):
        def reset(self, row):
            return row["missing"]

    assert run_reset(Scripted(), {"prompt": "p"}, timeout_s=5) == (0, "p")
    assert run_reset(BadReset(), {}, timeout_s=5) == EpisodeFailure(
        "scripted", "environment 'scripted': reset raised KeyError: 'missing'")
    odd = Scripted()
    odd.reset = lambda row: "just a prompt"
    assert run_reset(odd, {}, timeout_s=5).error.endswith(
        "reset returned 'just a prompt', not (state, prompt text)")
    odd.reset = lambda row: (0, 7)
    assert run_reset(odd, {}, timeout_s=5).error.endswith(
        "reset returned a prompt of type int, not text")


@pytest.mark.parametrize("timeout_s", [0, -1.0, "1"])
def test_a_bad_timeout_is_the_callers_error(timeout_s):
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
        run_step(Scripted(), 0, "t", timeout_s=timeout_s)


def test_an_object_without_a_name_is_named_by_its_class():
    class Anonymous:
        def step(self, state, text):
            raise RuntimeError("no")

    assert run_step(Anonymous(), 0, "t", timeout_s=5).env_name == "Anonymous"


# --- truncation ----------------------------------------------------------------------------
def test_truncate_observation_marks_the_cut_within_the_budget():
    assert TRUNCATION_MARKER == "...[truncated]"
    assert truncate_observation("short", 20) == "short"
    assert truncate_observation("x" * 20, 20) == "x" * 20
    cut = truncate_observation("abcdefghij" * 5, 20)
    assert cut == "abcdef...[truncated]" and len(cut) == 20
    with pytest.raises(ValueError, match="max_chars=5 is shorter than the truncation marker"):
        truncate_observation("anything", 5)


def test_truncate_tokens_keeps_the_budget_and_ends_with_the_marker():
    assert truncate_tokens([1, 2, 3], 5) == [1, 2, 3]
    assert truncate_tokens(range(10), 4) == [0, 1, 2, 3]
    assert truncate_tokens(range(10), 4, marker_ids=[99, 98]) == [0, 1, 99, 98]
    assert truncate_tokens([1, 2], 2, marker_ids=[99]) == [1, 2]  # not cut: no marker
    with pytest.raises(ValueError, match="max_tokens=1 leaves no room for 2 marker tokens"):
        truncate_tokens([1, 2, 3], 1, marker_ids=[9, 9])


# --- a fork's environment, played by the script --------------------------------------------
def _play():
    spec = importlib.util.spec_from_file_location("play_environment",
                                                  ROOT / "scripts/play_environment.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_play_environment_runs_a_forks_environment_loaded_by_import(capsys, monkeypatch):
    """docs/environments.md: `--import examples.my_environment --env guess_number`."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        rc = _play()(["--import", "examples.my_environment", "--env", "guess_number", "--row",
                      '{"prompt": "Guess my number (1-100).", "answer": 42}',
                      "--turn", "50", "--turn", "25", "--turn", "42"])
        out = capsys.readouterr().out
    finally:
        ENVIRONMENTS.unregister("guess_number")
        sys.modules.pop("examples.my_environment", None)
    assert rc == 0
    assert "observation: lower" in out and "observation: higher" in out
    assert out.rstrip().endswith("done: True; reward parts summed: {'guess_cost': -0.2, "
                                 "'correct': 1.0}")


def test_play_environment_exit_codes(capsys):
    main = _play()
    assert main(["--env", "no_such_env", "--row", "{}"]) == 2
    assert "unknown environment 'no_such_env'" in capsys.readouterr().err
    assert main(["--import", "no_such_module_xyz", "--env", "calculator", "--row", "{}"]) == 2
    assert main(["--env", "calculator", "--row", "[1]"]) == 2
    assert main(["--env", "calculator", "--row", '{"prompt": "q"}']) == 1  # no answer: reset fails
    assert "episode failed: environment 'calculator': reset raised ValueError" in (
        capsys.readouterr().out)
    assert main(["--env", "calculator", "--row", "{}", "--timeout", "-1"]) == 2
    assert "--timeout -1.0: must be a positive number of seconds" in capsys.readouterr().err


def test_any_exception_of_reset_at_load_is_an_error_naming_the_record():
    """`episode_prompts` (the prompts' load): a `reset` that raises, whatever it raises, is a
    ValueError naming the prompt key, the record and the exception, not a traceback."""
    from ppo_jax.trainer.environments import episode_prompts

    class Boom(Environment):
        name = "boom"

        def reset(self, row):
            if row["prompt"] == "bad":
                raise RuntimeError("sandbox down")
            return 0, row["prompt"]

        def step(self, state, text):
            return StepResult(None, True, {}, state)

    assert episode_prompts(Boom(), ["a"], None, "data.prompts", timeout_s=5) == (
        ["a"], [{"prompt": "a"}])
    with pytest.raises(ValueError, match=r"^data.prompts: record 1: environment 'boom': reset "
                                         r"raised RuntimeError: sandbox down$"):
        episode_prompts(Boom(), ["a", "bad"], None, "data.prompts", timeout_s=5)
