"""Procedural reasoning tasks as prompt sets: reasoning-gym's seeded generators and their own
scorers (`data.task`; `data.prompts: task` and `eval.prompts: task` select them).

A task is a reasoning-gym dataset made by `reasoning_gym.create_dataset`, such as
`chain_sum`, `basic_arithmetic`, `leg_counting`, `gsm_symbolic` or `countdown`. Its entries
become prompt records. `prompt` is the entry's question plus `data.task.instruction`, which
says how to write the answer, by reasoning-gym's `<answer>...</answer>` convention. Each record
also keeps `answer`, the entry's reference answer, which the `math_verify` reward reads; `task`,
the dataset name; and `entry`, the whole entry, which the task's own `score_answer` needs.

The held-out set is `eval.num_prompts` distinct questions of the same task and kwargs from
another seed (`eval.task_seed`); the training set is `data.task.size` entries of
`data.task.seed` with every question of the held-out set removed, so the two are disjoint by
construction (`disjoint` checks it; how many training entries were dropped is reported).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

TASK_SOURCE = "task"  # data.prompts / eval.prompts: the prompts of data.task
# the instruction of the plain-instruction accuracy (eval.plain_instruction;
# scripts/compare_accuracy.py's default): asks for a number and never names the <answer> tag
PLAIN_INSTRUCTION = "Give the final answer as a number at the end."


@dataclass(frozen=True)
class TaskSplits:
    """The prompt records of a task: `train` and `held_out` lists of dicts (`prompt`,
    `answer`, `task`, `entry`), and `dropped`, the training entries removed because their
    question is held out."""

    train: list[dict]
    held_out: list[dict]
    dropped: int


def _dataset(name: str, kwargs: dict, size: int, seed: int):
    """`reasoning_gym.create_dataset`, its errors as ValueError naming `data.task.*`."""
    reasoning_gym = rlvr_import("reasoning_gym", "data.task")

    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **kwargs)
    except (ValueError, TypeError, AssertionError, KeyError) as e:
        known = ", ".join(sorted(reasoning_gym.factory.DATASETS)[:12])
        raise ValueError(f"data.task.name={name!r} with data.task.kwargs={kwargs!r}: "
                         f"reasoning-gym refused it ({type(e).__name__}: {e}); datasets "
                         f"include {known}, ...") from None


def rlvr_import(module: str, key: str):
    """`import module` of the `rlvr` extra, or a ValueError naming `key` and the install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{key} needs the {module} package: pip install -e '.[rlvr]'") from None


def _record(name: str, entry: dict, instruction: str) -> dict:
    entry = json.loads(json.dumps(entry, default=str))  # plain JSON values: checkpoint-safe
    prompt = entry["question"] + (f"\n{instruction}" if instruction else "")
    return {"prompt": prompt, "answer": str(entry["answer"]), "task": name, "entry": entry}


def held_out_records(name: str, kwargs: dict, *, size: int, seed: int, instruction: str,
                     max_tries: int = 20) -> list[dict]:
    """`size` records of distinct questions from the task's `seed` (a small task repeats
    questions: more entries are drawn, up to `max_tries` x size, until `size` distinct ones).

    Raises:
      ValueError: the task has fewer than `size` distinct questions within the draws.
    """
    dataset = _dataset(name, kwargs, size * max_tries, seed)
    seen, out = set(), []
    for i in range(len(dataset)):  # entries are generated on access: stop once enough
        entry = dataset[i]
        if entry["question"] not in seen:
            seen.add(entry["question"])
            out.append(_record(name, entry, instruction))
            if len(out) == size:
                return out
    raise ValueError(f"data.task.name={name!r}: only {len(out)} distinct questions in "
                     f"{len(dataset)} draws of seed {seed}, fewer than eval.num_prompts={size}")


def task_splits(task, *, eval_seed: int, eval_size: int) -> TaskSplits:
    """The training and held-out records of `task` (`data.task`: name, kwargs, size, seed,
    instruction), disjoint by question (module doc).

    Raises:
      ValueError: no task name, a seed shared by both splits, a dataset reasoning-gym refuses,
        too few distinct held-out questions, or no training question left.
    """
    if not task.name:
        raise ValueError("data.prompts / eval.prompts is 'task' but data.task.name is not set")
    if eval_seed == task.seed:
        raise ValueError(f"eval.task_seed={eval_seed} equals data.task.seed: the held-out "
                         "problems must come from another seed")
    held = held_out_records(task.name, dict(task.kwargs), size=eval_size, seed=eval_seed,
                            instruction=task.instruction) if eval_size else []
    questions = {r["entry"]["question"] for r in held}
    train = [_record(task.name, e, task.instruction)
             for e in _dataset(task.name, dict(task.kwargs), task.size, task.seed)]
    kept = [r for r in train if r["entry"]["question"] not in questions]
    if not kept:
        raise ValueError(f"data.task: all {len(train)} training problems of {task.name!r} are "
                         f"among the {len(held)} held-out ones; raise data.task.size or make "
                         "the task harder (data.task.kwargs)")
    return TaskSplits(kept, held, len(train) - len(kept))


def disjoint(train: list[dict], held_out: list[dict]) -> bool:
    """No question (the prompt text) of `held_out` is in `train`."""
    return not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
