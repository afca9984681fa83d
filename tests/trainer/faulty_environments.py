"""Environments whose `reset` or factory is faulty, for `train.py --import
tests.trainer.faulty_environments` (tests/trainer/test_environment_faults.py, which unregisters
them after): `sleepy_reset` hangs (until `RELEASE` is set, at most a minute), `empty_reset`
gives a blank prompt, `chat_reset` gives chat messages, `raising_reset` raises. Their `step`
ends the episode at once. Factories (`FACTORIES`): `raising_factory` raises RuntimeError,
`typed_factory` a TypeError for a `level` that is not an int, `flaky_factory` a RuntimeError
on its `fail_on`-th build (counted in `BUILDS`), `slow_factory` hangs (as `sleepy_reset`)."""

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


BUILDS = []  # one entry per build of flaky_factory


def _working(name):
    return FaultyReset(name, lambda row: (0, row["prompt"]))


def _raising_factory():
    raise RuntimeError("cannot start the sandbox")


def _typed_factory(level=1):
    if not isinstance(level, int):
        raise TypeError(f"level must be int, got {level!r}")
    return _working("typed_factory")


def _flaky_factory(fail_on=3):
    BUILDS.append(fail_on)
    if len(BUILDS) == fail_on:
        raise RuntimeError(f"factory refused on build {len(BUILDS)}")
    return _working("flaky_factory")


def _slow_factory():
    RELEASE.wait(60)
    return _working("slow_factory")


FACTORIES = {"raising_factory": _raising_factory, "typed_factory": _typed_factory,
             "flaky_factory": _flaky_factory, "slow_factory": _slow_factory}

for _name, _factory in FACTORIES.items():
    register_environment(_name, override=True)(_factory)
