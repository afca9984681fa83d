"""Verifiable rewards (issue 25): answer extraction, the reasoning-gym and math-verify verifiers
on hand-written responses, reward functions that read each prompt's row, reasoning-gym tasks
as prompt sets with a disjoint held-out split, and the held-out accuracy / pass@k figures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ppo_jax.trainer.rewards import verifiers
from ppo_jax.trainer.config import ConfigError, load_config
from ppo_jax.trainer.data.prompts import prompt_records
from ppo_jax.trainer.rewards.calls import (
    call_reward_function, reward_output, score_texts, takes_rows, with_timeout,
)
from ppo_jax.trainer.rewards.functions import get_reward_function, register_reward_function
from ppo_jax.trainer.data.tasks import disjoint, held_out_records, task_splits

ROOT = Path(__file__).resolve().parents[2]
CHAIN = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)


# --- answer extraction ----------------------------------------------------------------------
@pytest.mark.parametrize("response, want", [
    ("<answer>7</answer>", "7"),
    ("<answer> 7 </answer>", "7"),
    ("I think <answer>3</answer>, no: <answer>-5</answer>.", "-5"),  # the last pair wins
    ("<answer>7", None),  # never closed
    ("the answer is 7", None),
    ("<answer>\\frac{1}{2}</answer>", "\\frac{1}{2}"),
    ("<answer>two\nlines</answer>", "two\nlines"),
])
def test_tagged_answer_is_the_last_closed_pair_like_reasoning_gym(response, want):
    from reasoning_gym.utils import extract_answer

    assert verifiers.tagged_answer(response) == want
    assert extract_answer(response) == want


def _chain_entry(expression: str, answer: str) -> dict:
    return {"task": "chain_sum", "entry": {"question": f"{expression} =", "answer": answer,
                                           "metadata": {"source_dataset": "chain_sum"}}}


@pytest.mark.parametrize("response, want", [
    ("<answer>-5</answer>", 1.0),
    ("<answer>5</answer>", 0.0),  # wrong
    ("-5", 0.0),  # missing tag: no answer given
    ("<answer>3</answer> or <answer>-5</answer>", 1.0),  # several: the last
    ("<answer>-5.0</answer>", 1.0),  # chain_sum compares numbers, not strings
])
def test_task_score_is_the_tasks_own_scorer_on_the_tagged_answer(response, want):
    assert verifiers.task_score(response, _chain_entry("2 - 7", "-5")) == want


def test_task_score_names_rows_without_a_task():
    with pytest.raises(ValueError, match="data.prompts: task"):
        verifiers.task_score("<answer>1</answer>", {"answer": "1"})


@pytest.mark.parametrize("response, gold, want", [
    ("<answer>7</answer>", "7", 1.0),
    ("<answer>8</answer>", "7", 0.0),
    ("The answer is 7.", "7", 1.0),  # no tag: the whole response
    ("first 3, then 9", "7", 0.0),  # several numbers: math-verify reads the last
    ("first 3, then 7", "7", 1.0),
    ("$\\boxed{\\frac{1}{2}}$", "0.5", 1.0),  # LaTeX against a plain number
    ("<answer>\\frac{2}{4}</answer>", "\\frac{1}{2}", 1.0),
    ("<answer>seven</answer>", "7", 0.0),
    ("no answer at all", "7", 0.0),
    # an unclosed tag is no tag: math-verify reads the whole response, where its own cue, the
    # word "answer", picks what follows it (docs/rlvr.md); without a cue, the last expression
    ("<answer>4 - 1 = 3", "3", 1.0),
    ("<answer> 7 since 2 + 4", "7", 1.0),
    ("7 since 2 + 4", "7", 0.0),  # no cue: the last expression, 2 + 4
    ("<answer>7</answer> and 9", "7", 1.0),  # a closed tag wins over later numbers
])
def test_math_correct_on_hand_written_responses(response, gold, want):
    assert verifiers.math_correct(response, gold) == want


def test_math_correct_needs_an_answer_field():
    with pytest.raises(ValueError, match="answer"):
        verifiers.math_correct("<answer>1</answer>", None)


# --- reward functions with rows ---------------------------------------------------------------
def test_verifier_rewards_add_the_weighted_format_reward_and_report_components():
    rows = [_chain_entry("2 - 7", "-5")] * 3
    out = get_reward_function("reasoning_gym", format_weight=0.25)(
        ["q"] * 3, ["<answer>-5</answer>", "<answer>4</answer>", "-5"], rows=rows)
    np.testing.assert_allclose(out["score"], [1.25, 0.25, 0.0])
    np.testing.assert_array_equal(out["accuracy"], [1, 0, 0])
    np.testing.assert_array_equal(out["format"], [1, 1, 0])
    mv = get_reward_function("math_verify")(["q"] * 2, ["<answer>3</answer>", "3"],
                                            rows=[{"answer": "3"}] * 2)
    np.testing.assert_allclose(mv["score"], [1.0, 1.0])  # weight 0: format only logged
    np.testing.assert_array_equal(mv["format"], [1, 0])


def test_chain_sum_partial_credit_is_off_unless_asked_and_never_counts_as_accuracy():
    # chain_sum's scorer gives len(right) / len(given) to a wrong answer that contains the
    # right one (reasoning-gym's compute_decimal_reward): on 2 + 1 = 3, "31" earns 1/2 and
    # "3333" 1/4. The reward counts only full credit unless partial_credit is on.
    rows = [_chain_entry("2 + 1", "3")] * 4
    responses = ["<answer>3</answer>", "<answer>31</answer>", "<answer>3333</answer> or 3",
                 "<answer>12</answer>"]
    assert [verifiers.task_score(r, rows[0]) for r in responses] == [1.0, 0.5, 0.25, 0.0]
    exact = get_reward_function("reasoning_gym", format_weight=0.1)(["q"] * 4, responses,
                                                                   rows=rows)
    np.testing.assert_allclose(exact["score"], [1.1, 0.1, 0.1, 0.1], rtol=1e-6)
    np.testing.assert_array_equal(exact["accuracy"], [1, 0, 0, 0])
    np.testing.assert_array_equal(exact["accuracy_format_free"], [1, 0, 1, 0])
    assert "task_score" not in exact
    part = get_reward_function("reasoning_gym", format_weight=0.1, partial_credit=True)(
        ["q"] * 4, responses, rows=rows)
    np.testing.assert_allclose(part["score"], [1.1, 0.6, 0.35, 0.1], rtol=1e-6)
    np.testing.assert_allclose(part["task_score"], [1.0, 0.5, 0.25, 0.0])
    np.testing.assert_array_equal(part["accuracy"], [1, 0, 0, 0])  # full credit only
    from ppo_jax.trainer.stages.ppo.load_checks import check_names

    cfg = load_config(ROOT / "configs/rlvr/tiny.yaml",
                      ["reward.function_kwargs.partial_credit=sometimes"])
    with pytest.raises(ConfigError, match="partial_credit must be true or false, got .sometimes."):
        check_names(cfg)  # train.py's check before anything compiles


def test_chain_sum_reward_on_the_last_number_needs_no_tag():
    # answer=last_number scores the last number of the response, tag or not; the tagged
    # accuracy is still logged, and the closed tag still earns format_weight.
    rows = [_chain_entry("4 - 1", "3")] * 5
    responses = ["<answer>3</answer>", "4 - 1 = 3", "<answer>3</answer> since 4 - 1",
                 "three", "<answer>4 - 1 = 3"]
    free = get_reward_function("reasoning_gym", format_weight=0.1, answer="last_number")(
        ["q"] * 5, responses, rows=rows)
    np.testing.assert_allclose(free["score"], [1.1, 1.0, 0.1, 0.0, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(free["accuracy"], [1, 0, 1, 0, 0])
    np.testing.assert_array_equal(free["accuracy_format_free"], [1, 1, 0, 0, 1])
    np.testing.assert_array_equal(free["format"], [1, 0, 1, 0, 0])
    assert free["score"].dtype == np.float32
    tag = get_reward_function("reasoning_gym", format_weight=0.1)(["q"] * 5, responses,
                                                                 rows=rows)
    np.testing.assert_allclose(tag["score"], [1.1, 0.0, 1.1, 0.0, 0.0], rtol=1e-6)
    # partial credit on the last number: "31" holds the right "3" (1/2)
    part = get_reward_function("reasoning_gym", partial_credit=True, answer="last_number")(
        ["q"], ["4 - 1 = 31"], rows=rows[:1])
    np.testing.assert_allclose(part["score"], [0.5])
    from ppo_jax.trainer.stages.ppo.load_checks import check_names

    cfg = load_config(ROOT / "configs/rlvr/tiny.yaml", ["reward.function_kwargs.answer=boxed"])
    with pytest.raises(ConfigError, match="answer must be one of .*'tag', 'last_number'.*boxed"):
        check_names(cfg)
    for recipe in ("ppo_shared_format_free", "dapo_format_free"):
        cfg = load_config(ROOT / f"configs/rlvr/{recipe}.yaml")
        assert cfg.data.response_prefix is None
        assert cfg.reward.function_kwargs == {"format_weight": 0.0, "answer": "last_number"}
        check_names(cfg)


def test_score_texts_passes_rows_only_to_functions_that_take_them():
    decode = lambda ids, mask: [f"<answer>{int(i[0])}</answer>" for i in ids]  # noqa: E731
    ids, mask = np.array([[3], [4]]), np.ones((2, 1))
    old_style = lambda prompts, responses: [len(r) for r in responses]  # noqa: E731
    assert not takes_rows(old_style) and takes_rows(get_reward_function("math_verify"))
    texts, scores, parts = score_texts(old_style, decode, ["a", "b"], ids, mask)
    assert texts == ["<answer>3</answer>", "<answer>4</answer>"] and parts == {}
    np.testing.assert_array_equal(scores, [18, 18])
    _, scores, parts = score_texts(get_reward_function("math_verify"), decode, ["a", "b"], ids,
                                   mask, rows=[{"answer": "3"}, {"answer": "3"}])
    np.testing.assert_array_equal(scores, [1, 0])
    assert sorted(parts) == ["accuracy", "accuracy_format_free", "format"]


@pytest.mark.parametrize("config", ["configs/tiny.yaml", "configs/rlvr/tiny.yaml",
                                    "configs/rlvr/dapo_format_free.yaml"])
def test_the_builtin_reward_functions_pass_the_load_time_probe(config, monkeypatch):
    """vader, and reasoning_gym (tag and last-number answers) on their shipped configs: the
    probe's placeholder responses to the first prompts (and eval prompts) score (issue 54)."""
    from ppo_jax.trainer.stages.ppo.load_checks import check_names, check_prompt_files

    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / config)
    check_names(cfg)
    check_prompt_files(cfg)


def test_math_verify_keeps_its_own_timeouts_under_reward_timeout(tmp_path):
    """math-verify times its parses with SIGALRM, which works in the main thread only: the
    `reward.timeout_s` watchdog keeps the call in the calling thread (`rewards.deadline`), so
    it still scores there, and its load-time probe passes on a file of prompts with answers."""
    from ppo_jax.trainer.stages.ppo.load_checks import check_prompt_files

    timed = with_timeout(get_reward_function("math_verify"), 5.0)
    responses = ["<answer>\\frac{1}{2}</answer>", "so 0.5", "<answer>2</answer>"]
    scores, parts = call_reward_function(timed, ["q"] * 3, responses, [{"answer": "1/2"}] * 3)
    np.testing.assert_array_equal(scores, [1, 1, 0])
    np.testing.assert_array_equal(parts["format"], [1, 0, 1])
    (tmp_path / "math.jsonl").write_text('{"prompt": "Half of 1?", "answer": "\\\\frac{1}{2}"}\n'
                                         '{"prompt": "1 + 1?", "answer": "2"}\n')
    check_prompt_files(load_config(ROOT / "configs/tiny.yaml", [
        f"data.prompts={tmp_path / 'math.jsonl'}", "reward.function=math_verify",
        "eval.every=0", "eval.at_start=false", "reward.timeout_s=5"]))


def test_reward_output_checks_shapes_and_the_score_entry():
    scores, parts = reward_output({"score": [1, 2], "x": [0, 1]}, 2)
    assert scores.dtype == np.float32 and list(parts) == ["x"]
    with pytest.raises(ValueError, match="'score'"):
        reward_output({"accuracy": [1]}, 1)
    with pytest.raises(ValueError, match=r"\[3\]"):
        reward_output([1.0, 2.0], 3)


def test_unknown_factory_kwargs_are_named():
    with pytest.raises(ValueError, match="function_kwargs"):
        get_reward_function("math_verify", weight=1)

    @register_reward_function("test_rows_kw", override=True)
    def factory(scale: float = 1.0):
        return lambda prompts, responses, **kw: np.full(len(responses), scale * len(kw["rows"]))

    assert get_reward_function("test_rows_kw", scale=2.0)(["a"], ["b"], rows=[{}])[0] == 2.0


# --- tasks as prompt sets ---------------------------------------------------------------------
class Task:
    def __init__(self, **kw):
        self.name, self.kwargs, self.size, self.seed = "chain_sum", dict(CHAIN), 300, 0
        self.instruction = "Answer in <answer></answer>."
        self.__dict__.update(kw)


def test_held_out_problems_are_distinct_and_never_trained_on():
    splits = task_splits(Task(), eval_seed=1, eval_size=64)
    questions = [r["entry"]["question"] for r in splits.held_out]
    assert len(questions) == 64 == len(set(questions))  # 200 possible sums: draws repeat
    assert disjoint(splits.train, splits.held_out)
    assert splits.dropped > 0 and len(splits.train) == 300 - splits.dropped
    assert not {r["entry"]["question"] for r in splits.train} & set(questions)
    row = splits.train[0]
    assert row["prompt"].endswith("\nAnswer in <answer></answer>.")
    assert row["task"] == "chain_sum" and row["answer"] == row["entry"]["answer"]
    again = task_splits(Task(), eval_seed=1, eval_size=64)  # seeded: the same problems
    assert [r["prompt"] for r in again.train] == [r["prompt"] for r in splits.train]


def test_task_errors_are_named():
    with pytest.raises(ValueError, match="another seed"):
        task_splits(Task(), eval_seed=0, eval_size=8)
    with pytest.raises(ValueError, match="data.task.name='no_such_task'"):
        task_splits(Task(name="no_such_task"), eval_seed=1, eval_size=8)
    tiny = dict(CHAIN, max_digits=1)
    with pytest.raises(ValueError, match="distinct questions"):
        held_out_records("chain_sum", tiny, size=500, seed=1, instruction="", max_tries=2)
    with pytest.raises(ValueError, match="held-out"):
        task_splits(Task(size=3), eval_seed=1, eval_size=199)


def test_config_reads_task_prompts_and_checks_their_sources(tmp_path):
    sets = ["data.prompts=task", "eval.prompts=task", "data.task.name=chain_sum",
            "data.task.size=50", "eval.num_prompts=8"] + [f"data.task.kwargs.{k}={v}" for k, v in CHAIN.items()]
    cfg = load_config(None, sets)
    train, rows = prompt_records(cfg, "task", "data.prompts")
    held, _ = prompt_records(cfg, "task", "eval.prompts")
    assert len(held) == 8 and not set(train) & set(held) and rows[0]["task"] == "chain_sum"
    with pytest.raises(ConfigError, match="needs data.task.name"):
        load_config(None, ["data.prompts=task"])
    with pytest.raises(ConfigError, match="no prompts come from it"):
        load_config(None, ["data.task.name=chain_sum"])
    with pytest.raises(ConfigError, match="eval.task_seed=0"):
        load_config(None, sets + ["eval.task_seed=0"])


def test_a_config_file_builds_on_its_base(tmp_path):
    (tmp_path / "a.yaml").write_text("ppo: {kl_coef: 0.3, cliprange: 0.1}\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nppo: {kl_coef: 0.2}\n")
    cfg = load_config(tmp_path / "b.yaml", ["ppo.cliprange=0.15"])
    assert (cfg.ppo.kl_coef, cfg.ppo.cliprange) == (0.2, 0.15)
    (tmp_path / "c.yaml").write_text("base: d.yaml\n")
    (tmp_path / "d.yaml").write_text("base: c.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "e.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(FileNotFoundError, match="the base of"):
        load_config(tmp_path / "e.yaml")


# --- held-out figures -------------------------------------------------------------------------
def test_eval_batch_repeats_each_prompt_and_pass_at_k_counts_solved_prompts():
    import jax.numpy as jnp

    from ppo_jax.trainer.data.prompts import PromptSet
    from ppo_jax.trainer.stages.ppo.evaluation import component_figures, eval_batch

    prompts = PromptSet(["p0", "p1", "p2"], np.arange(6).reshape(3, 2), np.ones((3, 2), np.int32),
                        [{"answer": "0"}, {"answer": "1"}, {"answer": "2"}])
    # 2 prompts x 3 = 6 rows -> 12: a multiple of 4 (the mesh) and of 3 (whole groups of copies,
    # each group one prompt, so that the group shares one prefill)
    batch = eval_batch(prompts, 2, multiple=4, samples=3)
    assert batch.texts == ["p0"] * 3 + ["p1"] * 3 and batch.rows[3] == {"answer": "1"}
    np.testing.assert_array_equal(batch.valid, [1] * 6 + [0] * 6)
    np.testing.assert_array_equal(batch.ids[:, 0], [0, 0, 0, 2, 2, 2] + [0] * 6)
    acc = jnp.asarray([0, 1, 0, 0, 0, 0] + [1] * 6, jnp.float32)  # padding rows must not count
    out = component_figures({"accuracy": acc, "format": jnp.ones(12)}, jnp.asarray(batch.valid), 6, 3)
    assert float(out["accuracy"]) == pytest.approx(1 / 6)
    assert float(out["pass@3"]) == 0.5 and float(out["format"]) == 1.0
    assert "pass@1" not in component_figures({"accuracy": acc}, jnp.ones(12, bool), 12, 1)
