"""Prompt sets: read, template, tokenise and left-pad.

A prompt file is `.jsonl` / `.json` (records with a `prompt` field, or bare strings), `.txt`
(one prompt per line) or `.parquet` (a `prompt` column). A record's other fields, such as an
`answer`, are kept as its row and reach the reward function; a reasoning-gym task gives such
records too. Prompts pass through the tokenizer's chat template when it has one (one user turn,
an optional system turn, the generation prompt appended), are tokenised, and are left-padded to
one fixed width so that every step has the same shapes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np

from ppo_jax.trainer.data.tasks import TASK_SOURCE, task_splits
from ppo_jax.trainer.data.text import encode_prompt, read_rows, require_file
from ppo_jax.trainer.data.records import read_text


PROMPT_SUFFIXES = (".jsonl", ".json", ".txt", ".parquet")


def read_prompts(path: str | Path, field: str = "prompt", key: str = "data.prompts") -> list[str]:
    """The raw prompt strings of a file; errors name the config key `key`.

    Raises:
      FileNotFoundError: the file does not exist.
      ValueError: unknown extension, a record without `field`, a prompt that is not a non-blank
        string (records count from 0, blank JSONL lines skipped), or an empty set.
    """
    return read_prompt_records(path, field, key)[0]


def read_prompt_records(path: str | Path, field: str = "prompt",
                        key: str = "data.prompts") -> tuple[list[str], list[dict]]:
    """`(prompts, rows)`: the prompt strings of a file and each record's other fields, e.g.
    `{"answer": "42"}` (`{}` for bare strings and `.txt` lines).

    Raises:
      FileNotFoundError / ValueError: as `read_prompts`.
    """
    path = require_file(path, key, "prompt")
    if path.suffix.lower() == ".txt":
        prompts = [line.rstrip("\n") for line in read_text(path, key).splitlines()]
        prompts = [p for p in prompts if p.strip()]
        rows = [{} for _ in prompts]
    else:
        records = read_rows(path, key, what="prompt", suffixes=PROMPT_SUFFIXES,
                            items="prompt strings or records")
        if path.suffix.lower() == ".parquet" and records and field not in records[0]:
            raise ValueError(f"{key}: data.prompt_field={field!r}: no such column in {path} "
                             f"(columns: {list(records[0])})")
        prompts = [_field(r, field, path, i, key) for i, r in enumerate(records)]
        rows = [extra_fields(r, field) for r in records]
    if not prompts:
        raise ValueError(f"{key}: no prompts in {path}")
    return prompts, rows


def extra_fields(record, field: str) -> dict:
    """A prompt record's fields other than the prompt, `{}` for a bare string: the row a reward
    function receives for that prompt."""
    return {k: v for k, v in record.items() if k != field} if isinstance(record, dict) else {}


def prompt_records(cfg, source: str, key: str) -> tuple[list[str], list[dict]]:
    """`(prompts, rows)` of a prompt source of the run `cfg`: a file, or 'task', which gives the
    training problems of `data.task` for `data.prompts` and its held-out problems
    (`eval.task_seed`, `eval.num_prompts`) for `eval.prompts`.

    Raises:
      FileNotFoundError / ValueError: an unreadable file or a bad task.
    """
    if source != TASK_SOURCE:
        return read_prompt_records(source, cfg.data.prompt_field, key)
    held = cfg.eval.num_prompts if cfg.eval.prompts == TASK_SOURCE else 0
    splits = task_splits(cfg.data.task, eval_seed=cfg.eval.task_seed, eval_size=held)
    records = splits.held_out if key.startswith("eval") else splits.train
    return [r["prompt"] for r in records], [extra_fields(r, "prompt") for r in records]


def plain_instruction_config(cfg, instruction: str):
    """`cfg` asking its held-out task problems plainly, for `eval.plain_instruction`:
    `instruction` in place of `data.task.instruction` and no `data.response_prefix`, so that
    neither the prompt nor the start of the answer names a format. `eval.plain_instruction` is
    cleared in the result. The problems stay the same, since the held-out split depends only on
    the task, its kwargs and seeds.

    Raises:
      ValueError: `eval.prompts` is not 'task'; a prompt file's instruction is part of its text
        and cannot be replaced.
    """
    if cfg.eval.prompts != TASK_SOURCE:
        raise ValueError(f"a plain instruction re-asks the problems of data.task: it needs "
                         f"eval.prompts: task, not {cfg.eval.prompts!r}")
    data = replace(cfg.data, task=replace(cfg.data.task, instruction=instruction),
                   response_prefix=None)
    return replace(cfg, data=data, eval=replace(cfg.eval, plain_instruction=None))


def _field(record, field: str, path: Path, index: int, key: str) -> str:
    if isinstance(record, str):
        return _text(record, field, path, index, key)
    if isinstance(record, dict) and field in record:
        return _text(record[field], field, path, index, key)
    raise ValueError(f"{key}: record {index} of {path} has no field data.prompt_field={field!r}")


def _text(value, field: str, path: Path, index: int, key: str) -> str:
    """A prompt must be a non-blank string; a number, null or list is a data error, not text."""
    if not isinstance(value, str):
        raise ValueError(f"{key}: record {index} of {path}: {field!r} is "
                         f"{type(value).__name__} {value!r:.60}, not a string")
    if not value.strip():
        raise ValueError(f"{key}: record {index} of {path}: {field!r} is empty")
    return value


def apply_template(tokenizer, prompt: str, use_chat_template: bool, system_prompt: str | None,
                   response_prefix: str | None = None) -> list[int]:
    """Token ids of one prompt: a single user turn through the chat template when asked for and
    available, encoded as SFT and reward-model prompts are, then `response_prefix`, the text the
    assistant's turn starts with."""
    return encode_prompt(tokenizer, [{"role": "user", "content": prompt}],
                         use_chat_template=use_chat_template, system_prompt=system_prompt,
                         response_prefix=response_prefix)


def left_pad(token_lists: list[list[int]], width: int, pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token lists to `width`.

    Returns:
      ids [N, width] int32 and mask [N, width] int32 (1 on real tokens).
    Raises:
      ValueError: a list is longer than `width`.
    """
    ids = np.full((len(token_lists), width), pad_token_id, dtype=np.int32)
    mask = np.zeros((len(token_lists), width), dtype=np.int32)
    for i, toks in enumerate(token_lists):
        if len(toks) > width:
            raise ValueError(f"prompt {i} has {len(toks)} tokens, more than the width {width}")
        if toks:
            ids[i, width - len(toks):] = toks
            mask[i, width - len(toks):] = 1
    return ids, mask


@dataclass
class PromptSet:
    """Tokenised, left-padded prompts.

    Attributes:
      texts: the raw prompts, N strings.
      ids: [N, P] int32, left-padded.
      mask: [N, P] int32.
      rows: N dicts, each prompt's other fields (what a reward function receives), or None.
    """

    texts: list[str]
    ids: np.ndarray
    mask: np.ndarray
    rows: list[dict] | None = None

    def __len__(self) -> int:
        return len(self.texts)


TRUNCATIONS = ("left", "error")  # data.truncation: drop the oldest tokens (warn) | refuse
Truncation = Literal[TRUNCATIONS]


def tokenize_prompts(texts: list[str], tokenizer, *, max_prompt_length: int, truncation: str = "left",
                     use_chat_template: bool = True, system_prompt: str | None = None,
                     pad_token_id: int, response_prefix: str | None = None,
                     rows: list[dict] | None = None) -> PromptSet:
    """Template and tokenise every prompt; the width is the longest prompt, at most
    `max_prompt_length`.

    Over-long prompts lose their oldest tokens (truncation="left", with one warning giving the
    count) or are refused (truncation="error").

    Raises:
      ValueError: an unknown `truncation`; with truncation="error", a prompt longer than
        max_prompt_length (naming its index and length); a prompt empty after tokenisation.
    """
    if truncation not in TRUNCATIONS:
        raise ValueError(f"data.truncation={truncation!r} is not one of {list(TRUNCATIONS)}")
    lists = [apply_template(tokenizer, t, use_chat_template, system_prompt, response_prefix)
             for t in texts]
    too_long = [i for i, toks in enumerate(lists) if len(toks) > max_prompt_length]
    if too_long:
        i = too_long[0]
        if truncation == "error":
            raise ValueError(f"prompt {i} has {len(lists[i])} tokens, more than "
                             f"data.max_prompt_length={max_prompt_length}: {texts[i][:80]!r}")
        warnings.warn(f"{len(too_long)} prompt(s) longer than data.max_prompt_length="
                      f"{max_prompt_length} were truncated from the left", stacklevel=2)
        lists = [toks[-max_prompt_length:] for toks in lists]
    empty = [i for i, toks in enumerate(lists) if not toks]
    if empty:
        raise ValueError(f"prompt {empty[0]} is empty after tokenisation")
    width = max(len(t) for t in lists)
    ids, mask = left_pad(lists, width, pad_token_id)
    return PromptSet(list(texts), ids, mask, rows)
