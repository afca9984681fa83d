"""A scripted tool environment for runs in a subprocess (`train.py --import
tests.trainer.scripted_environment`, tests/parallel/sharded_run.py `--import`): `scripted_tool`.

Each episode: a turn gets the observation "tool says: good" (its state counts the turns), the
second turn is scored by whether it says "good" (`correct` 1 / 0), with a `tool_cost` of -0.1
per observed turn; any prompt row works (no `answer` needed). The state is explicit, so an
episode replays from any of its states."""

from ppo_jax.trainer.environments import Environment, StepResult, register_environment


class ScriptedTool(Environment):
    name = "scripted_tool"

    def reset(self, row):
        return 0, row["prompt"]

    def step(self, state, text):
        if state == 0:
            return StepResult("tool says: good", False, {"tool_cost": -0.1}, 1, {"tool_call": 1})
        return StepResult(None, True, {"correct": float("good" in text)}, state + 1, {})


@register_environment("scripted_tool", override=True)
def scripted_tool():
    return ScriptedTool()


# the tiny word-level tokenizer of configs/tiny.yaml: a turn ends at one of a few common words
STOP_WORDS = "[good,great,what,very,not,do]"
