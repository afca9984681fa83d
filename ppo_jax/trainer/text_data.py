"""Text data of stage 1 (SFT) and stage 2 (reward model): read rows, check them, tokenise, pack.

Row formats follow TRL: SFT rows are `{"prompt", "response"}` or `{"messages"}` (the last
message is the assistant response; `SFTTrainer`'s completion-only loss), preference rows are
`{"prompt", "chosen", "rejected"}` or the implicit-prompt form where `chosen` / `rejected` are
whole conversations (`RewardTrainer`). A prompt is tokenised exactly as PPO's prompts are
(`encode_prompt`, which `data.apply_template` calls), a response is its tokens plus the stop token
the sampler ends on; each row is prompt + response, right-padded (DeepSpeed-Chat steps 1 and 2).
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

Messages = list[dict]  # [{"role": "system" | "user" | "assistant", "content": str}, ...]
ROLES = ("system", "user", "assistant")
ROW_SUFFIXES = (".jsonl", ".json", ".parquet")


def require_file(path: str | Path, key: str, what: str = "data") -> Path:
    """`Path(path)`. Raises FileNotFoundError naming `key` when it is not a file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{key}: {what} file not found: {path}")
    return path


def read_rows(path: str | Path, key: str, *, what: str = "data", suffixes=ROW_SUFFIXES,
              items: str = "objects") -> list:
    """The raw records of a `.json` (one list), `.jsonl` (one value a line, blank lines skipped)
    or `.parquet` (rows as dicts, nulls as None) file; shared by `read_records` and
    `data.read_prompts`, which handles `.txt` itself. `what`, `suffixes` and `items` only word
    the errors.

    Raises:
      FileNotFoundError: no such file.
      ValueError: a suffix not in `suffixes`, invalid JSON (with the line number), or a `.json`
        file whose top level is not a list.
    """
    path = require_file(path, key, what)
    suffix = path.suffix.lower()
    if suffix not in suffixes or suffix not in ROW_SUFFIXES:
        raise ValueError(f"{key}: unsupported {what} file type {suffix!r} "
                         f"(use {', '.join(suffixes[:-1])} or {suffixes[-1]})")
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
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


def _bad(at: str, field: str, problem: str) -> ValueError:
    """`at` names the record: "sft.data: record 3 of a.jsonl" (records count from 0)."""
    return ValueError(f"{at}: {field!r} {problem}")


def _string(value, field: str, at: str) -> str:
    if not isinstance(value, str):
        raise _bad(at, field, f"is {type(value).__name__} {value!r:.60}, not a string")
    if not value.strip():
        raise _bad(at, field, "is empty")
    return value


def _messages(value, field: str, at: str) -> Messages:
    """A non-empty list of {"role", "content"} dicts with a known role and string content."""
    if not isinstance(value, list) or not value:
        raise _bad(at, field, f"is {type(value).__name__} {value!r:.60}, not a "
                   f"{'' if field == 'messages' else 'string or '}non-empty message list")
    for j, m in enumerate(value):
        name = f"{field}[{j}]"
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise _bad(at, name, f"is {m!r:.60}, not a message with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise _bad(at, name, f"has role {m['role']!r}; expected one of {ROLES}")
        if not isinstance(m["content"], str):
            raise _bad(at, name, f"content is {type(m['content']).__name__}, not a string")
    return [dict(m) for m in value]


def _prompt(value, field: str, at: str) -> Messages:
    if isinstance(value, str):
        return [{"role": "user", "content": _string(value, field, at)}]
    msgs = _messages(value, field, at)
    if not any(m["content"].strip() for m in msgs):
        raise _bad(at, field, "has no text: every message's content is empty")
    return msgs


def _split_last(value, field: str, at: str) -> tuple[Messages, str]:
    """(earlier turns, response) of a conversation whose last message is the assistant's."""
    msgs = _messages(value, field, at)
    if msgs[-1]["role"] != "assistant":
        raise _bad(at, field, f"ends with a {msgs[-1]['role']!r} message; the last must be 'assistant'")
    return msgs[:-1], _string(msgs[-1]["content"], f"{field}[{len(msgs) - 1}].content", at)


def _require(record: dict, field: str, at: str):
    if field not in record or record[field] is None:
        raise _bad(at, field, "is missing")
    return record[field]


@dataclass(frozen=True)
class SFTExample:
    """One demonstration: the prompt turns and the assistant response to learn."""

    prompt: Messages
    response: str
    truncated: bool = False  # cut at a length limit: no stop token follows it
    record: int = -1  # index of its record in the data file (from 0), for error messages


def _flag(record: dict, field: str, at: str) -> bool:
    """An optional boolean field (absent / null: False)."""
    value = record.get(field)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(at, field, f"is {type(value).__name__} {value!r:.60}, not true / false")
    return value


def sft_examples(records: list[dict], path, key: str) -> list[SFTExample]:
    """Check and convert SFT rows (TRL `SFTTrainer` prompt-completion / conversational formats).

    A row is `{"prompt": str | Messages, "response": str}` or `{"messages": Messages}` whose last
    message (role "assistant") is the response and whose earlier turns (at least one) the prompt.
    A string prompt becomes one user turn. An optional `"truncated": true` says the response was
    cut at a length limit (a sampled response that hit max_new_tokens): no stop token is appended,
    so the model does not learn to stop there (PPO's rollouts that hit the limit have none either).

    Raises:
      ValueError: (naming `key`, the file, the record index from 0 and the field) a missing
        field, a wrong type, an empty response, a conversation whose last message is not the
        assistant's, a message without role/content, or no records.
    """
    if not records:
        raise ValueError(f"{key}: no records in {path}")
    out = []
    for i, r in enumerate(records):
        at = f"{key}: record {i} of {path}"
        if r.get("messages") is not None:
            if r.get("prompt") is not None or r.get("response") is not None:
                raise _bad(at, "messages", "comes with 'prompt'/'response'; use one form")
            prompt, response = _split_last(r["messages"], "messages", at)
            if not prompt:
                raise _bad(at, "messages", "has no turn before the assistant response")
        else:
            prompt = _prompt(_require(r, "prompt", at), "prompt", at)
            response = _string(_require(r, "response", at), "response", at)
        out.append(SFTExample(prompt, response, _flag(r, "truncated", at), record=i))
    return out


@dataclass(frozen=True)
class PreferencePair:
    """One comparison: `chosen` is preferred over `rejected` as the answer to `prompt`; `margin`
    (0 when the row has none) is Llama-2's preference margin, `-log sigmoid(r_c - r_r - margin)`."""

    prompt: Messages
    chosen: str
    rejected: str
    margin: float
    chosen_truncated: bool = False  # cut at a length limit: no stop token follows it
    rejected_truncated: bool = False
    record: int = -1  # index of its record in the data file (from 0), for error messages


def _response(value, field: str, at: str) -> str:
    """A response given next to an explicit prompt: a string or exactly [assistant message]."""
    if isinstance(value, str):
        return _string(value, field, at)
    earlier, response = _split_last(value, field, at)
    if earlier:
        raise _bad(at, field, "holds earlier turns next to a 'prompt'; give only the assistant message")
    return response


def _margin(record: dict, at: str) -> float:
    value = record.get("margin")
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(at, "margin", f"is {type(value).__name__} {value!r:.60}, not a finite number")
    return float(value)


def _pair(r: dict, at: str) -> PreferencePair:
    chosen, rejected = _require(r, "chosen", at), _require(r, "rejected", at)
    cut = (_flag(r, "chosen_truncated", at), _flag(r, "rejected_truncated", at))
    if r.get("prompt") is not None:
        prompt = _prompt(r["prompt"], "prompt", at)
        return PreferencePair(prompt, _response(chosen, "chosen", at),
                              _response(rejected, "rejected", at), _margin(r, at), *cut)
    for field, value in (("chosen", chosen), ("rejected", rejected)):
        if isinstance(value, str):
            raise _bad(at, field, "is a string but the row has no 'prompt' (the implicit-prompt "
                                  "form needs message lists)")
    prompt, chosen = _split_last(chosen, "chosen", at)
    rejected_prompt, rejected = _split_last(rejected, "rejected", at)
    if prompt != rejected_prompt:
        raise _bad(at, "rejected", "turns before the response differ from 'chosen''s (the implicit prompt)")
    if not prompt:
        raise _bad(at, "chosen", "has no turn before the assistant response (no prompt)")
    return PreferencePair(prompt, chosen, rejected, _margin(r, at), *cut)


def preference_pairs(records: list[dict], path, key: str) -> tuple[list[PreferencePair], int]:
    """Check and convert preference rows (TRL `RewardTrainer` explicit / implicit-prompt formats).

    A row is `{"prompt": str | Messages, "chosen": str | [assistant msg], "rejected": ...,
    "margin": optional number, "chosen_truncated" / "rejected_truncated": optional booleans
    (the response was cut at a length limit: no stop token appended)}`, or without "prompt" `chosen` / `rejected` are whole
    conversations ending with the assistant message whose earlier turns (equal in both) are the
    prompt. Pairs with chosen == rejected teach nothing: they are dropped, counted and warned about.

    Returns:
      (pairs, number of identical pairs skipped).
    Raises:
      ValueError: (naming `key`, the file, the record index from 0 and the field) a missing
        chosen/rejected/prompt, a wrong type, an empty response, a bad last message, implicit
        prompts that differ, a non-numeric margin; no records or no pair left.
    """
    if not records:
        raise ValueError(f"{key}: no records in {path}")
    pairs = [dataclasses.replace(_pair(r, f"{key}: record {i} of {path}"), record=i)
             for i, r in enumerate(records)]
    kept = [p for p in pairs if (p.chosen, p.chosen_truncated) != (p.rejected, p.rejected_truncated)]
    skipped = len(pairs) - len(kept)
    if skipped:
        warnings.warn(f"{key}: skipped {skipped} pair(s) of {path} whose chosen == rejected", stacklevel=2)
    if not kept:
        raise ValueError(f"{key}: every pair of {path} has chosen == rejected")
    return kept, skipped


def encode_prompt(tokenizer, prompt: Messages, *, use_chat_template: bool,
                  system_prompt: str | None) -> list[int]:
    """Prompt token ids, the same PPO's prompts get (`data.apply_template` calls this).

    With `use_chat_template` and a tokenizer that has a template: the template with
    `add_generation_prompt=True`, `system_prompt` prepended as a system turn when given and the
    messages have none, tokenised without extra special tokens. Otherwise
    `tokenizer("\\n".join(contents))` of every message in order (`system_prompt` unused, as in PPO).
    """
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [dict(m) for m in prompt]
        if system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system_prompt})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n".join(m["content"] for m in prompt))["input_ids"])


def encode_response(tokenizer, response: str, eos_id: int, truncated: bool = False) -> list[int]:
    """`tokenizer(response, add_special_tokens=False)` ids + `[eos_id]`: the sampler's responses
    end with the stop token, so SFT teaches stopping and the reward model scores what PPO feeds it.
    A `truncated` response (cut at a length limit, as a rollout that hits max_new_tokens) gets no
    stop token."""
    ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
    return ids if truncated else ids + [int(eos_id)]


@dataclass
class SequenceBatch:
    """Prompt + response rows, right-padded.

    Attributes:
      ids: [N, L] int32, right-padded with the pad id.
      attention_mask: [N, L] int32, 1 on real tokens (prompt and response). The last real token
        of row n (where a reward model reads its score) is `attention_mask[n].sum() - 1`.
      loss_mask: [N, L] int32, 1 on response tokens (EOS included): the targets of SFT's
        next-token loss, `ids[:, t]` predicted at position t - 1.
    """

    ids: np.ndarray
    attention_mask: np.ndarray
    loss_mask: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


Row = tuple[list[int], list[int]]


def truncate_rows(rows: list[Row], *, max_prompt_length: int, max_length: int,
                  what: str = "example", truncation: str = "left",
                  records: list[int] | None = None) -> tuple[list[Row], dict]:
    """Fit (prompt_ids, response_ids) rows: a prompt keeps its LAST `max_prompt_length` tokens
    (left truncation, as PPO's prompts), then a row longer than `max_length` loses response
    tokens from the right (DeepSpeed-Chat steps 1-2 also cut the joined sequence on the right).
    `truncation="error"` (`data.truncation`) refuses a longer prompt instead. `records[i]` is row
    i's record index in its file (default i), the number error messages give.

    Returns:
      (rows, {"prompts_truncated": n, "responses_truncated": n}); no warnings.
    Raises:
      ValueError: max_prompt_length >= max_length (no room for a response), a row with an
        empty prompt or response, or a longer prompt under truncation="error" (names `what`
        and the record).
    """
    if not 0 < max_prompt_length < max_length:
        raise ValueError(f"max_prompt_length={max_prompt_length} must be in [1, max_length="
                         f"{max_length}): a row needs room for a response")
    out, counts = [], {"prompts_truncated": 0, "responses_truncated": 0}
    for i, (p, r) in enumerate(rows):
        name = f"{what} of record {records[i] if records is not None else i}"
        if not p or not r:
            raise ValueError(f"{name} has an empty {'prompt' if not p else 'response'}")
        if len(p) > max_prompt_length:
            if truncation == "error":
                raise ValueError(f"{name}: its prompt of {len(p)} tokens is longer than "
                                 f"data.max_prompt_length={max_prompt_length} "
                                 "(data.truncation='error')")
            p = p[-max_prompt_length:]
            counts["prompts_truncated"] += 1
        if len(p) + len(r) > max_length:
            r = r[:max_length - len(p)]
            counts["responses_truncated"] += 1
        out.append((list(p), list(r)))
    return out, counts


def pad_rows(rows: list[Row], width: int, pad_id: int) -> SequenceBatch:
    """Right-pad prompt + response rows to `width`. Raises ValueError: a row is wider."""
    n = len(rows)
    ids = np.full((n, width), pad_id, dtype=np.int32)
    attention, loss = np.zeros((n, width), np.int32), np.zeros((n, width), np.int32)
    for i, (p, r) in enumerate(rows):
        if len(p) + len(r) > width:
            raise ValueError(f"row {i} has {len(p) + len(r)} tokens, more than the width {width}")
        ids[i, :len(p) + len(r)] = p + r
        attention[i, :len(p) + len(r)] = 1
        loss[i, len(p):len(p) + len(r)] = 1
    return SequenceBatch(ids, attention, loss)


def _warn_truncation(counts: dict, what: str, max_prompt_length: int, max_length: int) -> None:
    if counts.get("prompts_truncated"):
        warnings.warn(f"{counts['prompts_truncated']} {what}(s) had a prompt longer than "
                      f"max_prompt_length={max_prompt_length}, truncated from the left", stacklevel=3)
    for name, tokens in (("responses", "response"), ("chosen", "chosen"), ("rejected", "rejected")):
        if counts.get(f"{name}_truncated"):
            warnings.warn(f"{counts[f'{name}_truncated']} {what}(s) longer than max_length="
                          f"{max_length} lost {tokens} tokens from the right", stacklevel=3)


def pack(pairs_of_ids: list[Row], *, max_prompt_length: int, max_length: int, pad_id: int,
         width: int | None = None, what: str = "example", truncation: str = "left",
         records: list[int] | None = None) -> tuple[SequenceBatch, dict]:
    """(prompt_ids, response_ids) rows -> a right-padded `SequenceBatch` of width
    `L = width or min(max_length, longest row)`, truncated as in `truncate_rows` with one
    warning per kind of truncation that happened.

    Returns:
      (batch, {"prompts_truncated": n, "responses_truncated": n}).
    Raises:
      ValueError: see `truncate_rows`; `width` narrower than the longest truncated row.
    """
    rows, counts = truncate_rows(pairs_of_ids, max_prompt_length=max_prompt_length,
                                 max_length=max_length, what=what, truncation=truncation,
                                 records=records)
    _warn_truncation(counts, what, max_prompt_length, max_length)
    width = width or max((len(p) + len(r) for p, r in rows), default=1)
    return pad_rows(rows, width, pad_id), counts


def tokenize_sft(examples: list[SFTExample], tokenizer, *, max_prompt_length: int, max_length: int,
                 use_chat_template: bool = True, system_prompt: str | None = None, eos_id: int,
                 pad_id: int, eos_after_truncated: bool = False,
                 truncation: str = "left") -> tuple[SequenceBatch, dict]:
    """Encode (`encode_prompt`, `encode_response`) and `pack` SFT examples: [N, L] rows whose
    loss mask is the response + EOS (TRL's completion-only loss); a `truncated` row gets no EOS
    unless `eos_after_truncated`. Raises ValueError: see `pack`."""
    rows = [(encode_prompt(tokenizer, e.prompt, use_chat_template=use_chat_template,
                           system_prompt=system_prompt),
             encode_response(tokenizer, e.response, eos_id, e.truncated and not eos_after_truncated))
            for e in examples]
    return pack(rows, max_prompt_length=max_prompt_length, max_length=max_length, pad_id=pad_id,
                truncation=truncation, records=[e.record for e in examples])


@dataclass
class PairBatch:
    """Tokenised preference pairs: row n of `chosen` and of `rejected` share the prompt.

    Attributes:
      chosen, rejected: `SequenceBatch`es of the SAME shape [N, L].
      margin: [N] float32, 0 where the row had none.
    """

    chosen: SequenceBatch
    rejected: SequenceBatch
    margin: np.ndarray

    def __len__(self) -> int:
        return len(self.margin)


def tokenize_pairs(pairs: list[PreferencePair], tokenizer, *, max_prompt_length: int, max_length: int,
                   use_chat_template: bool = True, system_prompt: str | None = None, eos_id: int,
                   pad_id: int, eos_after_truncated: bool = False,
                   truncation: str = "left") -> tuple[PairBatch, dict]:
    """Encode and pack preference pairs, chosen and rejected to one width (DeepSpeed-Chat step 2
    batches them together). Truncation as in `truncate_rows`, one warning per kind. A response
    flagged truncated gets no EOS unless `eos_after_truncated` (then every row ends in EOS, the
    position a PPO run with `reward.eos_at_end` reads).

    Returns:
      (batch, {"prompts_truncated", "chosen_truncated", "rejected_truncated": pair counts,
       "identical_after_truncation": pairs whose two rows have the same tokens (different
       strings that tokenise alike, or rows cut to the same tokens): dropped, with a warning}).
    Raises:
      ValueError: see `truncate_rows`; every pair has identical chosen and rejected tokens.
    """
    limits = dict(max_prompt_length=max_prompt_length, max_length=max_length, what="pair",
                  truncation=truncation, records=[p.record for p in pairs])
    prompts = [encode_prompt(tokenizer, p.prompt, use_chat_template=use_chat_template,
                             system_prompt=system_prompt) for p in pairs]
    chosen, c = truncate_rows([(q, encode_response(tokenizer, p.chosen, eos_id, p.chosen_truncated and not eos_after_truncated))
                               for q, p in zip(prompts, pairs)], **limits)
    rejected, r = truncate_rows([(q, encode_response(tokenizer, p.rejected, eos_id,
                                                    p.rejected_truncated and not eos_after_truncated))
                                 for q, p in zip(prompts, pairs)], **limits)
    keep = [i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b]
    counts = {"prompts_truncated": c["prompts_truncated"], "chosen_truncated": c["responses_truncated"],
              "rejected_truncated": r["responses_truncated"],
              "identical_after_truncation": len(pairs) - len(keep)}
    _warn_truncation(counts, "pair", max_prompt_length, max_length)
    if counts["identical_after_truncation"]:
        if not keep:
            raise ValueError(f"every pair has identical chosen and rejected tokens after "
                             f"tokenisation and truncation to max_length={max_length}")
        warnings.warn(f"skipped {counts['identical_after_truncation']} pair(s) whose chosen and "
                      "rejected are identical tokens after tokenisation and truncation to "
                      f"max_length={max_length}", stacklevel=2)
    chosen, rejected = [chosen[i] for i in keep], [rejected[i] for i in keep]
    width = max((len(p) + len(q) for p, q in chosen + rejected), default=1)
    margin = np.asarray([pairs[i].margin for i in keep], dtype=np.float32)
    return PairBatch(pad_rows(chosen, width, pad_id), pad_rows(rejected, width, pad_id), margin), counts


def split_holdout(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic (train_idx, eval_idx) split of range(n), each sorted int64.

    eval gets round(fraction * n) rows, at least 1 when fraction > 0 and n >= 2, none when
    fraction == 0; the rows are drawn by `np.random.default_rng(seed).permutation(n)`.

    Raises:
      ValueError: fraction outside [0, 1), or no row left for training.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"eval fraction {fraction} must be in [0, 1)")
    n_eval = round(fraction * n)
    if fraction > 0 and n >= 2:
        n_eval = max(n_eval, 1)
    if n - n_eval < 1:
        raise ValueError(f"{n} row(s) with an eval fraction of {fraction} leave none for training")
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n_eval:]).astype(np.int64), np.sort(order[:n_eval]).astype(np.int64)


def take(batch, idx):
    """Rows `idx` (numpy fancy indexing) of a `SequenceBatch`, `PairBatch`, array, or dict of
    these; the same type back. Raises TypeError for anything else."""
    if isinstance(batch, SequenceBatch):
        return SequenceBatch(batch.ids[idx], batch.attention_mask[idx], batch.loss_mask[idx])
    if isinstance(batch, PairBatch):
        return PairBatch(take(batch.chosen, idx), take(batch.rejected, idx), batch.margin[idx])
    if isinstance(batch, dict):
        return {k: take(v, idx) for k, v in batch.items()}
    if isinstance(batch, np.ndarray):
        return batch[idx]
    raise TypeError(f"take: cannot index a {type(batch).__name__}")
