"""Issue 54, environments: user code that fails is contained and named. A `reset` that hangs,
raises, or gives an empty or chat-message prompt is refused when the prompts load (exit 2, the
key, record and environment named, nothing written), within one `env.timeout_s` whatever the
number of records; so is a factory that raises anything, on any of the builds at load, or
hangs past the set-up limit; a batch's environment calls wait for their timeouts at once, not
one after another; `env.max_failed_steps` steps in a row whose every episode failed stop the
run (`FailureStreak`; the run through train.py is in test_episodes_training.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ppo_jax.core import unregister
from ppo_jax.trainer.environments import (
    Environment, EpisodeFailure, StepResult, episode_prompts, get_environment, run_resets,
    run_steps,
)
from ppo_jax.trainer.environments import base
from ppo_jax.trainer.environments.base import LOAD_CHUNK
from ppo_jax.trainer.faults import UserCodeError
from ppo_jax.trainer.stages.ppo.episodes import Episode, EpisodeRunner, FailureStreak

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402

FAULTY = "tests.trainer.faulty_environments"


@pytest.fixture
def faulty():
    """tests/trainer/faulty_environments.py (train.py `--import`s it) for one test: afterwards
    its hanging resets are released and its environments unregistered, so no other test sees
    them in the registry."""
    yield
    module = sys.modules.pop(FAULTY, None)
    if module is not None:
        module.RELEASE.set()  # the test's hanging threads return
        for name in (*module.RESETS, *module.FACTORIES):
            unregister("environment", name)


def refused(tmp_path, capsys, env: str, *sets) -> tuple[str, float]:
    """train.py on configs/tiny.yaml with environment `env` of tests/trainer/faulty_environments
    (--import): exit 2, no output directory, one `error:` line; that line and the seconds."""
    out = tmp_path / "run"
    argv = ["--config", str(ROOT / "configs/tiny.yaml"), "--import", FAULTY,
            "--set", f"train.output_dir={out}",
            "--set", f"env.name={env}", "--set", "eval.every=0", "--set", "eval.at_start=false"]
    for s in sets:
        argv += ["--set", s]
    t0 = time.perf_counter()
    assert train.main(argv) == 2
    seconds = time.perf_counter() - t0
    assert not out.exists()
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    return errors[0], seconds


def test_a_reset_that_hangs_at_load_is_refused_after_one_timeout(tmp_path, capsys, faulty):
    """160 records whose `reset` never returns: one `env.timeout_s`, not 160 of them."""
    error, seconds = refused(tmp_path, capsys, "sleepy_reset", "env.timeout_s=1")
    assert error == ("error: data.prompts: record 0: environment 'sleepy_reset': reset took "
                     "longer than 1 s")
    assert seconds < 10


@pytest.mark.parametrize("env, problem", [
    ("empty_reset", "reset returned an empty prompt (' \\n')"),
    ("chat_reset", "reset returned a list as its prompt (chat messages?); reset returns the "
                   "prompt as text, which the run's chat template frames (data.use_chat_template)"),
    ("raising_reset", "reset raised ConnectionError: the sandbox is down"),
])
def test_a_faulty_reset_at_load_is_refused_naming_the_record(tmp_path, capsys, faulty, env,
                                                              problem):
    error, _ = refused(tmp_path, capsys, env)
    assert error == f"error: data.prompts: record 0: environment '{env}': {problem}"


@pytest.mark.parametrize("env, sets, problem", [
    ("raising_factory", (), "RuntimeError: cannot start the sandbox"),
    ("typed_factory", ("env.kwargs.level=abc",), "TypeError: level must be int, got 'abc'"),
])
def test_a_factory_that_raises_anything_is_refused_naming_the_environment(
        tmp_path, capsys, faulty, env, sets, problem):
    """Not only a ValueError: any exception of the factory is one line, exit 2."""
    error, _ = refused(tmp_path, capsys, env, *sets)
    assert error == f"error: env.name: environment '{env}': its factory raised {problem}"


@pytest.mark.parametrize("fail_on, where", [(2, "env.name: "), (3, ""), (4, "")])
def test_a_factory_failing_on_a_later_build_at_load_is_named(tmp_path, capsys, faulty,
                                                            fail_on, where):
    """The factory is built by the config check, the prompt-file check, the prompt set and the
    episode runner: whichever build fails, one line names the environment (exit 2)."""
    error, _ = refused(tmp_path, capsys, "flaky_factory", f"env.kwargs.fail_on={fail_on}")
    assert error == (f"error: {where}environment 'flaky_factory': its factory raised "
                     f"RuntimeError: factory refused on build {fail_on}")


def test_a_factory_that_hangs_is_stopped_at_the_set_up_limit(tmp_path, capsys, faulty,
                                                             monkeypatch):
    """The limit is the longer of env.timeout_s and FACTORY_TIMEOUT_S (60 s; 1 s here)."""
    monkeypatch.setattr(base, "FACTORY_TIMEOUT_S", 1.0)
    error, seconds = refused(tmp_path, capsys, "slow_factory", "env.timeout_s=0.5")
    assert error == ("error: env.name: environment 'slow_factory': its factory did not return "
                     "within 1 s (the set-up limit: the longer of env.timeout_s and 1 s)")
    assert seconds < 10


def test_a_non_numeric_calculator_setting_is_refused_naming_the_key_and_value(tmp_path, capsys,
                                                                            faulty):
    error, _ = refused(tmp_path, capsys, "calculator", "env.kwargs.tool_call_cost=abc")
    assert error == ("error: env.name: environment 'calculator': env.kwargs.tool_call_cost='abc' "
                     "is not a number")
    for kwargs, message in [({"rel_tol": "x"}, "env.kwargs.rel_tol='x' is not a number"),
                            ({"malformed_penalty": None}, "env.kwargs.malformed_penalty=None is "
                                                          "not a number"),
                            ({"max_digits": "40"}, "env.kwargs.max_digits='40' is not an int")]:
        with pytest.raises(ValueError) as e:
            get_environment("calculator", **kwargs)
        assert str(e.value) == f"environment 'calculator': {message}"


@pytest.mark.parametrize("failures, more", [(3, None), (4, "1 more episode failed this step"),
                                            (5, "2 more episodes failed this step")])
def test_the_failures_past_the_reported_ones_are_counted_in_words(capsys, failures, more):
    EpisodeRunner._report(SimpleNamespace(env_name="calc"), _episodes(*["boom"] * failures))
    lines = capsys.readouterr().err.splitlines()
    assert lines[:3] == ["env calc: episode failed (reward 0): boom"] * 3
    assert lines[3:] == ([f"env calc: {more}"] if more else [])


class Sleeper(Environment):
    """`reset` and `step` sleep `seconds` on the rows / states listed in `slow` (all: None)."""

    name = "sleeper"

    def __init__(self, seconds: float, slow=None):
        self.seconds, self.slow, self.calls = seconds, slow, []

    def _maybe_sleep(self, i):
        self.calls.append(i)
        if self.slow is None or i in self.slow:
            time.sleep(self.seconds)

    def reset(self, row):
        self._maybe_sleep(row["i"])
        return row["i"], f"prompt {row['i']}"

    def step(self, state, text):
        self._maybe_sleep(state)
        return StepResult(None, True, {"correct": float(state)}, state)


def test_a_batch_of_steps_waits_for_one_timeout_not_one_per_row():
    """8 rows whose steps all sleep past a 0.3 s timeout: about 0.3 s in all, not 8 x 0.3 s."""
    t0 = time.perf_counter()
    outs = run_steps(Sleeper(2.0), list(range(8)), ["t"] * 8, timeout_s=0.3)
    assert time.perf_counter() - t0 < 1.0
    assert outs == [EpisodeFailure("sleeper", "environment 'sleeper': step took longer than "
                                              "0.3 s")] * 8


def test_the_batch_keeps_the_rows_order_and_fails_only_the_slow_ones():
    outs = run_steps(Sleeper(2.0, slow={1, 3}), [0, 1, 2, 3], ["t"] * 4, timeout_s=0.3)
    assert [o.rewards["correct"] for o in (outs[0], outs[2])] == [0.0, 2.0]
    assert all(isinstance(outs[i], EpisodeFailure) for i in (1, 3))
    with pytest.raises(ValueError, match="run_steps: 2 states but 1 texts"):
        run_steps(Sleeper(0.0), [0, 1], ["t"], timeout_s=1)


def test_a_batch_of_resets_waits_for_one_timeout_not_one_per_row():
    t0 = time.perf_counter()
    outs = run_resets(Sleeper(2.0, slow={5}), [{"i": i} for i in range(8)], timeout_s=0.3)
    assert time.perf_counter() - t0 < 1.0
    assert outs[0] == (0, "prompt 0") and outs[7] == (7, "prompt 7")
    assert outs[5].error == "environment 'sleeper': reset took longer than 0.3 s"


def test_loading_stops_at_the_first_chunk_of_records_with_a_failure():
    """3 chunks of records whose resets all hang: the first chunk's timeout ends the load, and
    no later record's `reset` is called."""
    env = Sleeper(2.0)
    n = 3 * LOAD_CHUNK
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"^eval.prompts: record 0: environment 'sleeper': "
                                         r"reset took longer than 0.2 s$"):
        episode_prompts(env, [f"p{i}" for i in range(n)], [{"i": i} for i in range(n)],
                        "eval.prompts", timeout_s=0.2)
    assert time.perf_counter() - t0 < 1.5
    assert sorted(env.calls) == list(range(LOAD_CHUNK))


def test_loading_names_the_first_failing_record_of_its_chunk():
    env = Sleeper(0.0)
    env.reset = lambda row: (0, "" if row["i"] in (70, 90) else "ok")
    rows = [{"i": i} for i in range(100)]
    with pytest.raises(ValueError, match=r"^data.prompts: record 70: environment 'sleeper': "
                                         r"reset returned an empty prompt \(''\)$"):
        episode_prompts(env, ["p"] * 100, rows, "data.prompts", timeout_s=5)


def _episodes(*failures):
    return [Episode(failure=f) for f in failures]


def test_the_run_stops_at_max_failed_steps_steps_in_a_row_whose_every_episode_failed():
    streak = FailureStreak("calc", limit=2)
    checkpoint = lambda: 4  # noqa: E731
    streak.count(_episodes("first", "other"), 5, checkpoint)
    streak.count(_episodes(None, "x"), 6, checkpoint)  # one episode that did not fail: again
    streak.count(_episodes("again", "y"), 7, checkpoint)
    with pytest.raises(UserCodeError) as e:
        streak.count(_episodes("z", "z"), 8, checkpoint)
    assert str(e.value) == (
        "step 8: every episode of environment 'calc' failed for 2 steps in a row "
        "(env.max_failed_steps=2); stopped before its update (the last checkpoint, step 4, is "
        "kept). The first failure: again")


def test_a_streak_from_the_first_step_says_no_checkpoint_was_written():
    streak = FailureStreak("calc", limit=1)
    with pytest.raises(UserCodeError, match=r"\(no checkpoint was written yet\)"):
        streak.count(_episodes("boom"), 1, lambda: None)



@pytest.mark.parametrize("key, part, turn", [("tool_call_cost", "tool_cost", "<calc>1+1</calc>"),
                                              ("malformed_penalty", "malformed_penalty",
                                               "<calc></calc>")])
def test_a_negative_calculator_cost_is_refused_naming_the_key_and_value(key, part, turn):
    """A cost is paid as -cost: a negative one would reward every call (or malformed call)."""
    with pytest.raises(ValueError, match=rf"^environment 'calculator': env.kwargs.{key}=-0.05 "
                                         rf"must be >= 0: it is a cost"):
        get_environment("calculator", **{key: -0.05})
    env = get_environment("calculator", **{key: 0.05})
    state, _ = env.reset({"prompt": "q", "answer": "1"})
    assert env.step(state, turn).rewards[part] == -0.05
