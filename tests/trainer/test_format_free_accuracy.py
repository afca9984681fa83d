"""Accuracy that the answer's format cannot inflate: the format-free extractor (the last number
of a response, tags or not) on hand-written responses, the verifiers applied to it, the
reward functions' `accuracy_format_free` part, and the plain-instruction pass's config (the
same held-out problems, no tag named, no response prefix; `eval.plain_instruction`)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from ppo_jax.trainer.config import ConfigError, load_config
from ppo_jax.trainer.data.prompts import plain_instruction_config, prompt_records
from ppo_jax.trainer.data.tasks import PLAIN_INSTRUCTION
from ppo_jax.trainer.environments import final_number
from ppo_jax.trainer.rewards import verifiers
from ppo_jax.trainer.rewards.functions import get_reward_function

CHAIN = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)
TASK_SETS = (["data.prompts=task", "eval.prompts=task", "data.task.name=chain_sum",
              "data.task.size=50", "eval.num_prompts=8", "data.response_prefix=<answer>"]
             + [f"data.task.kwargs.{k}={v}" for k, v in CHAIN.items()])


# --- the extractor ----------------------------------------------------------------------------
@pytest.mark.parametrize("response, want", [
    ("<answer>3</answer>", "3"),  # the tag: its number
    ("3", "3"),  # no tag
    ("The answer is 3.", "3"),  # a sentence's final period is not a decimal point
    ("<answer>4 - 1 = 3", "3"),  # an equation, tag never closed: the result, the last number
    ("4 - 1 = 3", "3"),
    ("first 2, then 7, finally 5", "5"),  # several numbers: the last
    ("<answer>3</answer> (checked: 4 - 1)", "1"),  # tags do not count: a number after wins
    ("three", None),  # words are not numbers
    ("<answer>three</answer>", None),
    ("", None),
    ("x = -12", "-12"),  # a negative number
    ("<answer>-5</answer>", "-5"),
    ("12-3", "3"),  # a minus after a digit is an operator
    ("(4)-3", "3"),
    ("1,234", "1234"),  # thousands separators dropped
    ("about 1,234,567.5 grains", "1234567.5"),
    ("3,4", "4"),  # not a thousands group: two numbers
    ("2.50", "2.50"),  # decimals kept as written
    ("3/4", "4"),  # a fraction is two numbers
])
def test_format_free_answer_is_the_last_number_tags_or_not(response, want):
    assert verifiers.format_free_answer(response) == want


def test_format_free_answer_names_a_non_string():
    with pytest.raises(TypeError, match="text must be a str, got int 7"):
        verifiers.format_free_answer(7)


@pytest.mark.parametrize("text, want", [
    ("<answer>3</answer> (checked: 4 - 1)", 3),  # final_number still reads the tag first
    ("4 - 1 = 3", 3), ("x = -1,234.5", Fraction(-12345, 10)), ("<answer>none</answer> 7", None),
])
def test_final_number_reads_numbers_with_the_same_rule(text, want):
    assert final_number(text) == want


# --- verifiers and reward parts ---------------------------------------------------------------
def _chain_row(expression: str, answer: str) -> dict:
    return {"task": "chain_sum", "entry": {"question": f"{expression} =", "answer": answer,
                                           "metadata": {"source_dataset": "chain_sum"}}}


@pytest.mark.parametrize("response, tagged, free", [
    ("<answer>3</answer>", 1.0, 1.0),
    ("<answer>4 - 1 = 3", 0.0, 1.0),  # right, but the tag is never closed
    ("3", 0.0, 1.0),  # right, no tag
    ("4 - 1 = 3 so the sum is 3", 0.0, 1.0),
    ("<answer>5</answer>", 0.0, 0.0),  # wrong either way
    ("three", 0.0, 0.0),
    ("<answer>3</answer> since 4 - 1", 1.0, 0.0),  # the tag is right, the last number is not
])
def test_task_score_on_the_last_number_ignores_the_format(response, tagged, free):
    row = _chain_row("4 - 1", "3")
    assert verifiers.task_score(response, row) == tagged
    assert verifiers.task_score(response, row, extract=verifiers.format_free_answer) == free


@pytest.mark.parametrize("response, gold, want", [
    ("<answer>4 - 1 = 3", "3", 1.0),
    ("the total is 1,234", "1234", 1.0),
    ("it drops to -5", "-5", 1.0),
    ("<answer>7</answer> and 9", "7", 0.0),  # the last number, not the tag
    ("seven", "7", 0.0),
])
def test_math_correct_on_the_last_number(response, gold, want):
    assert verifiers.math_correct(response, gold, extract=verifiers.format_free_answer) == want


def test_verifier_rewards_report_the_format_free_part_and_leave_the_score_alone():
    responses = ["<answer>3</answer>", "<answer>4 - 1 = 3", "3", "<answer>5</answer>"]
    out = get_reward_function("reasoning_gym", format_weight=0.5)(
        ["q"] * 4, responses, rows=[_chain_row("4 - 1", "3")] * 4)
    np.testing.assert_array_equal(out["accuracy"], [1, 0, 0, 0])
    np.testing.assert_array_equal(out["format"], [1, 0, 0, 1])
    np.testing.assert_array_equal(out["accuracy_format_free"], [1, 1, 1, 0])
    np.testing.assert_allclose(out["score"], [1.5, 0, 0, 0.5])  # accuracy + 0.5 format only
    mv = get_reward_function("math_verify")(["q"] * 4, responses, rows=[{"answer": "3"}] * 4)
    np.testing.assert_array_equal(mv["accuracy_format_free"], [1, 1, 1, 0])


# --- the plain-instruction pass ---------------------------------------------------------------
def test_plain_instruction_config_asks_the_same_problems_without_the_tag():
    cfg = load_config(None, TASK_SETS + [f"eval.plain_instruction={PLAIN_INSTRUCTION}"])
    plain = plain_instruction_config(cfg, PLAIN_INSTRUCTION)
    texts, rows = prompt_records(cfg, "task", "eval.prompts")
    plain_texts, plain_rows = prompt_records(plain, "task", "eval.prompts")
    assert [r["entry"] for r in plain_rows] == [r["entry"] for r in rows]  # the same problems
    assert plain_texts == [r["entry"]["question"] + "\n" + PLAIN_INSTRUCTION for r in rows]
    assert all("<answer>" in t for t in texts) and not any("answer>" in t for t in plain_texts)
    assert plain.data.response_prefix is None and cfg.data.response_prefix == "<answer>"
    assert plain.eval.plain_instruction is None  # the plain pass has no plain pass of its own
    with pytest.raises(ValueError, match="eval.prompts: task, not 'configs/prompts"):
        plain_instruction_config(load_config(None), PLAIN_INSTRUCTION)


@pytest.mark.parametrize("sets, match", [
    (TASK_SETS + ["eval.plain_instruction=Reply with <answer>n</answer>"], "never mentions"),
    (TASK_SETS + ["eval.plain_instruction=put it in </ANSWER"], "never mentions"),
    (TASK_SETS + ["eval.plain_instruction=' '"], "non-empty"),
    (["eval.plain_instruction=Give a number."], "needs eval.prompts: task"),
])
def test_a_plain_instruction_the_eval_cannot_use_is_refused_by_name(sets, match):
    with pytest.raises(ConfigError, match=f"eval.plain_instruction=.*{match}"):
        load_config(None, sets)


def test_the_plain_pass_is_among_the_programs_a_run_compiles(tmp_path, monkeypatch):
    """`--compile-for` lists the plain pass's sampler and forward beside the eval's, over
    prompts of the same width (abstract builds: data.max_prompt_length)."""
    from pathlib import Path

    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs/rlvr/tiny.yaml", [
        f"train.output_dir={tmp_path / 'run'}", f"eval.plain_instruction={PLAIN_INSTRUCTION}"])
    programs = {p.name: p for p in PPOTrainer.abstract(cfg).programs()}
    assert {"eval_sampler", "eval_forward", "eval_plain_sampler", "eval_plain_forward"} <= set(programs)
    assert programs["eval_plain_sampler"].args[1].shape == programs["eval_sampler"].args[1].shape
    assert programs["eval_plain_forward"].per_step == programs["eval_forward"].per_step
