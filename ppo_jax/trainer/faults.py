"""The error of a user's own code failing mid-run: a reward function, an environment, a fork's
registered loss. train.py prints its message as one `error:` line and exits 1; whatever the run
had written (checkpoints, metrics) stays as it was.

Faults found at load (a reward function's probe, an environment's `reset` on the prompt
records) are ConfigErrors instead: exit 2, before anything is written.
"""

from __future__ import annotations

from typing import Optional


class UserCodeError(RuntimeError):
    """User code failed during training. The message names the code (`reward.function='x'`,
    `environment 'y'`), the step, what it did and what was kept."""


def checkpoint_kept(last_step: Optional[int]) -> str:
    """What a run stopped by a fault keeps, in the words of every such stop: "the last
    checkpoint, step N, is kept", or "no checkpoint was written yet" (`last_step` None)."""
    return ("no checkpoint was written yet" if last_step is None else
            f"the last checkpoint, step {last_step}, is kept")
