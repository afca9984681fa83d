"""Issue 54, reward functions and losses: user code that fails is contained and named. A reward
function `--import`ed as a user would (a module in the working directory) that raises, hangs
past `reward.timeout_s`, or returns the wrong shape, non-numbers, no `score` or a NaN is refused
by its load-time probe (exit 2, the function named, nothing written, no model loaded); one that
fails mid-run stops the run in one `error:` line naming it and the step (exit 1, checkpoints
and metrics kept, the lock released); a fork's policy loss that returns NaN is named in the
non-finite stop. The watchdog behind `reward.timeout_s` (`rewards.deadline`) is pinned
directly."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ppo_jax.core import unregister
from ppo_jax.trainer.config import ConfigError, load_config
from ppo_jax.trainer.faults import UserCodeError
from ppo_jax.trainer.rewards.deadline import WATCHDOG_SIGNAL, Expired, call_with_deadline
from ppo_jax.trainer.rewards.calls import RewardFunctionError, call_reward_function
from ppo_jax.trainer.stages.ppo import load_checks, rewards

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402

PROMPTS = ROOT / "configs/prompts/reviews.jsonl"
EVAL_PROMPTS = ROOT / "configs/prompts/quotes_eval.jsonl"
MODULE = "user_rewards_54"  # the --import'ed module, written into the test's working directory
REWARDS = '''
import os
import time
import numpy as np
from ppo_jax.core import register_policy_loss
from ppo_jax.trainer.rewards.functions import register_reward_function


def _register(name, fn):
    register_reward_function(name)(lambda: fn)


def boom(prompts, responses):
    return 1 / 0


def hang(prompts, responses):
    time.sleep(1000)


_register("raises", boom)
_register("one_score", lambda prompts, responses: np.ones(1, np.float32))
_register("strings", lambda prompts, responses: ["good"] * len(responses))
_register("none", lambda prompts, responses: None)
_register("nan", lambda prompts, responses: np.full(len(responses), np.nan))
_register("no_score", lambda prompts, responses: {"accuracy": np.zeros(len(responses))})
_register("hangs", hang)


def after_step_1(prompts, responses):
    """Scores 0 until the run has saved step 1, then raises (the probe and step 1 pass)."""
    if os.path.isdir(os.path.join(os.environ["REWARD_54_RUN"], "checkpoints", "1")):
        raise ConnectionError("the grader service went away")
    return np.zeros(len(responses), np.float32)


_register("fails_after_step_1", after_step_1)


@register_reward_function("slow_factory")
def slow_factory():
    """Connects to a grader that never answers (30 s: the test fails, not hangs, without a
    limit on the factory)."""
    time.sleep(30)
    return boom


@register_reward_function("broken_factory")
def broken_factory():
    raise RuntimeError("no grader configured")


@register_policy_loss("nan_loss_54")
def nan_loss(batch, *, cliprange, **unused):
    return batch.logprobs * np.nan, {}
'''
LINE = {text.strip(): i + 1 for i, text in enumerate(REWARDS.splitlines())}  # where it raises
BOOM, GONE = LINE["return 1 / 0"], LINE['raise ConnectionError("the grader service went away")']
NAMES = ("raises", "one_score", "strings", "none", "nan", "no_score", "hangs",
         "fails_after_step_1", "slow_factory", "broken_factory")


@pytest.fixture
def user_module(tmp_path, monkeypatch, cache):
    """The user's module in the working directory (train.py `--import`s it from there, as it
    does a fork's); afterwards its registrations and the module are gone again."""
    (tmp_path / f"{MODULE}.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("REWARD_54_RUN", str(tmp_path / "run"))
    yield tmp_path / "run"
    sys.modules.pop(MODULE, None)
    for name in NAMES:
        unregister("reward function", name)
    unregister("policy loss", "nan_loss_54")


def run(out: Path, *sets: str) -> list[str]:
    """train.py --import MODULE on configs/tiny.yaml (export off) with `sets`; the argv."""
    argv = ["--config", str(ROOT / "configs/tiny.yaml"), "--import", MODULE,
            "--set", f"train.output_dir={out}", "--set", f"data.prompts={PROMPTS}",
            "--set", f"eval.prompts={EVAL_PROMPTS}", "--set", "train.progress=false",
            "--set", "train.export_hf=false"]
    for s in sets:
        argv += ["--set", s]
    return argv


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return errors[0]


SEE = 'docs/forks.md, "Reward functions"'
PROBE = ("error: reward.function='{}' failed its load-time probe (placeholder responses '' and "
         "'0' to the first records of data.prompts): it ")


@pytest.mark.parametrize("name, what", [
    ("raises", f"raised ZeroDivisionError: division by zero (user_rewards_54.py:"
               f"{BOOM}, in boom)"),
    ("one_score", "returned ndarray array([1.], dtype=float32) for 'score', of shape (1,) for 4 "
                  "responses; it must be [4], one number per response"),
    ("strings", "returned list ['good', 'good', 'good', 'good'] for 'score'; it must be 4 "
                "numbers, one per response"),
    ("none", "returned None for 'score'; it must be 4 numbers, one per response"),
    ("nan", "returned a non-finite 'score', nan, for row 0 of 4 (prompt 'Tell me briefly how "
            "you would feel about', response '') and 3 more"),
    ("no_score", "returned a dict without a 'score' entry (its keys: ['accuracy'])"),
    ("hangs", "did not return within reward.timeout_s=1 s"),
])
def test_a_reward_function_that_cannot_score_is_refused_at_load(user_module, capsys, name,
                                                                 what):
    """Exit 2 before any model loads, one line naming the function and what came back; no
    output directory. The hang costs one `reward.timeout_s`."""
    t0 = time.perf_counter()
    assert train.main(run(user_module, f"reward.function={name}", "reward.timeout_s=1")) == 2
    assert time.perf_counter() - t0 < 30
    assert one_error_line(capsys) == f'{PROBE.format(name)}{what}; {SEE}'
    assert not user_module.exists()


@pytest.mark.parametrize("name, what", [
    ("slow_factory", "its factory did not return within reward.timeout_s=1 s"),
    ("broken_factory", "its factory raised RuntimeError: no grader configured"),
])
def test_a_reward_factory_that_hangs_or_raises_is_refused_at_load(user_module, capsys, name,
                                                                   what):
    """The factory runs under reward.timeout_s too (a connection at set-up that never
    answers): exit 2 after one limit, one line, nothing written."""
    t0 = time.perf_counter()
    assert train.main(run(user_module, f"reward.function={name}", "reward.timeout_s=1")) == 2
    assert time.perf_counter() - t0 < 20
    assert one_error_line(capsys) == f"error: reward.function={name!r}: {what}"
    assert not user_module.exists()


def test_reward_timeout_must_be_positive(user_module, capsys):
    assert train.main(run(user_module, "reward.timeout_s=0")) == 2
    assert one_error_line(capsys) == ("error: reward.timeout_s=0.0 must be > 0 seconds (or null: "
                                      "no limit)")
    assert not user_module.exists()


def test_a_reward_function_that_fails_mid_run_stops_naming_it_and_the_step(user_module, capsys):
    """It passes the probe and step 1, then raises at step 2: exit 1, one line naming the
    function, the step and the checkpoint kept; checkpoint 1 and its metrics stay, and the run
    directory is free for `--resume`."""
    from ppo_jax.trainer.lifecycle.checkpoint import finished_steps
    from ppo_jax.trainer.lifecycle.run_dir import RunLock
    from ppo_jax.trainer.tracking.metrics import read_metrics

    out = user_module
    argv = run(out, "reward.function=fails_after_step_1", "train.steps=3", "train.save_every=1",
               "eval.every=0", "eval.at_start=false", "train.sample_every=0", "ppo.ppo_epochs=1")
    assert train.main(argv) == 1
    assert one_error_line(capsys) == (
        "error: reward.function='fails_after_step_1' failed at step 2: it raised "
        "ConnectionError: the grader service went away (user_rewards_54.py:"
        f"{GONE}, in "
        "after_step_1); stopped before saving (the last checkpoint, step 1, is kept)")
    assert finished_steps(out / "checkpoints") == [1]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1]
    RunLock(out).release()  # free: the failed run let go of the lock


def test_a_forks_policy_loss_that_returns_nan_is_named(user_module, capsys):
    assert train.main(run(user_module, "ppo.policy_loss=nan_loss_54", "train.steps=1",
                          "train.save_every=0", "eval.every=0", "eval.at_start=false",
                          "ppo.ppo_epochs=1")) == 1
    error = one_error_line(capsys)
    assert error.startswith("error: step 1: ") and "not finite" in error
    assert error.endswith("(no checkpoint was written yet). A fork's registered function is "
                          "in play, ppo.policy_loss='nan_loss_54' (user_rewards_54.nan_loss): "
                          "check what it returns first. Check learning rates, kl_coef and the "
                          "reward scale")


# --- without a run --------------------------------------------------------------------------
def test_the_probe_is_skipped_where_the_function_is_not_called(user_module):
    """A factory with `probe = False` (a function that cannot run at load), and a run with
    `env.name` (the environment scores), pass the load checks with a function that raises."""
    from ppo_jax.trainer.rewards.functions import register_reward_function

    __import__(MODULE)
    factory = lambda: lambda prompts, responses: 1 / 0  # noqa: E731
    factory.probe = False
    register_reward_function("no_probe_54")(factory)
    try:
        cfg = load_config(ROOT / "configs/tiny.yaml", [f"data.prompts={PROMPTS}",
                                                       f"eval.prompts={EVAL_PROMPTS}",
                                                       "reward.function=no_probe_54"])
        load_checks.check_prompt_files(cfg)
    finally:
        unregister("reward function", "no_probe_54")
    tools = load_config(ROOT / "configs/tools.yaml", ["reward.function=raises"])
    load_checks.check_prompt_files(tools)
    with pytest.raises(ConfigError, match="reward.function='raises' failed its load-time probe"):
        load_checks.check_prompt_files(load_config(ROOT / "configs/tiny.yaml", [
            f"data.prompts={PROMPTS}", f"eval.prompts={EVAL_PROMPTS}", "reward.function=raises"]))


def test_the_eval_prompts_are_probed_too(tmp_path):
    """The held-out evaluation scores with the same function: its prompts are probed as well,
    and the refusal names eval.prompts."""
    from ppo_jax.trainer.rewards.functions import register_reward_function

    def fn(prompts, responses):
        return [float("nan") if p.startswith("EVAL") else 0.0 for p in prompts]

    (tmp_path / "eval.jsonl").write_text('{"prompt": "EVAL: one"}\n{"prompt": "EVAL: two"}\n')
    register_reward_function("eval_nan_54")(lambda: fn)
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"data.prompts={PROMPTS}",
                                                   f"eval.prompts={tmp_path / 'eval.jsonl'}",
                                                   "reward.function=eval_nan_54"])
    try:
        with pytest.raises(ConfigError) as e:
            load_checks.check_prompt_files(cfg)
    finally:
        unregister("reward function", "eval_nan_54")
    assert str(e.value) == (
        "reward.function='eval_nan_54' failed its load-time probe (placeholder responses '' and "
        "'0' to the first records of eval.prompts): it returned a non-finite 'score', nan, for "
        "row 0 of 4 (prompt 'EVAL: one', response '') and 3 more; docs/forks.md, \"Reward "
        "functions\"")


class Saved:
    """A checkpointer whose latest step is `step`."""

    def __init__(self, step):
        self.step = step

    def latest_step(self):
        return self.step


@pytest.mark.parametrize("fn, what", [
    (lambda p, r: time.sleep(1000), "did not return within reward.timeout_s=0.2 s"),
    (lambda p, r: {"score": np.zeros(len(r)), "accuracy": [0, float("inf")]},
     "returned a non-finite 'accuracy', inf, for row 1 of 2 (prompt 'second prompt', response "
     "'b')"),
    (lambda p, r: [0.0], "returned list [0.0] for 'score', of shape (1,) for 2 responses; it "
                         "must be [2], one number per response"),
])
def test_a_failure_mid_run_is_a_user_code_error_with_the_step(fn, what):
    """`rewards.reward_faults` around a call, as `PPOTrainer.score_texts` makes it: a timeout, a
    non-finite component or the wrong shape at step 5 after checkpoint 4."""
    from ppo_jax.trainer.rewards.calls import with_timeout

    with pytest.raises(UserCodeError) as e:
        with rewards.reward_faults("mine", "step 5", Saved(4)):
            call_reward_function(with_timeout(fn, 0.2), ["first", "second prompt"], ["a", "b"])
    assert str(e.value) == (f"reward.function='mine' failed at step 5: it {what}; stopped "
                            "before saving (the last checkpoint, step 4, is kept)")


# --- the watchdog -----------------------------------------------------------------------------
def spin():
    while True:
        pass


def swallow():
    while True:
        try:
            time.sleep(1000)
        except Exception:  # noqa: BLE001 - user code that catches everything
            pass


@pytest.mark.parametrize("fn", [lambda: time.sleep(1000), spin, swallow,
                                lambda: threading.Event().wait()])
def test_the_watchdog_stops_a_call_in_the_main_thread(fn):
    """A sleep, a busy loop, a loop that catches Exception, a lock wait: each stopped after the
    limit, in the calling (main) thread, and the signal's handler is put back."""
    before = signal.getsignal(WATCHDOG_SIGNAL)
    t0 = time.perf_counter()
    with pytest.raises(Expired):
        call_with_deadline(fn, 0.2)
    assert time.perf_counter() - t0 < 5
    assert signal.getsignal(WATCHDOG_SIGNAL) is before
    assert call_with_deadline(lambda: 7, 0.2) == 7
    time.sleep(0.3)  # no late signal arrives after a call that returned in time


def test_the_watchdog_works_from_another_thread_and_passes_errors_on():
    got = []

    def worker():
        try:
            call_with_deadline(lambda: time.sleep(1000), 0.2)
        except Expired:
            got.append("expired")
        try:
            call_with_deadline(lambda: 1 / 0, 0.2)
        except ZeroDivisionError:
            got.append("raised")
        got.append(call_with_deadline(lambda: 3, 0.2))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(10)
    assert got == ["expired", "raised", 3]
    with pytest.raises(RewardFunctionError, match="raised KeyError: 'answer'"):
        call_reward_function(lambda p, r: {}["answer"], ["p"], ["r"])
