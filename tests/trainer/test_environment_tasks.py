"""The built-in environments (issue 38) turn by turn: "calculator" (a call -> its result and
`tool_cost`; a malformed call -> "could not parse"; a final answer right / wrong), the final
answer's number (`final_number`), "reasoning_gym_retry" on a real chain_sum problem (feedback,
a second attempt, the discount), and the synthetic multiplication problems with a held-out
split that never meets the training one."""

from __future__ import annotations

import importlib.util
import json
from fractions import Fraction
from pathlib import Path

import pytest

from ppo_jax.trainer.data.arithmetic import multiplication_records, split_of
from ppo_jax.trainer.data.tasks import held_out_records
from ppo_jax.trainer.environments import StepResult, final_number, get_environment, run_step
from ppo_jax.trainer.environments.calculator_env import CalculatorState

ROOT = Path(__file__).resolve().parents[2]
ROW = {"prompt": "What is 47 * 382?", "answer": "17954"}
CHAIN = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)


def _info(call=0, bad=0, error=0, answered=0, first=None) -> dict:
    """A turn's info; `first` (the episode's first call: `used_tool`) defaults to `call`."""
    return {"tool_call": call, "used_tool": call if first is None else first, "malformed": bad,
            "tool_error": error, "answered": answered}


# --- final_number --------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("<answer>17954</answer>", 17954),
    ("The product is 17,954.", 17954),
    ("47 * 382 = 17954", 17954),  # the last number
    ("<answer>17954</answer> (I checked 47 and 382)", 17954),  # the tag wins over later text
    ("<answer>about 2.5 apples</answer>", Fraction(5, 2)),
    ("x = -12", -12),
    ("12-3", 3),  # a minus after a digit is an operator, not a sign
    ("(4)-3", 3),
    ("<answer>-0.5</answer>", Fraction(-1, 2)),
    ("1,234,567", 1234567),
    ("3,4", 4),  # not a thousands group: two numbers
    ("no number here", None),
    ("<answer>none</answer> but 7", None),  # a tag without a number: no answer
    ("", None),
])
def test_final_number_reads_the_tag_else_the_last_number(text, want):
    assert final_number(text) == want


# --- calculator ----------------------------------------------------------------------------
def test_reset_appends_the_tool_instruction_with_an_example_call():
    state, prompt = get_environment("calculator").reset(ROW)
    assert state == CalculatorState(Fraction(17954))
    assert prompt.startswith("What is 47 * 382?\nYou can use a calculator: write "
                             "<calc>12*34</calc> and stop")
    assert prompt.endswith("give the final answer as <answer>NUMBER</answer>.")
    _, hermes = get_environment("calculator", format="tool_call").reset(ROW)
    assert ('<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}'
            '</tool_call>') in hermes


def test_without_the_tool_the_first_turn_is_the_answer_whatever_it_holds():
    env = get_environment("calculator", tool=False)
    state, prompt = env.reset(ROW)
    assert prompt == "What is 47 * 382?\nGive the final answer as <answer>NUMBER</answer>."
    out = run_step(env, state, "<calc>47*382</calc> <answer>17954</answer>", timeout_s=5)
    assert out.done and out.rewards == {"correct": 1.0}
    assert run_step(env, state, "<calc>47*382</calc>", timeout_s=5).rewards == {"correct": 0.0}


def test_make_tool_demos_writes_the_environments_prompt_and_one_call(tmp_path):
    spec = importlib.util.spec_from_file_location("demos", ROOT / "scripts/make_tool_demos.py")
    demos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demos)
    config = tmp_path / "c.yaml"
    config.write_text("data: {prompts: task, task: {name: products, kwargs: {min_terms: 2, "
                      "max_terms: 2, min_digits: 2, max_digits: 3}, size: 40, seed: 0, "
                      "instruction: ''}}\nenv: {name: calculator}\n"
                      "eval: {prompts: task, task_seed: 1, num_prompts: 8}\n")
    assert demos.main(["--config", str(config), "--out", str(tmp_path), "--train", "4",
                       "--eval", "2"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    user, reply = rows[0]["messages"]
    a, b = (int(x) for x in reply["content"][len("<calc>"):-len("</calc>")].split("*"))
    assert f"{a} * {b}" in user["content"] and "<calc>12*34</calc>" in user["content"]
    state, _ = get_environment("calculator").reset({"prompt": "", "answer": str(a * b)})
    env = get_environment("calculator")
    assert run_step(env, state, reply["content"], timeout_s=5).observation == str(a * b)


def test_a_call_returns_its_result_and_costs_the_tool_cost():
    env = get_environment("calculator", tool_call_cost=0.05)
    state, _ = env.reset(ROW)
    out = run_step(env, state, "I will compute it. <calc>47 x 382</calc>", timeout_s=5)
    assert out == StepResult("17954", False, {"tool_cost": -0.05, "malformed_penalty": 0.0},
                             CalculatorState(Fraction(17954), calls=1), _info(call=1))
    hermes = ('<tool_call>{"name": "calculator", "arguments": {"expression": "47*382"}}'
              "</tool_call>")
    second = run_step(env, out.state, hermes, timeout_s=5)
    assert second.observation == "17954" and second.info == _info(call=1, first=0)


@pytest.mark.parametrize("text, observation", [
    ("<calc>47*</calc>", "calculator error: not an arithmetic expression (invalid syntax)"),
    ("<calc>1/0</calc>", "calculator error: division by zero"),
    ("<calc>__import__('os')</calc>", "calculator error: function calls are not allowed; only "
                                      "numbers, + - * / // % ** and parentheses"),
])
def test_a_refused_expression_is_an_observation_not_a_malformed_call(text, observation):
    env = get_environment("calculator", malformed_penalty=0.5)
    out = env.step(env.reset(ROW)[0], text)
    assert out.observation == observation and not out.done
    assert out.rewards == {"tool_cost": 0.0, "malformed_penalty": 0.0}
    assert out.info == _info(call=1, error=1)


@pytest.mark.parametrize("text, message", [
    ("<calc>47*382", "<calc> is never closed with </calc>"),
    ("<calc></calc>", "the expression in <calc></calc> is empty"),
    ("<tool_call>{'name': 'calculator'}</tool_call>", "bad JSON (Expecting property name "
     "enclosed in double quotes at character 1) in \"{'name': 'calculator'}\""),
    ('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>',
     "unknown tool 'search'; the only tool is calculator"),
    ('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
     "the calculator takes one argument, expression (a string), got ['expr']"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": 12}}</tool_call>',
     "the calculator takes one argument, expression (a string), got ['expression']"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": " "}}</tool_call>',
     "the expression is empty"),
])
def test_a_malformed_call_is_an_observation_with_its_penalty(text, message):
    env = get_environment("calculator", tool_call_cost=0.05, malformed_penalty=0.5)
    state, _ = env.reset(ROW)
    out = run_step(env, state, text, timeout_s=5)
    assert out == StepResult(f"could not parse the tool call: {message}", False,
                             {"tool_cost": -0.05, "malformed_penalty": -0.5},
                             CalculatorState(Fraction(17954), calls=1), _info(call=1, bad=1))


@pytest.mark.parametrize("text, correct, answered", [
    ("The answer is <answer>17954</answer>", 1.0, 1),
    ("So 47 * 382 = 17,954", 1.0, 1),
    ("<answer>17954.0</answer>", 1.0, 1),
    ("<answer>17955</answer>", 0.0, 1),
    ("I do not know", 0.0, 0),
])
def test_a_turn_without_a_call_is_the_final_answer(text, correct, answered):
    env = get_environment("calculator")
    state, _ = env.reset(ROW)
    assert run_step(env, state, text, timeout_s=5) == StepResult(
        None, True, {"correct": correct}, state, _info(answered=answered))


def test_rel_tol_allows_a_relative_error_and_answers_may_be_numbers():
    env = get_environment("calculator", rel_tol=0.01)
    state, _ = env.reset({"prompt": "What is 1/3?", "answer": 0.3333333333})
    assert env.step(state, "<answer>0.333</answer>").rewards == {"correct": 1.0}
    assert env.step(state, "<answer>0.3</answer>").rewards == {"correct": 0.0}


@pytest.mark.parametrize("kwargs, message", [
    ({"format": "xml"}, "format='xml'; known: calc, tool_call"),
    ({"tool_call_cost": float("nan")}, "tool_call_cost=nan is not finite"),
    ({"rel_tol": -0.1}, "rel_tol=-0.1 must be >= 0"),
    ({"max_chars": 0}, "max_chars, max_digits and max_exponent must be >= 1"),
])
def test_calculator_kwargs_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        get_environment("calculator", **kwargs)


def test_calculator_rows_need_a_prompt_and_a_numeric_answer():
    env = get_environment("calculator")
    with pytest.raises(ValueError, match=r"this row has no \['answer'\] \(it has \['prompt'\]\)"):
        env.reset({"prompt": "q"})
    with pytest.raises(ValueError, match="the row's answer 'seven' is not a number"):
        env.reset({"prompt": "q", "answer": "seven"})


# --- reasoning_gym_retry -------------------------------------------------------------------
@pytest.fixture(scope="module")
def chain_row():
    """A real chain_sum prompt record (`data/tasks.py`): 4 - 1 = 3 from seed 1."""
    (row,) = held_out_records("chain_sum", CHAIN, size=1, seed=1, instruction="Use <answer>.")
    assert row["answer"] == "3"
    return row


def test_a_right_first_answer_ends_the_episode(chain_row):
    env = get_environment("reasoning_gym_retry")
    state, prompt = env.reset(chain_row)
    assert prompt == chain_row["prompt"]
    out = run_step(env, state, "4 - 1 is <answer>3</answer>", timeout_s=10)
    assert (out.observation, out.done, out.rewards, out.info) == (
        None, True, {"correct": 1.0}, {"attempt": 1, "answered": 1})


def test_a_wrong_answer_gets_feedback_and_another_attempt(chain_row):
    env = get_environment("reasoning_gym_retry", max_attempts=3, retry_discount=0.5)
    state, _ = env.reset(chain_row)
    first = run_step(env, state, "<answer>5</answer>", timeout_s=10)
    assert first.observation == ("Your answer 5 is not correct. Try again; give the final "
                                 "answer in <answer></answer>.")
    assert (first.done, first.rewards, first.info) == (False, {}, {"attempt": 1, "answered": 1})
    second = run_step(env, first.state, "I think 3", timeout_s=10)  # untagged: no answer
    assert second.observation == ("You gave no answer in <answer></answer>. Try again; give "
                                  "the final answer in <answer></answer>.")
    third = run_step(env, second.state, "<answer>3</answer>", timeout_s=10)
    assert (third.done, third.rewards, third.info) == (True, {"correct": 0.25},
                                                       {"attempt": 3, "answered": 1})


def test_the_last_wrong_attempt_ends_with_correct_zero(chain_row):
    env = get_environment("reasoning_gym_retry")  # 2 attempts, no discount
    state, _ = env.reset(chain_row)
    first = env.step(state, "<answer>4</answer>")
    second = env.step(first.state, "<answer>2</answer>")
    assert (second.observation, second.done, second.rewards) == (None, True, {"correct": 0.0})
    right_late = env.step(first.state, "<answer>3</answer>")
    assert right_late.rewards == {"correct": 1.0}  # retry_discount 1.0: as good as at once


def test_retry_rows_and_kwargs_are_checked():
    with pytest.raises(ValueError, match=r"data.prompts: task\); this row has no \['task', "
                                         r"'entry'\]"):
        get_environment("reasoning_gym_retry").reset({"prompt": "q", "answer": "1"})
    with pytest.raises(ValueError, match="max_attempts=0 must be an int >= 1"):
        get_environment("reasoning_gym_retry", max_attempts=0)
    with pytest.raises(ValueError, match=r"retry_discount=1.5 must be in \[0, 1\]"):
        get_environment("reasoning_gym_retry", retry_discount=1.5)


# --- synthetic multiplication problems -----------------------------------------------------
def test_multiplication_records_are_distinct_right_and_of_the_asked_digits():
    records = multiplication_records(2000, digits=(2, 3), seed=0)
    assert len({r["prompt"] for r in records}) == 2000
    for r in records[:50]:
        a, b = (int(x) for x in r["prompt"].removeprefix("What is ").rstrip("?").split(" * "))
        assert 10 <= a <= 99 and 100 <= b <= 999 and r["answer"] == str(a * b)
    assert records[0] == multiplication_records(1, digits=(2, 3), seed=0)[0]  # seeded


def test_held_out_problems_are_never_in_train_whatever_the_seeds():
    train = multiplication_records(5000, digits=(2, 2), seed=0)
    held = multiplication_records(300, digits=(2, 2), seed=0, split="held_out")
    other = multiplication_records(300, digits=(2, 2), seed=7, split="held_out")

    def pairs(rs):
        return {frozenset(r["prompt"][8:-1].split(" * ")) for r in rs}  # a*b and b*a alike

    assert not pairs(train) & pairs(held) and not pairs(train) & pairs(other)
    assert split_of(12, 34) == split_of(34, 12)
    share = sum(split_of(a, b) == "held_out" for a in range(10, 100) for b in range(100, 1000))
    assert 0.09 < share / 81000 < 0.11  # about one in held_out_every=10


def test_multiplication_records_refuse_what_they_cannot_give():
    with pytest.raises(ValueError, match="only .* distinct held_out problems of 1 x 1 digits"):
        multiplication_records(50, digits=(1, 1), split="held_out", max_tries=5)
    with pytest.raises(ValueError, match="split='test'; known: train, held_out"):
        multiplication_records(1, split="test")
    assert multiplication_records(1, seed=3, instruction="Use <answer>.")[0]["prompt"].endswith(
        "?\nUse <answer>.")


def test_make_arithmetic_prompts_writes_disjoint_jsonl_files(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("make_arithmetic_prompts",
                                                  ROOT / "scripts/make_arithmetic_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = ["--out", str(tmp_path), "--train", "300", "--held-out", "40", "--digits", "2", "2"]
    assert module.main(args) == 0
    train, held = ([json.loads(line) for line in open(tmp_path / name)]
                   for name in ("train.jsonl", "held_out.jsonl"))
    assert len(train) == 300 and len(held) == 40
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert module.main(args) == 2 and "pass --overwrite" in capsys.readouterr().err
