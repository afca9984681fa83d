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

Both libraries are imported on first use, so runs that do not use them never load them.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Callable, Optional

from ppo_jax.trainer.data.tasks import rlvr_import

ANSWER_RE = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def tagged_answer(response: str) -> Optional[str]:
    """The stripped text of the last `<answer>...</answer>` in `response`, or None."""
    matches = ANSWER_RE.findall(response)
    return matches[-1].strip() if matches else None


@lru_cache(maxsize=None)
def _task_scorer(name: str) -> Callable[[Any, dict], float]:
    return rlvr_import("reasoning_gym", "reward.function=reasoning_gym").get_score_answer_fn(name)


def task_score(response: str, row: dict) -> float:
    """Score of `response` on a reasoning-gym problem: its task's `score_answer` on the tagged
    answer (0.0 without one).

    Args:
      response: the decoded response (with `data.response_prefix` in front).
      row: the prompt's row: `task` (the dataset name) and `entry` (the problem).

    Raises:
      ValueError: a row without `task` / `entry` (the prompts do not come from a task).
    """
    if "entry" not in row or "task" not in row:
        raise ValueError("reward.function=reasoning_gym needs prompts from a reasoning-gym task "
                         f"(data.prompts: task); this prompt's row has {sorted(row)}")
    answer = tagged_answer(response)
    if answer is None:
        return 0.0
    return float(_task_scorer(row["task"])(answer, row["entry"]))


@lru_cache(maxsize=4096)
def _parsed(text: str):
    return rlvr_import("math_verify", "reward.function=math_verify").parse(text)


def math_correct(response: str, gold: Any) -> float:
    """1.0 when the response's answer equals `gold` for math-verify, else 0.0 (module doc).

    Raises:
      ValueError: `gold` is None (the prompt row has no `answer`).
    """
    if gold is None:
        raise ValueError("reward.function=math_verify needs an `answer` field in every prompt "
                         "record (data.prompts: a .jsonl / .parquet with prompt and answer)")
    verify = rlvr_import("math_verify", "reward.function=math_verify").verify
    answer = tagged_answer(response)
    gold_parsed = _parsed(str(gold))
    if not gold_parsed:  # math-verify found nothing to parse: compare the strings
        return float((answer if answer is not None else response).strip() == str(gold).strip())
    return float(verify(gold_parsed, _parsed(response if answer is None else answer)))
