"""Reading the row files of stages 1 and 2 (and PPO's prompt files), and the checks of one
record's fields that the SFT and preference formats share (`data.sft`, `data.preference`).

Every error names the config key that named the file, the file, the record index (from 0) and
the field: "sft.data: record 3 of a.jsonl: 'response' is empty".
"""

from __future__ import annotations

import json
from pathlib import Path

Messages = list[dict]  # [{"role": "system" | "user" | "assistant", "content": str}, ...]
ROLES = ("system", "user", "assistant")
ROW_SUFFIXES = (".jsonl", ".json", ".parquet")


def require_file(path: str | Path, key: str, what: str = "data") -> Path:
    """`Path(path)`. Raises FileNotFoundError naming `key` when it is not a file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{key}: {what} file not found: {path}")
    return path


def read_text(path: Path, key: str) -> str:
    """The UTF-8 text of `path`.

    Raises:
      ValueError: the file is not UTF-8 text (a binary file, or another encoding), naming `key`,
        the file and the first bad byte's offset.
    """
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{key}: {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                         f"offset {e.start}); a binary file, or another encoding: convert it "
                         "to UTF-8") from None


def read_rows(path: str | Path, key: str, *, what: str = "data", suffixes=ROW_SUFFIXES,
              items: str = "objects") -> list:
    """The raw records of a `.json` (one list), `.jsonl` (one value a line, blank lines skipped)
    or `.parquet` (rows as dicts, nulls as None) file; shared by `read_records` and
    `data.prompts.read_prompts`, which handles `.txt` itself. `what`, `suffixes` and `items` only word
    the errors.

    Raises:
      FileNotFoundError: no such file.
      ValueError: a suffix not in `suffixes`, text that is not UTF-8, invalid JSON (with the
        line number), or a `.json` file whose top level is not a list.
    """
    path = require_file(path, key, what)
    suffix = path.suffix.lower()
    if suffix not in suffixes or suffix not in ROW_SUFFIXES:
        raise ValueError(f"{key}: unsupported {what} file type {suffix!r} "
                         f"(use {', '.join(suffixes[:-1])} or {suffixes[-1]})")
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = read_text(path, key)
    if suffix == ".json":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{key}: {path} is not valid JSON (line {e.lineno}: {e.msg})") from None
        if not isinstance(records, list):
            raise ValueError(f"{key}: {path} holds a JSON {type(records).__name__}; expected a "
                             f"list of {items}")
        return records
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{key}: {path} is not valid JSONL (line {n}: {e.msg})") from None
    return records


def read_records(path: str | Path, key: str) -> list[dict]:
    """The rows of a `.jsonl` / `.json` / `.parquet` file as dicts; `key` is the config key that
    named the file (e.g. "sft.data") and starts every error.

    Raises:
      FileNotFoundError: no such file.
      ValueError: see `read_rows`; a record that is not an object; no records.
    """
    records = read_rows(path, key)
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ValueError(f"{key}: record {i} of {path} is {type(r).__name__} {r!r:.60}, not an object")
    if not records:
        raise ValueError(f"{key}: no records in {path}")
    return records


def field_error(at: str, field: str, problem: str) -> ValueError:
    """`at` names the record: "sft.data: record 3 of a.jsonl" (records count from 0)."""
    return ValueError(f"{at}: {field!r} {problem}")


def text_field(value, field: str, at: str) -> str:
    if not isinstance(value, str):
        raise field_error(at, field, f"is {type(value).__name__} {value!r:.60}, not a string")
    if not value.strip():
        raise field_error(at, field, "is empty")
    return value


def messages_field(value, field: str, at: str) -> Messages:
    """A non-empty list of {"role", "content"} dicts with a known role and string content."""
    if not isinstance(value, list) or not value:
        raise field_error(at, field, f"is {type(value).__name__} {value!r:.60}, not a "
                   f"{'' if field == 'messages' else 'string or '}non-empty message list")
    for j, m in enumerate(value):
        name = f"{field}[{j}]"
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise field_error(at, name, f"is {m!r:.60}, not a message with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise field_error(at, name, f"has role {m['role']!r}; expected one of {ROLES}")
        if not isinstance(m["content"], str):
            raise field_error(at, name, f"content is {type(m['content']).__name__}, not a string")
    return [dict(m) for m in value]


def prompt_field(value, field: str, at: str) -> Messages:
    if isinstance(value, str):
        return [{"role": "user", "content": text_field(value, field, at)}]
    msgs = messages_field(value, field, at)
    if not any(m["content"].strip() for m in msgs):
        raise field_error(at, field, "has no text: every message's content is empty")
    return msgs


def split_last(value, field: str, at: str) -> tuple[Messages, str]:
    """(earlier turns, response) of a conversation whose last message is the assistant's."""
    msgs = messages_field(value, field, at)
    if msgs[-1]["role"] != "assistant":
        raise field_error(at, field, f"ends with a {msgs[-1]['role']!r} message; the last must be 'assistant'")
    return msgs[:-1], text_field(msgs[-1]["content"], f"{field}[{len(msgs) - 1}].content", at)


def required_field(record: dict, field: str, at: str):
    if field not in record or record[field] is None:
        raise field_error(at, field, "is missing")
    return record[field]


def flag_field(record: dict, field: str, at: str) -> bool:
    """An optional boolean field (absent / null: False)."""
    value = record.get(field)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise field_error(at, field, f"is {type(value).__name__} {value!r:.60}, not true / false")
    return value
