"""Environment "reasoning_gym_retry": a reasoning-gym problem with feedback and another try.

A row is a reasoning-gym prompt record (`ppo_jax/trainer/data/tasks.py`: `prompt`, `task`,
`entry`). `reset` gives the prompt unchanged (it already holds `data.task.instruction`). Each
policy turn is an attempt, scored by the task's own verifier (`verifiers.task_score`: its
`score_answer` on the turn's `<answer>...</answer>`):

- fully correct (score 1.0): done, reward part `correct` = retry_discount ** (attempt - 1);
- otherwise, while attempts remain (`max_attempts`, default 2): not done, no reward part, and
  the observation is feedback: "Your answer X is not correct. Try again; give the final answer
  in <answer></answer>." (or "You gave no answer in <answer></answer>. ..." without a tag);
- at the last attempt: done, `correct` = its score x the discount (0.0 when wrong; a task
  with partial credit keeps the last attempt's partial score: earlier partial answers get
  another try instead).

`retry_discount` (default 1.0: a later right answer is worth as much as a first one) makes a
second-attempt success worth less (0.5: half), so the policy is pushed to be right at once
while still learning from feedback. Info of every turn: `attempt` (1-based), `answered` 0/1
(the turn had a tagged answer).
"""

from __future__ import annotations

from dataclasses import dataclass

from ppo_jax.trainer.environments.base import Environment, StepResult, register_environment
from ppo_jax.trainer.rewards.verifiers import tagged_answer, task_score

RETRY = "Try again; give the final answer in <answer></answer>."
_QUOTED = 100  # characters of a wrong answer quoted back


@dataclass(frozen=True)
class RetryState:
    """One episode: the problem (`task` name, reasoning-gym `entry`) and the `attempt` the
    next turn is (1-based)."""

    task: str
    entry: dict
    attempt: int = 1


def feedback(answer) -> str:
    """The observation after a wrong attempt whose tagged answer is `answer` (None: untagged)."""
    if answer is None:
        return f"You gave no answer in <answer></answer>. {RETRY}"
    shown = answer if len(answer) <= _QUOTED else answer[:_QUOTED] + "..."
    return f"Your answer {shown} is not correct. {RETRY}"


class RetryEnv(Environment):
    """The "reasoning_gym_retry" environment (module doc)."""

    name = "reasoning_gym_retry"

    def __init__(self, max_attempts: int, retry_discount: float):
        self.max_attempts, self.retry_discount = max_attempts, retry_discount

    def reset(self, row: dict) -> tuple[RetryState, str]:
        """`(state, prompt)`: the row's prompt as it is.

        Raises:
          ValueError: a row without `prompt`, `task` or `entry` (not from a reasoning-gym task).
        """
        missing = [k for k in ("prompt", "task", "entry") if k not in row]
        if missing:
            raise ValueError(f"environment 'reasoning_gym_retry' needs prompts from a "
                             f"reasoning-gym task (data.prompts: task); this row has no "
                             f"{missing} (it has {sorted(row)})")
        return RetryState(row["task"], row["entry"]), row["prompt"]

    def step(self, state: RetryState, assistant_text: str) -> StepResult:
        """Score one attempt (module doc)."""
        score = task_score(assistant_text, {"task": state.task, "entry": state.entry})
        answer = tagged_answer(assistant_text)
        info = {"attempt": state.attempt, "answered": int(answer is not None)}
        last = state.attempt >= self.max_attempts
        if score >= 1.0 or last:
            worth = self.retry_discount ** (state.attempt - 1)
            return StepResult(None, True, {"correct": float(score) * worth}, state, info)
        following = RetryState(state.task, state.entry, state.attempt + 1)
        return StepResult(feedback(answer), False, {}, following, info)


@register_environment("reasoning_gym_retry")
def reasoning_gym_retry_environment(max_attempts: int = 2,
                                    retry_discount: float = 1.0) -> RetryEnv:
    """The "reasoning_gym_retry" environment (module doc).

    Args:
      max_attempts: answers the policy may give (1: single turn, no feedback).
      retry_discount: factor in [0, 1] on a correct answer per earlier wrong attempt.

    Raises:
      ValueError: `max_attempts` < 1 or `retry_discount` outside [0, 1].
    """
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise ValueError(f"environment 'reasoning_gym_retry': max_attempts={max_attempts!r} "
                         "must be an int >= 1")
    if not 0.0 <= float(retry_discount) <= 1.0:
        raise ValueError(f"environment 'reasoning_gym_retry': retry_discount={retry_discount!r}"
                         " must be in [0, 1]")
    return RetryEnv(max_attempts, float(retry_discount))
