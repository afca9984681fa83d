"""Issue 54, what a new user's break test found past the first fixes: a reward function that
calls `sys.exit` (0 would have ended a failed run with exit 0) or raises another BaseException,
one that edits its input lists (the check against its own output, the logged samples), one
whose finite float64 score overflows the trainer's float32, an `--import`ed module that fails
with something other than ImportError, and a non-finite stop naming the user's reward function
or environment among the functions in play."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from ppo_jax.core import unregister
from ppo_jax.trainer.config import load_config
from ppo_jax.trainer.environments import register_environment
from ppo_jax.trainer.lifecycle.preemption import StopSignals
from ppo_jax.trainer.rewards.calls import RewardFunctionError, call_reward_function
from ppo_jax.trainer.rewards.functions import register_reward_function
from ppo_jax.trainer.stages.ppo import rewards

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402

PROMPTS, RESPONSES = ["p0", "p1"], ["r0", "r1"]


class Custom(BaseException):
    pass


def raising(error):
    def fn(prompts, responses):
        raise error
    return fn


@pytest.mark.parametrize("error, named", [
    (SystemExit(0), "raised SystemExit: 0"),
    (SystemExit("bye"), "raised SystemExit: bye"),
    (Custom("deep"), "raised Custom: deep"),
])
def test_sys_exit_and_other_base_exceptions_are_reported_not_let_through(error, named):
    with pytest.raises(RewardFunctionError, match=named):
        call_reward_function(raising(error), PROMPTS, RESPONSES)


def test_ctrl_c_stops_a_probe_but_inside_training_a_keyboard_interrupt_is_the_functions():
    """Outside training (the load-time probe) Ctrl-C raises KeyboardInterrupt: it passes. In
    training the SIGINT handler is the trainer's (`preemption.StopSignals`), which never raises
    one, so a KeyboardInterrupt there is the function's own failure."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):
        call_reward_function(raising(KeyboardInterrupt()), PROMPTS, RESPONSES)
    with StopSignals():
        with pytest.raises(RewardFunctionError, match="raised KeyboardInterrupt"):
            call_reward_function(raising(KeyboardInterrupt()), PROMPTS, RESPONSES)


def test_a_function_that_empties_its_inputs_is_still_checked_against_the_batch():
    def clears(prompts, responses):
        prompts.clear()
        responses.clear()
        return np.zeros(0, np.float32)

    prompts, responses = list(PROMPTS), list(RESPONSES)
    with pytest.raises(RewardFunctionError, match=r"of shape \(0,\) for 2 responses"):
        call_reward_function(clears, prompts, responses)
    assert (prompts, responses) == (PROMPTS, RESPONSES)


def test_a_function_that_overwrites_its_inputs_changes_nothing_of_the_callers():
    def overwrites(prompts, responses, *, rows):
        prompts[0], responses[0], rows[0]["answer"] = "Y", "X", "changed"
        return np.ones(len(responses), np.float32)

    prompts, responses, rows = list(PROMPTS), list(RESPONSES), [{"answer": "1"}, {}]
    scores, _ = call_reward_function(overwrites, prompts, responses, rows)
    np.testing.assert_array_equal(scores, [1.0, 1.0])
    assert (prompts, responses, rows) == (PROMPTS, RESPONSES, [{"answer": "1"}, {}])


def test_a_finite_score_beyond_float32_is_named_as_such_not_as_inf(recwarn):
    def huge(prompts, responses):
        return np.array([0.0, 1e39])

    with pytest.raises(RewardFunctionError) as err:
        call_reward_function(huge, PROMPTS, RESPONSES)
    assert str(err.value) == ("returned 1e+39 for 'score' in row 1, beyond float32's range "
                              "(+-3.4e38)")
    assert not [w for w in recwarn if "overflow" in str(w.message)]


IMPORT_FAILURES = {
    "raises_at_import": ('raise RuntimeError("GRADER_URL not set")\n',
                         "error: --import raises_at_import: RuntimeError: GRADER_URL not set"),
    "bad_syntax": ("def f(:\n", "error: --import bad_syntax: SyntaxError: "),
    "taken_name": ("from ppo_jax.trainer.rewards.functions import register_reward_function\n"
                   "register_reward_function('vader')(lambda: None)\n",
                   "error: --import taken_name: ValueError: reward function 'vader' is already "
                   "registered"),
}


@pytest.mark.parametrize("module", sorted(IMPORT_FAILURES))
def test_an_import_that_fails_is_one_error_line_exit_2(module, tmp_path, monkeypatch, capsys):
    source, line = IMPORT_FAILURES[module]
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    try:
        assert train.main(["--config", str(ROOT / "configs/tiny.yaml"), "--import", module,
                           "--set", f"train.output_dir={tmp_path / 'run'}"]) == 2
    finally:
        sys.modules.pop(module, None)
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith(line), err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.fixture
def user_code():
    register_reward_function("huge_54")(lambda: (lambda prompts, responses: [1e30] * 2))
    register_environment("user_env_54")(lambda: None)
    yield
    unregister("reward function", "huge_54")
    unregister("environment", "user_env_54")


def test_a_non_finite_stop_names_the_users_reward_function_or_environment(user_code):
    base = [f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}"]
    cfg = load_config(ROOT / "configs/tiny.yaml", base + ["reward.function=huge_54"])
    assert rewards.forks_in_play(cfg) == [
        f"reward.function='huge_54' ({__name__}.user_code.<locals>.<lambda>)"]
    assert "reward.function='huge_54'" in rewards.finite_hint(cfg, "Check the reward scale")
    cfg = load_config(ROOT / "configs/tiny.yaml", base + ["env.name=user_env_54"])
    assert [f.split(" ")[0] for f in rewards.forks_in_play(cfg)] == ["env.name='user_env_54'"]
    builtin = load_config(ROOT / "configs/tiny.yaml", base)  # vader: nothing of the user's
    assert rewards.forks_in_play(builtin) == []
    assert rewards.finite_hint(builtin, "Check the reward scale") == "Check the reward scale"
