"""Python reward functions on decoded text, registered by name.

A reward function scores one batch: `fn(prompts: list[str], responses: list[str]) ->
np.ndarray [B] float32`. Register a factory returning it with
`@register_reward_function("name")`, so heavy set-up runs only when selected;
`reward.function_kwargs` are the factory's keyword arguments, and `reward.function=name`
selects it.

Optional extensions, used by the verifiable rewards below:
- a factory may set `row_fields`, such as `("answer",)`: the prompt-record fields its function
  reads, so that prompts lacking one are refused before any model loads; and `row_hint`, a
  note on where such prompts come from.
- a function with a `rows` keyword, `fn(prompts, responses, *, rows)`, also receives each
  sample's prompt record, e.g. its `answer` or a reasoning-gym task's `entry`.
- it may return a dict `{"score": [B], name: [B], ...}`; the other entries are components,
  logged as `reward/<name>` in training and `eval/<name>` in held-out evaluation. There,
  `accuracy` also gives pass@k, and `accuracy_format_free` with `eval.plain_instruction` gives
  `eval/accuracy_plain`.
- a factory may set `probe = False` so that its function is not called at load, e.g. one that
  needs a server the run starts later.

Every call is checked: an exception, a call longer than `reward.timeout_s`, or a result that is
not one finite number per response is a `RewardFunctionError` saying what came back. At load
the config checks refuse such a function; mid-run the trainer stops, naming the function and
the step.
"""

from __future__ import annotations

import inspect
from typing import Literal

import numpy as np

from ppo_jax.core.registry import Registry
from ppo_jax.trainer.rewards import verifiers
from ppo_jax.trainer.rewards.calls import RewardFunction

REWARD_KINDS = ("function", "model")  # reward.kind: a registered function | a reward model
RewardKind = Literal[REWARD_KINDS]
REWARD_FUNCTIONS = Registry("reward function")  # name -> factory () -> RewardFunction


def register_reward_function(name: str, *, override: bool = False):
    """Decorator registering a factory `() -> RewardFunction` under `name`. Registering the
    same factory again is a no-op.

    Raises:
      ValueError: empty name, or `name` taken by another factory and not `override`.
    """
    return REWARD_FUNCTIONS.register(name, override=override)


def get_reward_function(name: str, **kwargs) -> RewardFunction:
    """Build the registered reward function `name`, its factory called with `kwargs`
    (`reward.function_kwargs`).

    Raises:
      ValueError: unknown name (`"unknown reward function 'x'; known: ..."`), or keyword
        arguments the factory does not take, naming them.
    """
    factory = REWARD_FUNCTIONS.get(name)
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"reward.function_kwargs={kwargs!r} do not fit reward function "
                         f"{name!r}: {e}") from None
    return factory(**kwargs)


def check_prompt_rows(name: str, rows: list[dict], key: str, source: str) -> None:
    """Refuse prompts whose records lack a field the reward function `name` reads (its
    factory's `row_fields`), before any model loads.

    Raises:
      ValueError: naming the function, the field, `key`, `source` and the first record without
        it (counted from 0).
    """
    fields = getattr(REWARD_FUNCTIONS.get(name), "row_fields", ())
    for field in fields:
        missing = next((i for i, row in enumerate(rows) if field not in row), None)
        if missing is not None:
            hint = getattr(REWARD_FUNCTIONS.get(name), "row_hint", "")
            raise ValueError(f"reward.function={name} reads the {field!r} field of every prompt "
                             f"row, but {key}: record {missing} of {source} has "
                             f"{sorted(rows[missing]) or 'only the prompt'}{hint}")


def probes(name: str) -> bool:
    """Whether the reward function `name` is called on placeholders at load; its factory's
    `probe`, default True."""
    return bool(getattr(REWARD_FUNCTIONS.get(name), "probe", True))


@register_reward_function("vader")
def vader_sentiment() -> RewardFunction:
    """VADER compound sentiment of the response, in [-1, 1] (Hutto & Gilbert 2014).

    The lexicon ships inside the `vadersentiment` wheel; nothing is downloaded.
    """
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()

    def score(prompts: list[str], responses: list[str]) -> np.ndarray:
        del prompts
        return np.asarray([analyzer.polarity_scores(r)["compound"] for r in responses], np.float32)

    return score


@register_reward_function("length")
def response_length() -> RewardFunction:
    """Number of whitespace-separated words of the response divided by 10 (a debugging reward)."""

    def score(prompts: list[str], responses: list[str]) -> np.ndarray:
        del prompts
        return np.asarray([len(r.split()) / 10.0 for r in responses], np.float32)

    return score


REWARD_ANSWERS = ("tag", "last_number")  # reasoning_gym's reward.function_kwargs.answer


@register_reward_function("reasoning_gym")
def reasoning_gym_reward(format_weight: float = 0.0, partial_credit: bool = False,
                         answer: str = "tag") -> RewardFunction:
    """Verifiable reward of reasoning-gym problems: 1 when the task's own `score_answer` gives
    the response's `<answer>...</answer>` full credit, else 0, plus `format_weight` when the tagged
    answer is there.

    `partial_credit=True` rewards the task's score itself. It is off by default because some
    tasks' partial credit can be farmed: chain_sum's scorer gives `len(answer) / len(response's
    answer)` to any answer that contains the right one as a substring, so "<answer>51034</answer>"
    earns 0.2 on "1 + 2 =", and GRPO's group-normalised advantages turn that 0.2 into a full-sized
    signal; the 1-2 digit run learnt ever longer numbers (results/rlvr/log.md, "Why GRPO
    drifted").

    Components, each `[n]`: `accuracy` (fully right), `format`, `accuracy_format_free` (fully
    right on the response's last number, tag or not) and, with partial credit, `task_score`. The
    accuracies count full credit only.

    `answer="last_number"` scores the response's last number instead, tag or not, so the reward
    cannot be raised by the answer's format alone (results/rlvr/log.md, "A reward without the
    tag"); `accuracy` still logs the tagged answer's credit, and `format_weight` still pays for a
    closed tag.

    Raises:
      ValueError: `partial_credit` not a bool, or `answer` not one of `REWARD_ANSWERS`, naming
        the `reward.function_kwargs` key. The config checks raise them as ConfigErrors before
        anything compiles.
    """
    if not isinstance(partial_credit, bool):
        raise ValueError("reward.function_kwargs.partial_credit must be true or false, got "
                         f"{partial_credit!r}")
    if answer not in REWARD_ANSWERS:
        raise ValueError(f"reward.function_kwargs.answer must be one of {REWARD_ANSWERS}, got "
                         f"{answer!r}")

    def score(prompts: list[str], responses: list[str], *, rows: list[dict]) -> dict:
        del prompts
        pairs = list(zip(responses, rows))
        task = np.asarray([verifiers.task_score(r, row) for r, row in pairs], np.float32)
        free = np.asarray([verifiers.task_score(r, row, extract=verifiers.format_free_answer)
                           for r, row in pairs])
        accuracy = (task >= 1.0).astype(np.float32)
        out = _with_format(accuracy, (free >= 1.0).astype(np.float32), responses, format_weight)
        credit = task if answer == "tag" else free.astype(np.float32)
        if not partial_credit:
            credit = (credit >= 1.0).astype(np.float32)
        out["score"] = credit + format_weight * out["format"]
        if partial_credit:
            out["task_score"] = credit
        return out

    return score


reasoning_gym_reward.row_fields = ("task", "entry")
reasoning_gym_reward.row_hint = " (prompts from a reasoning-gym task: data.prompts: task, data.task)"


@register_reward_function("math_verify")
def math_verify_reward(format_weight: float = 0.0) -> RewardFunction:
    """Verifiable reward of math answers: 1 when math-verify finds the response's answer (its
    `<answer>` text, else the whole response: LaTeX, `\\boxed{}`, plain numbers) equal to the
    prompt row's `answer` (`verifiers.math_correct`), plus `format_weight` when the response has
    an `<answer>` tag. Components: `accuracy`, `format`, `accuracy_format_free` (math-verify on
    the response's last number, tag or not)."""

    def score(prompts: list[str], responses: list[str], *, rows: list[dict]) -> dict:
        del prompts
        golds = [row.get("answer") for row in rows]
        accuracy = np.asarray([verifiers.math_correct(r, g) for r, g in zip(responses, golds)])
        free = np.asarray([verifiers.math_correct(r, g, extract=verifiers.format_free_answer)
                           for r, g in zip(responses, golds)])
        return _with_format(accuracy, free, responses, format_weight)

    return score


math_verify_reward.row_fields = ("answer",)
math_verify_reward.row_hint = (" (a .jsonl / .json / .parquet of records with `prompt` and "
                               "`answer`)")


def _with_format(accuracy: np.ndarray, free: np.ndarray, responses: list[str],
                 weight: float) -> dict:
    """`{"score": accuracy + weight * format, "accuracy", "format", "accuracy_format_free":
    free}`, where format is 1 for a response with a tagged answer."""
    fmt = np.asarray([verifiers.tagged_answer(r) is not None for r in responses], np.float32)
    return {"score": accuracy + weight * fmt, "accuracy": accuracy, "format": fmt,
            "accuracy_format_free": free}
