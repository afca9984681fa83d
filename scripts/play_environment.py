"""Play an environment by hand: scripted policy turns through `run_step`, no model.

For writing and checking an environment (a built-in one, or a fork's registered in a module
given with --import, exactly as `train.py --import MODULE` loads it):

  .venv/bin/python scripts/play_environment.py --env calculator \
      --row '{"prompt": "What is 47 * 382?", "answer": "17954"}' \
      --turn '<calc>47*382</calc>' --turn 'It is <answer>17954</answer>'
  .venv/bin/python scripts/play_environment.py --import examples.my_environment \
      --env guess_number --row '{"prompt": "Guess my number (1-100).", "answer": 42}' \
      --turn 50 --turn 25 --turn 42 [--kwargs '{"guess_cost": 0.05}'] [--timeout 5]

Prints the prompt, then for each turn the observation, the reward parts and the info, and at
the end the summed reward parts. Exit 0 when the episode ends (done, or the turns run out),
1 when the environment fails (an `EpisodeFailure`: raised, timed out, malformed return), 2 on
bad arguments (an unknown environment or module, a row that is not a JSON object).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from ppo_jax.trainer.environments import (
    EpisodeFailure, get_environment, run_reset, run_step,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", required=True, help="registered environment name")
    p.add_argument("--row", required=True, help="the prompt record, a JSON object")
    p.add_argument("--turn", dest="turns", action="append", default=[],
                   help="one policy turn (repeatable, in order)")
    p.add_argument("--kwargs", default="{}", help="the environment's kwargs, a JSON object")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import a module first, e.g. one that registers an environment")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per step (default 5)")
    return p.parse_args(argv)


def _setup(args) -> tuple:
    """(environment, row) of the arguments. Raises: ValueError naming the bad argument."""
    sys.path.insert(0, os.getcwd())  # a fork's modules, next to where it runs (as train.py)
    for name in args.imports:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ValueError(f"--import {name}: {e}") from None
    try:
        row, kwargs = json.loads(args.row), json.loads(args.kwargs)
    except json.JSONDecodeError as e:
        raise ValueError(f"--row / --kwargs: not JSON ({e})") from None
    if not isinstance(row, dict) or not isinstance(kwargs, dict):
        raise ValueError("--row and --kwargs must be JSON objects")
    if not args.timeout > 0:  # also NaN
        raise ValueError(f"--timeout {args.timeout}: must be a positive number of seconds")
    return get_environment(args.env, **kwargs), row


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        env, row = _setup(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    started = run_reset(env, row, timeout_s=args.timeout)
    if isinstance(started, EpisodeFailure):
        print(f"episode failed: {started.error}")
        return 1
    state, prompt = started
    print(f"prompt: {prompt}")
    totals: dict = {}
    for i, text in enumerate(args.turns, 1):
        result = run_step(env, state, text, timeout_s=args.timeout)
        if isinstance(result, EpisodeFailure):
            print(f"episode failed: {result.error}")
            return 1
        print(f"turn {i}: {text}\n  observation: {result.observation}\n  rewards: "
              f"{result.rewards}\n  info: {result.info}")
        for key, value in result.rewards.items():
            totals[key] = totals.get(key, 0.0) + value
        state = result.state
        if result.done:
            break
    print(f"done: {result.done if args.turns else False}; reward parts summed: {totals}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
