"""Verifiers of answers: the answer a response gives, and whether it is right.

- `tagged_answer`: the text inside the response's last `<answer>...</answer>` pair, stripped
  (reasoning-gym's `extract_answer` convention: one optional space inside each tag, the last
  pair wins, None without a closed pair).
- `task_score`: a reasoning-gym task's own `score_answer(answer, entry)` (1.0 right; some
  tasks give partial credit), 0.0 when the response has no tagged answer.
- `math_correct`: HF `math-verify` (what TRL's accuracy reward and open-r1 use): the gold
  answer and the response's answer (its tagged answer when it has one, else the whole
  response) are parsed as LaTeX (`\\boxed{}`, `\\frac`, ...) or plain expressions / numbers
  and compared symbolically. Without a closed tag (an unclosed `<answer>` is none),
  math-verify's own extraction picks the expression after the word "answer" when there is
  one (`<answer> 7 since 2 + 4` reads 7), else the last expression (`I think 7. Then 9`
  reads 9).
- `format_free_answer`: the last number of the whole response, tags or not: the answer as a
  reader would take it when the format is ignored. `task_score(..., extract=format_free_answer)`
  and `math_correct(..., extract=format_free_answer)` give the accuracy that learning the format
  cannot raise (docs/rlvr.md, "Accuracy that format cannot inflate").

Both libraries are imported on first use, so runs that do not use them never load them.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Callable, Optional

from ppo_jax.trainer.data.tasks import rlvr_import

ANSWER_RE = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
TAG_MENTION = re.compile(r"</?answer\b", re.IGNORECASE)  # text that names the tag
# a number: a sign only where it cannot be an operator (not after a word character or ")"),
# digits with optional thousands groups ("1,234", greedy only over whole groups of three),
# optional decimals ("2.5"; a sentence's final "." is not one)
NUMBER_RE = re.compile(r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
Extractor = Callable[[str], Optional[str]]  # response -> the answer's text, or None


def tagged_answer(response: str) -> Optional[str]:
    """The stripped text of the last `<answer>...</answer>` in `response`, or None."""
    matches = ANSWER_RE.findall(response)
    return matches[-1].strip() if matches else None


def format_free_answer(text: str) -> Optional[str]:
    """The last number of `text`, wherever it stands (inside an `<answer>` tag, after one that
    is never closed, or with no tag at all), thousands separators dropped; None without one.

    What counts as a number (`NUMBER_RE`): digits (`7`), with thousands separators (`1,234` ->
    "1234"; `3,4` is two numbers), with decimals (`2.5`; `7.` is 7), with a leading minus
    when it cannot be an operator (`x = -12` -> "-12", but `12-3` and `4 - 1` read 12 and 3,
    4 and 1). Words (`seven`), fractions (`3/4` reads 4) and exponents are not numbers. This is
    the form the answers of arithmetic tasks take (chain_sum, basic_arithmetic, the
    calculator's problems); the last one counts because a response that works an answer out
    (`4 - 1 = 3`) ends with it. The environments' `final_number` reads numbers with the same
    rule.

    Args:
      text: a decoded response (or any text), str.

    Raises:
      TypeError: `text` is not a string (naming its type).
    """
    if not isinstance(text, str):
        raise TypeError(f"format_free_answer(text): text must be a str, got "
                        f"{type(text).__name__} {text!r:.40}")
    found = NUMBER_RE.findall(text)
    return found[-1].replace(",", "") if found else None


@lru_cache(maxsize=None)
def _task_scorer(name: str) -> Callable[[Any, dict], float]:
    return rlvr_import("reasoning_gym", "reward.function=reasoning_gym").get_score_answer_fn(name)


def task_score(response: str, row: dict, *, extract: Extractor = tagged_answer) -> float:
    """Score of `response` on a reasoning-gym problem: its task's `score_answer` on the tagged
    answer (0.0 without one).

    Args:
      response: the decoded response (with `data.response_prefix` in front).
      row: the prompt's row: `task` (the dataset name) and `entry` (the problem).
      extract: how the answer is read from the response (`tagged_answer`, reasoning-gym's
        convention; `format_free_answer` for the format-free accuracy).

    Raises:
      ValueError: a row without `task` / `entry` (the prompts do not come from a task).
    """
    if "entry" not in row or "task" not in row:
        raise ValueError("reward.function=reasoning_gym needs prompts from a reasoning-gym task "
                         f"(data.prompts: task); this prompt's row has {sorted(row)}")
    answer = extract(response)
    if answer is None:
        return 0.0
    return float(_task_scorer(row["task"])(answer, row["entry"]))


@lru_cache(maxsize=4096)
def _parsed(text: str):
    return rlvr_import("math_verify", "reward.function=math_verify").parse(text)


def math_correct(response: str, gold: Any, *, extract: Optional[Extractor] = None) -> float:
    """1.0 when the response's answer equals `gold` for math-verify, else 0.0 (module doc).
    `extract` (e.g. `format_free_answer`), when given, reads the answer in place of the tag /
    whole-response rule; it finding none scores 0.0.

    Raises:
      ValueError: `gold` is None (the prompt row has no `answer`).
    """
    if gold is None:
        raise ValueError("reward.function=math_verify needs an `answer` field in every prompt "
                         "record (data.prompts: a .jsonl / .parquet with prompt and answer)")
    verify = rlvr_import("math_verify", "reward.function=math_verify").verify
    if extract is not None:
        response = extract(response)
        if response is None:
            return 0.0
    answer = tagged_answer(response)
    gold_parsed = _parsed(str(gold))
    if not gold_parsed:  # math-verify found nothing to parse: compare the strings
        return float((answer if answer is not None else response).strip() == str(gold).strip())
    return float(verify(gold_parsed, _parsed(response if answer is None else answer)))
