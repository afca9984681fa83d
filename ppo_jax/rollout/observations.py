"""An environment's text as observation tokens for a chat model (`rollout.turns`).

In a chat, what follows the assistant's words before its next turn is the template's: the end of
the assistant's turn, the header of the next role, its text, its end, the header of the next
assistant turn. For SmolLM2's ChatML:

    <|im_end|>\\n<|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n

`observation_tokens` reads these pieces from the tokenizer's own `apply_chat_template` (the
3-message conversation user / assistant / observation, split at the assistant's text and at the
observation's), never from hard-coded strings, so a Qwen or Llama template gives its own.
"""

from __future__ import annotations

from typing import Literal

OBSERVATION_ROLES = ("user", "tool")  # the roles an observation may take (`env.observation_role`)
ObservationRole = Literal[OBSERVATION_ROLES]
_ASSISTANT = "ASSISTANT_TEXT_5f0c"  # stand-ins that no template changes
_OBSERVATION = "OBSERVATION_TEXT_5f0c"


def observation_frame(tokenizer, role: str = "user") -> tuple[str, str]:
    """`(before, after)`: the template's text between the end of the assistant's words and an
    observation of `role`, and between the observation and the next assistant turn's first
    token. A tokenizer without a chat template: `("\\n", "\\n")` (plain text on its own line).

    Raises:
      ValueError: a role not in `OBSERVATION_ROLES`; the template refuses the role, or does not
        render the messages' text verbatim.
    """
    if role not in OBSERVATION_ROLES:
        raise ValueError(f"role={role!r}: an observation is one of {list(OBSERVATION_ROLES)}")
    if not getattr(tokenizer, "chat_template", None):
        return "\n", "\n"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _ASSISTANT},
                {"role": role, "content": _OBSERVATION}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:  # jinja's TemplateError, or a template's raise_exception
        raise ValueError(f"the chat template refuses an observation of role {role!r}: "
                         f"{type(e).__name__}: {e}") from None
    two = tokenizer.apply_chat_template(messages[:2], tokenize=False)
    if _ASSISTANT not in text or _OBSERVATION not in text or _ASSISTANT not in two:
        raise ValueError("the chat template does not render the messages' text verbatim; "
                         "observation_frame cannot find where the observation goes")
    tail = text[text.index(_ASSISTANT) + len(_ASSISTANT):]
    before, _, after = tail.partition(_OBSERVATION)
    return before, after


def observation_tokens(tokenizer, text: str, *, role: str = "user",
                       max_tokens: int) -> list[int]:
    """The ids of an observation: the template's frame (`observation_frame`) around `text`.

    The ids are the frame's and the text's, each tokenized alone (no special tokens added), so
    a cut keeps the frame whole: `text` is cut to `max_tokens` minus the frame's length, and the
    result has at most `max_tokens` ids. The frame opens with the end of the assistant's turn
    (ChatML's `<|im_end|>`): right for a turn that ended on a stop sequence such as `</calc>`;
    after a turn that ended on the end-of-turn token itself, drop that first id (`ids[1:]`).

    Args:
      tokenizer: a transformers tokenizer (its `chat_template`, if any, and `encode`).
      text: the environment's reply; role: "user" or "tool" (any role the template accepts).
      max_tokens: the most ids returned (>= the frame's length).
    Raises:
      ValueError: max_tokens is not an int or below the frame's length; `observation_frame`'s.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise ValueError(f"max_tokens={max_tokens!r} must be an int")
    before, after = observation_frame(tokenizer, role)
    head, tail = (tokenizer.encode(s, add_special_tokens=False) for s in (before, after))
    room = max_tokens - len(head) - len(tail)
    if room < 0:
        raise ValueError(f"max_tokens={max_tokens} is below the {len(head) + len(tail)} ids of "
                         f"the template's frame around a {role!r} observation")
    return head + tokenizer.encode(text, add_special_tokens=False)[:room] + tail
