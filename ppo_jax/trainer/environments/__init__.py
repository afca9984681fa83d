"""Environments of multi-turn rollouts: the policy writes a turn and the environment answers
with a tool's result, feedback or the final score. They are host-side Python with no JAX;
docs/environments.md describes them.

  base.py               the interface, `Environment.reset(row)` and `.step(state, text)`,
                        which returns a `StepResult`; the registry, `register_environment` and
                        `get_environment`; the fault wall: `run_step(s)` and `run_reset(s)`
                        run a batch's calls in parallel threads, each under its timeout, and
                        turn an exception, a timeout or a malformed return into an
                        `EpisodeFailure`; `episode_prompts` at load; observation truncation
  pool.py               `CallPool`: at most `env.concurrency` calls at once, each expired at
                        its own deadline, hung threads abandoned (and capped)
  tool_calls.py         tool calls in a turn: the Hermes `<tool_call>{json}</tool_call>` and
                        the small-model `<calc>expr</calc>` formats, their stop strings
  calculator.py         a safe, bounded arithmetic evaluator (an `ast` whitelist, no eval)
  calculator_env.py     "calculator": arithmetic problems with a calculator tool; `final_number`
  reasoning_gym_env.py  "reasoning_gym_retry": a reasoning-gym problem with feedback and
                        `max_attempts` tries

Importing this package registers the built-in environments; a fork registers its own with
`@register_environment("name")` in a module that `train.py --import MODULE` imports. The
rollout driver (turn limit, token budgets, masks) is not here: it calls these.
"""

from ppo_jax.trainer.environments.base import (
    ENVIRONMENTS, TRUNCATION_MARKER, Environment, EpisodeFailure, StepResult, build_environment,
    call_outcome, checked_reset, checked_step, environment_names, episode_prompts,
    get_environment, register_environment, reset_problem, run_reset, run_resets, run_step,
    run_steps, step_problem, truncate_observation, truncate_tokens,
)
from ppo_jax.trainer.environments.pool import Call, CallPool
from ppo_jax.trainer.environments.calculator import CalculatorError, CalculatorLimits, calculate
from ppo_jax.trainer.environments.calculator_env import CalculatorEnv, final_number
from ppo_jax.trainer.environments.reasoning_gym_env import RetryEnv
from ppo_jax.trainer.environments.tool_calls import (
    ALL_STOP_STRINGS, FORMATS, STOP_STRINGS, MalformedCall, ToolCall, parse_tool_call,
)

__all__ = [
    "ALL_STOP_STRINGS", "ENVIRONMENTS", "FORMATS", "STOP_STRINGS", "TRUNCATION_MARKER",
    "Call", "CallPool", "CalculatorEnv", "CalculatorError", "CalculatorLimits", "Environment",
    "EpisodeFailure", "MalformedCall", "RetryEnv", "StepResult", "ToolCall", "build_environment",
    "calculate", "call_outcome", "checked_reset", "checked_step", "environment_names",
    "episode_prompts", "final_number", "get_environment", "parse_tool_call",
    "register_environment", "reset_problem", "run_reset", "run_resets", "run_step", "run_steps",
    "step_problem", "truncate_observation", "truncate_tokens",
]
