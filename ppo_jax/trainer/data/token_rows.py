"""Token rows of stages 1 and 2: a prompt encoded as PPO encodes it, a response plus the stop
token the sampler ends on, each row prompt + response truncated and right-padded into a
`SequenceBatch` (DeepSpeed-Chat steps 1 and 2); `PairBatch` holds the chosen and rejected rows
of preference pairs. `split_holdout` and `take` select rows of either. (Packing several
sequences into one row, `<stage>.packing`, happens per micro-batch: `rollout.packing`.)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from ppo_jax.trainer.data.records import Messages


def encode_prompt(tokenizer, prompt: Messages, *, use_chat_template: bool,
                  system_prompt: str | None, response_prefix: str | None = None) -> list[int]:
    """Prompt token ids, the same PPO's prompts get (`data.prompts.apply_template` calls this).

    With `use_chat_template` and a tokenizer that has a template: the template with
    `add_generation_prompt=True`, `system_prompt` prepended as a system turn when given and the
    messages have none, tokenised without extra special tokens. Otherwise the contents of every
    message, in order and joined by newlines, are tokenised; `system_prompt` is unused there, as
    in PPO.
    `response_prefix` (`data.response_prefix`) is appended to the text before tokenising: the
    start of the assistant's answer (e.g. "<answer>").
    """
    prefix = response_prefix or ""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [dict(m) for m in prompt]
        if system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system_prompt})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text + prefix, add_special_tokens=False)["input_ids"])
    return list(tokenizer("\n".join(m["content"] for m in prompt) + prefix)["input_ids"])


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


def warn_truncation(counts: dict, what: str, max_prompt_length: int, max_length: int) -> None:
    if counts.get("prompts_truncated"):
        warnings.warn(f"{counts['prompts_truncated']} {what}(s) had a prompt longer than "
                      f"max_prompt_length={max_prompt_length}, truncated from the left", stacklevel=3)
    for name, tokens in (("responses", "response"), ("chosen", "chosen"), ("rejected", "rejected")):
        if counts.get(f"{name}_truncated"):
            warnings.warn(f"{counts[f'{name}_truncated']} {what}(s) longer than max_length="
                          f"{max_length} lost {tokens} tokens from the right", stacklevel=3)


def padded_rows(pairs_of_ids: list[Row], *, max_prompt_length: int, max_length: int,
                pad_id: int, width: int | None = None, what: str = "example",
                truncation: str = "left", records: list[int] | None = None
                ) -> tuple[SequenceBatch, dict]:
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
    warn_truncation(counts, what, max_prompt_length, max_length)
    width = width or max((len(p) + len(r) for p, r in rows), default=1)
    return pad_rows(rows, width, pad_id), counts


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
