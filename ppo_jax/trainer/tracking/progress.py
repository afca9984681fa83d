"""Training progress: a tqdm bar on a terminal; one plain line every N steps elsewhere (a log
file, a pipe, a scheduler's captured output), with the bar's fields and no carriage returns.
"""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    """`seconds` as H:MM:SS (M:SS under an hour), as tqdm shows elapsed and remaining time."""
    minutes, s = divmod(int(round(seconds)), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}:{m:02d}:{s:02d}" if hours else f"{m}:{s:02d}"


def progress_line(desc: str, n: int, total: int, elapsed: float, done_here: int,
                  postfix: dict) -> str:
    """One plain progress line: "ppo step 3/40 (8%) | elapsed 0:37 | 12.3 s/step | eta 7:35 |
    reward=0.123 kl=0.004". The rate and ETA come from the `done_here` steps run in `elapsed`
    seconds (this process; a resumed run's earlier steps are not among them)."""
    parts = [f"{desc} step {n}/{total} ({100 * n / max(total, 1):.0f}%)",
             f"elapsed {_clock(elapsed)}"]
    if done_here:
        per_step = elapsed / done_here
        parts += [f"{per_step:.2f} s/step", f"eta {_clock(per_step * max(total - n, 0))}"]
    if postfix:
        parts.append(" ".join(f"{k}={v}" for k, v in postfix.items()))
    return " | ".join(parts)


class PlainProgress:
    """tqdm's `set_postfix` / `update` / `close` as plain lines on `file` (default stderr): a
    line every `every` steps and at the last step, flushed, without carriage returns."""

    def __init__(self, *, total: int, initial: int = 0, desc: str = "", every: int = 1, file=None):
        self.total, self.n, self.desc, self.every = total, initial, desc, max(int(every), 1)
        self.file = file
        self._initial, self._start, self._postfix = initial, time.perf_counter(), {}

    def set_postfix(self, **postfix) -> None:
        self._postfix = postfix

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n >= self.total:
            line = progress_line(self.desc, self.n, self.total, time.perf_counter() - self._start,
                                 self.n - self._initial, self._postfix)
            print(line, file=self.file or sys.stderr, flush=True)

    def close(self) -> None:
        pass


def progress_bar(*, total: int, initial: int, desc: str, every: int = 1, stream=None):
    """A tqdm bar when `stream` (default stderr) is a terminal, else a `PlainProgress` that
    prints a line every `every` steps."""
    stream = stream or sys.stderr
    if not getattr(stream, "isatty", lambda: False)():
        return PlainProgress(total=total, initial=initial, desc=desc, every=every, file=stream)
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True,
                file=stream)


def trained_params_line(state: dict, frozen_params) -> str:
    """"trained params: actor 4,884,480 of 134,515,584 (3.6%), ..." for each train state of
    `state` (`{name: TrainState}`); `frozen_params(name)` is the model's frozen rest (a LoRA
    model's base; {} without)."""
    import jax

    parts = []
    for name, train_state in state.items():
        if getattr(train_state, "params", None) is None:
            continue
        trained = sum(int(x.size) for x in jax.tree.leaves(train_state.params))
        total = trained + sum(int(x.size) for x in jax.tree.leaves(frozen_params(name)))
        parts.append(f"{name} {trained:,} of {total:,} ({100 * trained / total:.1f}%)")
    return "trained params: " + ", ".join(parts)
