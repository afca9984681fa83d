"""A research fork's environment, registered by name (docs/environments.md "Your own environment").

    python scripts/play_environment.py --import examples.my_environment --env guess_number \
        --row '{"prompt": "Guess my number (1-100).", "answer": 42}' --turn 50 --turn 25 --turn 42

`guess_number`: the row's `answer` is a secret integer; each policy turn is a guess (the last
number of the turn, `final_number`); a wrong guess is answered "higher" or "lower" and costs
`guess_cost` (reward part `guess_cost`), a right one ends the episode with `correct` 1.0, and
after `max_guesses` wrong ones it ends with `correct` 0.0. Everything about the episode lives
in the state value (the secret and the guesses so far), nothing on the environment object.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppo_jax.trainer.environments import Environment, StepResult, final_number, register_environment


@dataclass(frozen=True)
class GuessState:
    secret: int
    guesses: int = 0


class GuessNumber(Environment):
    name = "guess_number"

    def __init__(self, guess_cost: float, max_guesses: int):
        self.guess_cost, self.max_guesses = guess_cost, max_guesses

    def reset(self, row: dict):
        if "answer" not in row:
            raise ValueError(f"guess_number needs an answer in every row, got {sorted(row)}")
        prompt = row["prompt"] + "\nAnswer with one number; I will say higher or lower."
        return GuessState(int(row["answer"])), prompt

    def step(self, state: GuessState, assistant_text: str) -> StepResult:
        guess = final_number(assistant_text)
        state = GuessState(state.secret, state.guesses + 1)
        info = {"guessed": int(guess is not None)}
        if guess == state.secret:
            return StepResult(None, True, {"correct": 1.0}, state, info)
        if state.guesses >= self.max_guesses:
            return StepResult(None, True, {"correct": 0.0, "guess_cost": -self.guess_cost},
                              state, info)
        hint = "no number found" if guess is None else (
            "higher" if guess < state.secret else "lower")
        return StepResult(hint, False, {"guess_cost": -self.guess_cost}, state, info)


@register_environment("guess_number")
def guess_number(guess_cost: float = 0.1, max_guesses: int = 7) -> GuessNumber:
    return GuessNumber(float(guess_cost), int(max_guesses))
