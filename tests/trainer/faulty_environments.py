"""Environments whose `reset` is faulty, for `train.py --import tests.trainer.faulty_environments`
(tests/trainer/test_environment_faults.py, which unregisters them after): `sleepy_reset` hangs
(until `RELEASE` is set, at most a minute), `empty_reset` gives a blank prompt, `chat_reset`
gives chat messages, `raising_reset` raises. Their `step` ends the episode at once."""

import threading

from ppo_jax.trainer.environments import Environment, StepResult, register_environment

RELEASE = threading.Event()  # set by a test's teardown: the hanging resets return


class FaultyReset(Environment):
    def __init__(self, name, reset):
        self.name, self._reset = name, reset

    def reset(self, row):
        return self._reset(row)

    def step(self, state, text):
        return StepResult(None, True, {"correct": 0.0}, state)


def _hang(row):
    RELEASE.wait(60)
    return 0, row["prompt"]


def _raise(row):
    raise ConnectionError("the sandbox is down")


RESETS = {
    "sleepy_reset": _hang,
    "empty_reset": lambda row: (0, " \n"),
    "chat_reset": lambda row: (0, [{"role": "user", "content": row["prompt"]}]),
    "raising_reset": _raise,
}

for _name, _reset in RESETS.items():
    register_environment(_name, override=True)(
        lambda _n=_name, _r=_reset: FaultyReset(_n, _r))
