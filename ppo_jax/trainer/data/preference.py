"""Stage 2's data: preference pairs in TRL `RewardTrainer`'s formats (`{"prompt", "chosen",
"rejected"}`, or the implicit-prompt form where `chosen` / `rejected` are whole conversations),
checked (`preference_pairs`) and tokenised into chosen and rejected rows of one width
(`tokenize_pairs`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

import numpy as np

from ppo_jax.trainer.data.token_rows import (
    PairBatch, encode_prompt, encode_response, pad_rows, truncate_rows, warn_truncation,
)
from ppo_jax.trainer.data.records import (
    Messages, field_error, flag_field, prompt_field, required_field, split_last, text_field,
)


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
        return text_field(value, field, at)
    earlier, response = split_last(value, field, at)
    if earlier:
        raise field_error(at, field, "holds earlier turns next to a 'prompt'; give only the assistant message")
    return response


def _margin(record: dict, at: str) -> float:
    value = record.get("margin")
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise field_error(at, "margin", f"is {type(value).__name__} {value!r:.60}, not a finite number")
    return float(value)


def _pair(r: dict, at: str) -> PreferencePair:
    chosen, rejected = required_field(r, "chosen", at), required_field(r, "rejected", at)
    cut = (flag_field(r, "chosen_truncated", at), flag_field(r, "rejected_truncated", at))
    if r.get("prompt") is not None:
        prompt = prompt_field(r["prompt"], "prompt", at)
        return PreferencePair(prompt, _response(chosen, "chosen", at),
                              _response(rejected, "rejected", at), _margin(r, at), *cut)
    for field, value in (("chosen", chosen), ("rejected", rejected)):
        if isinstance(value, str):
            raise field_error(at, field, "is a string but the row has no 'prompt' (the implicit-prompt "
                                  "form needs message lists)")
    prompt, chosen = split_last(chosen, "chosen", at)
    rejected_prompt, rejected = split_last(rejected, "rejected", at)
    if prompt != rejected_prompt:
        raise field_error(at, "rejected", "turns before the response differ from 'chosen''s (the implicit prompt)")
    if not prompt:
        raise field_error(at, "chosen", "has no turn before the assistant response (no prompt)")
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


def tokenize_pairs(pairs: list[PreferencePair], tokenizer, *, max_prompt_length: int, max_length: int,
                   use_chat_template: bool = True, system_prompt: str | None = None, eos_id: int,
                   pad_id: int, eos_after_truncated: bool = False,
                   truncation: str = "left") -> tuple[PairBatch, dict]:
    """Encode and right-pad preference pairs, chosen and rejected to one width (DeepSpeed-Chat
    step 2 batches them together). Truncation as in `truncate_rows`, one warning per kind. A response
    flagged truncated gets no EOS unless `eos_after_truncated` (then every row ends in EOS, the
    position a PPO run with `reward.eos_at_end` reads).

    Returns:
      `(batch, counts)`. `counts` maps "prompts_truncated", "chosen_truncated" and
      "rejected_truncated" to pair counts, and "identical_after_truncation" to the number of
      pairs dropped, with a warning, because their two rows have the same tokens: different
      strings that tokenise alike, or rows cut to the same tokens.
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
    warn_truncation(counts, "pair", max_prompt_length, max_length)
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
