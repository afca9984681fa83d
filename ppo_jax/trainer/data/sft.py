"""Stage 1's data: demonstrations in TRL `SFTTrainer`'s formats (`{"prompt", "response"}` or
`{"messages"}`, the last message the assistant's response: the completion-only loss), checked
(`sft_examples`) and tokenised into right-padded rows whose loss mask is the response
(`tokenize_sft`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ppo_jax.trainer.data.records import (
    Messages, field_error, flag_field, prompt_field, required_field, split_last, text_field,
)
from ppo_jax.trainer.data.token_rows import (
    SequenceBatch, encode_prompt, encode_response, padded_rows,
)


@dataclass(frozen=True)
class SFTExample:
    """One demonstration: the prompt turns and the assistant response to learn."""

    prompt: Messages
    response: str
    truncated: bool = False  # cut at a length limit: no stop token follows it
    record: int = -1  # index of its record in the data file (from 0), for error messages


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
                raise field_error(at, "messages", "comes with 'prompt'/'response'; use one form")
            prompt, response = split_last(r["messages"], "messages", at)
            if not prompt:
                raise field_error(at, "messages", "has no turn before the assistant response")
        else:
            prompt = prompt_field(required_field(r, "prompt", at), "prompt", at)
            response = text_field(required_field(r, "response", at), "response", at)
        out.append(SFTExample(prompt, response, flag_field(r, "truncated", at), record=i))
    return out


def tokenize_sft(examples: list[SFTExample], tokenizer, *, max_prompt_length: int, max_length: int,
                 use_chat_template: bool = True, system_prompt: str | None = None, eos_id: int,
                 pad_id: int, eos_after_truncated: bool = False,
                 truncation: str = "left") -> tuple[SequenceBatch, dict]:
    """Encode (`encode_prompt`, `encode_response`) and right-pad (`padded_rows`) SFT examples:
    [N, L] rows whose loss mask is the response + EOS (TRL's completion-only loss); a
    `truncated` row gets no EOS unless `eos_after_truncated`. Raises ValueError: see
    `padded_rows`."""
    rows = [(encode_prompt(tokenizer, e.prompt, use_chat_template=use_chat_template,
                           system_prompt=system_prompt),
             encode_response(tokenizer, e.response, eos_id, e.truncated and not eos_after_truncated))
            for e in examples]
    return padded_rows(rows, max_prompt_length=max_prompt_length, max_length=max_length,
                       pad_id=pad_id, truncation=truncation, records=[e.record for e in examples])
