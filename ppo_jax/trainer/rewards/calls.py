"""Calling a reward function and checking what it returns: one finite number per response,
in "score" and in every component, within `reward.timeout_s`; and the load-time probe on
placeholder responses.

Messages say what the function did, not which function or when: the config checks add the
name (a ConfigError at load), the PPO trainer adds the name and the step (a UserCodeError
mid-run).
"""

from __future__ import annotations

import functools
import inspect
import signal
import sysconfig
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from ppo_jax.trainer.rewards.deadline import Expired, call_with_deadline

RewardFunction = Callable[[list[str], list[str]], np.ndarray]
PROBE_RESPONSES = ("", "0")  # the load-time probe's responses: a verifier parses them, as wrong
PROBE_ROWS = 2  # prompt records the probe answers (each with every PROBE_RESPONSES)


class RewardFunctionError(ValueError):
    """A reward function's call failed: it raised, ran past `reward.timeout_s`, or returned
    something that is not one finite number per response. The message says what it did ("raised
    ...", "did not return within ...", "returned ..." with the type, shape and a short repr, or
    the row of a non-finite value); the caller adds which function and when."""


def takes_rows(fn: Callable) -> bool:
    """Whether `fn` accepts the `rows` keyword, or any keyword."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "rows" or p.kind is p.VAR_KEYWORD for p in params)


def reward_output(out, n: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """`(scores [n] float32, components {name: [n] float32})` of a reward function's result:
    an array of n scores, or a dict with "score" and components. Only bools, ints and floats are
    numbers; strings (even of digits), None and other objects are refused.

    Raises:
      RewardFunctionError: a dict without "score", or an entry that is not n numbers, naming the
        entry and showing what came back.
    """
    parts = dict(out) if isinstance(out, dict) else {"score": out}
    if "score" not in parts:
        raise RewardFunctionError(f"returned a dict without a 'score' entry (its keys: "
                                  f"{sorted(map(str, parts))})")
    arrays = {k: _numbers(k, v, n) for k, v in parts.items()}
    return arrays.pop("score"), arrays


def _numbers(field: str, value: Any, n: int) -> np.ndarray:
    """`value` as `[n]` float32, or a RewardFunctionError naming `field` and what it was."""
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):  # ragged lists
        array = np.asarray(None)
    if array.dtype.kind not in "biuf":
        raise RewardFunctionError(f"returned {_short(value)} for {field!r}; it must be {n} "
                                  "numbers, one per response")
    if array.shape != (n,):
        raise RewardFunctionError(
            f"returned {_short(value)} for {field!r}, of shape {array.shape} for {n} "
            f"responses; it must be [{n}], one number per response")
    with np.errstate(over="ignore"):
        out = array.astype(np.float32)
    over = np.flatnonzero(np.isfinite(array) & ~np.isfinite(out))
    if over.size:  # finite as given, inf in the trainer's float32
        raise RewardFunctionError(f"returned {float(array[over[0]])!r} for {field!r} in row "
                                  f"{int(over[0])}, beyond float32's range (+-3.4e38)")
    return out


def check_finite(scores: np.ndarray, components: dict[str, np.ndarray], prompts: list[str],
                 responses: list[str]) -> None:
    """Refuse a non-finite score or component in a batch.

    Raises:
      RewardFunctionError: naming the entry, the value and the first row holding one (from 0),
        with the start of its prompt and response.
    """
    for field, values in {"score": scores, **components}.items():
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            i = int(bad[0])
            prompt = prompts[i] if i < len(prompts) else ""
            raise RewardFunctionError(
                f"returned a non-finite {field!r}, {values[i]}, for row {i} of {len(values)} "
                f"(prompt {prompt[:40]!r}, response {responses[i][:40]!r})"
                + (f" and {bad.size - 1} more" if bad.size > 1 else ""))


def call_reward_function(reward_fn: RewardFunction, prompts: list[str], responses: list[str],
                         rows: Optional[list[dict]] = None
                         ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """`reward_fn` on `responses` `[n]` to `prompts` `[n]`, its result checked. `rows`, the
    prompt records, go to a function that takes them (`[{}] * n` when None). The function gets
    copies of its inputs.

    Returns:
      `(scores [n] float32, components {name: [n] float32})`, all finite.

    Raises:
      RewardFunctionError: the function raised (any exception, SystemExit included, and a
        KeyboardInterrupt where Ctrl-C does not raise one), naming the type, message and where it
        was raised; ran past its time limit; or returned what `reward_output` and `check_finite`
        refuse.
      KeyboardInterrupt: a real Ctrl-C, outside the trainer's stop handling.
    """
    n = len(responses)
    rows = [dict(r) for r in rows] if rows is not None else [{} for _ in prompts]
    try:  # on copies: a function that edits its inputs changes neither the check nor the logs
        if takes_rows(reward_fn):
            out = reward_fn(list(prompts), list(responses), rows=rows)
        else:
            out = reward_fn(list(prompts), list(responses))
    except RewardFunctionError:  # `with_timeout`'s, said already
        raise
    except BaseException as e:  # noqa: BLE001 - any failure of the user's function, sys.exit
        # included (SystemExit(0) would otherwise end a failed run with exit 0), is reported
        if isinstance(e, KeyboardInterrupt) and _ctrl_c_raises():
            raise  # a real Ctrl-C, outside the trainer's stop handling
        raise RewardFunctionError(f"raised {type(e).__name__}: {_clip(str(e), 300)}"
                                  f"{_where(e)}") from e
    scores, components = reward_output(out, n)
    check_finite(scores, components, prompts, responses)
    return scores, components


def _ctrl_c_raises() -> bool:
    """Whether Ctrl-C raises KeyboardInterrupt now. Inside `StageTrainer.train` it does not
    (the first Ctrl-C asks for a stop, a second kills the process), so a KeyboardInterrupt there
    is the function's own."""
    return signal.getsignal(signal.SIGINT) is signal.default_int_handler


def with_timeout(reward_fn: RewardFunction, timeout_s: Optional[float]) -> RewardFunction:
    """`reward_fn` stopped after `timeout_s` seconds a call; None means no limit and returns
    `reward_fn` itself. The watchdog runs in the calling thread because math-verify's own timeouts
    need the main thread. The signature stays `reward_fn`'s, so `takes_rows` sees the same.

    Raises (on a call):
      RewardFunctionError: the call did not return within `timeout_s`.
    """
    if timeout_s is None:
        return reward_fn

    @functools.wraps(reward_fn)
    def timed(*args, **kwargs):
        try:
            return call_with_deadline(lambda: reward_fn(*args, **kwargs), timeout_s)
        except Expired:
            raise RewardFunctionError(f"did not return within reward.timeout_s={timeout_s:g} "
                                      "s") from None

    return timed


def probe_reward_function(reward_fn: RewardFunction, prompts: list[str], rows: list[dict], *,
                          prefix: str = "") -> None:
    """Call `reward_fn` once as training will, before any model loads: the first `PROBE_ROWS`
    prompts, each answered with every placeholder of `PROBE_RESPONSES` behind `prefix`
    (`data.response_prefix`). The placeholders need not be right, only parseable.

    Raises:
      RewardFunctionError: as `call_reward_function`.
    """
    picked = [i for i in range(min(PROBE_ROWS, len(prompts))) for _ in PROBE_RESPONSES]
    responses = [prefix + r for _ in range(min(PROBE_ROWS, len(prompts)))
                 for r in PROBE_RESPONSES]
    call_reward_function(reward_fn, [prompts[i] for i in picked], responses,
                         [rows[i] for i in picked] if rows else None)


def _short(value: Any) -> str:
    """What came back, in a few words: None, or its type and repr (`list ['a', 'b']`)."""
    return "None" if value is None else _clip(f"{type(value).__name__} {value!r}", 80)


def _clip(text: str, limit: int) -> str:
    """`text` on one line, cut to `limit` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


_LIBRARIES = (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"])


def _where(error: BaseException) -> str:
    """` (file.py:12, in fn)`: the innermost frame of `error`'s traceback outside the standard
    library and installed packages (else the innermost one); "" without a traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if not f.filename.startswith(_LIBRARIES)]
    if not frames:
        return ""
    frame = (own or frames)[-1]
    return f" ({Path(frame.filename).name}:{frame.lineno}, in {frame.name})"


def score_texts(reward_fn: RewardFunction, decode: Callable, prompts: list[str], ids: np.ndarray,
                mask: np.ndarray, rows: Optional[list[dict]] = None
                ) -> tuple[list[str], np.ndarray, dict[str, np.ndarray]]:
    """Decode this process's response rows (`ids`, `mask` `[n, N]`) with
    `decode(ids, mask) -> n strings` and score them against their `prompts` (and `rows`) with
    `reward_fn`.

    Returns:
      `(responses, scores [n] float32, components {name: [n] float32})`.

    Raises:
      RewardFunctionError: as `call_reward_function`.
    """
    responses = decode(ids, mask)
    return (responses, *call_reward_function(reward_fn, prompts, responses, rows))
