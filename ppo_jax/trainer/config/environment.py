"""The `env` section of the config: multi-turn episodes with a registered environment
(`trainer.environments`; docs/environments.md). Unset (`env.name: null`), a PPO step samples
one response per prompt and scores it once with `reward.*`, as ever."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from ppo_jax.rollout.observations import ObservationRole
from ppo_jax.trainer.config.fields import opt


@dataclass
class EnvConfig:
    """Multi-turn episodes: the actor's turns alternate with an environment's observations."""

    name: Optional[str] = opt(None, "a registered environment (ppo_jax.trainer.environments): "
                              "calculator, reasoning_gym_retry, or a fork's (--import); null: "
                              "one response per prompt, scored by reward.*")
    kwargs: Dict[str, Any] = opt(help="keyword arguments of the environment's factory, e.g. "
                                 "{tool_call_cost: 0.05} (calculator: a cost >= 0, paid as the "
                                 "reward part tool_cost = -0.05 per call)", factory=dict)
    max_turns: int = opt(4, "assistant turns per episode at most; the last one is scored "
                         "whatever it holds")
    max_observation_tokens: int = opt(64, "an observation is cut to this many tokens")
    timeout_s: float = opt(10.0, "seconds one environment step or reset may take, from its own "
                           "start; past it, or on an exception, only that episode fails: reward "
                           "0, counted in env/failures (the other rows keep decoding); at load, "
                           "a reset past it is an error naming the record")
    concurrency: int = opt(32, "environment calls one process runs at once (its rows' steps "
                           "and resets, in daemon threads); more wait their turn; a call past "
                           "env.timeout_s gives its place up")
    max_failed_steps: int = opt(3, "steps in a row whose every episode failed before the run "
                                "stops (exit 1, one error line; earlier checkpoints kept)")
    stop_strings: Optional[list[str]] = opt(None, "text that ends an assistant turn besides the "
                                            "stop tokens (matched as its tokens); null: the "
                                            "environment's own (its tool call's closing tag)")
    observation_role: ObservationRole = opt("user", "the chat-template role of an observation: "
                                            "user, or tool where the template has that role")
