"""Synthetic multiplication problems with a held-out split that never meets the training split
(the calculator environment's measurement; `scripts/make_arithmetic_prompts.py` writes them as
.jsonl prompt files, read with `data.prompts` / `eval.prompts`).

The problem space is every `a * b` with `a` of `digits[0]` digits and `b` of `digits[1]`
digits (2 x 3 digits: 90 x 900 = 81,000 problems). Each problem belongs to one split by a hash
of its unordered operand pair (`split_of`): about one in `held_out_every` is held out, the rest
is training. The partition does not depend on the seed or on `n`, so any training set and any
held-out set are disjoint, whatever seeds drew them; `12 * 34` and `34 * 12` share a split.
A seed draws `n` distinct problems of one split.
"""

from __future__ import annotations

import hashlib
import random
from typing import Literal

SPLITS = ("train", "held_out")
Split = Literal[SPLITS]
TASK_NAME = "multiplication"


def split_of(a: int, b: int, held_out_every: int = 10) -> str:
    """"held_out" for about one problem in `held_out_every` (a hash of the unordered pair
    {a, b}: stable across runs, machines and Python versions), else "train"."""
    lo, hi = sorted((a, b))
    digest = hashlib.blake2b(f"{lo}*{hi}".encode(), digest_size=8).digest()
    return "held_out" if int.from_bytes(digest, "big") % held_out_every == 0 else "train"


def _operand_range(digits: int) -> range:
    if not isinstance(digits, int) or digits < 1:
        raise ValueError(f"digits must be positive ints, got {digits!r}")
    return range(1 if digits == 1 else 10 ** (digits - 1), 10 ** digits)


def multiplication_records(n: int, *, digits: tuple[int, int] = (2, 3), seed: int = 0,
                           split: Split = "train", held_out_every: int = 10,
                           instruction: str = "", max_tries: int = 50) -> list[dict]:
    """`n` distinct multiplication problems of one split, drawn by `seed`.

    Args:
      n: how many records.
      digits: the digits of the two operands; `(2, 3)` gives problems such as 47 * 382.
      seed: the draw's seed; a problem's split does not depend on it.
      split: "train" or "held_out", disjoint by construction.
      held_out_every: about one problem in this many is held out.
      instruction: text appended to every prompt after a newline ("" for none: the calculator
        environment appends its own).
      max_tries: draws allowed per record before giving up.

    Returns:
      `[{"prompt": "What is 47 * 382?", "answer": "17954"}, ...]` (`answer` a string, as
      reasoning-gym records and math_verify read it).

    Raises:
      ValueError: an unknown split, bad digits, `held_out_every` < 2, or fewer than `n`
        distinct problems found in `n * max_tries` draws (the split is too small for `n`).
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; known: {', '.join(SPLITS)}")
    if held_out_every < 2:
        raise ValueError(f"held_out_every={held_out_every} must be >= 2 (else nothing trains)")
    left, right = (_operand_range(d) for d in digits)
    rng, seen, out = random.Random(seed), set(), []
    for _ in range(n * max_tries):
        if len(out) == n:
            break
        a, b = rng.choice(left), rng.choice(right)
        if (a, b) in seen or split_of(a, b, held_out_every) != split:
            continue
        seen.add((a, b))
        prompt = f"What is {a} * {b}?" + (f"\n{instruction}" if instruction else "")
        out.append({"prompt": prompt, "answer": str(a * b)})
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct {split} problems of {digits[0]} x "
                         f"{digits[1]} digits in {n * max_tries} draws; ask for fewer than {n}"
                         " or more digits")
    return out
