"""User code that fails in a PPO run, named (issue 54): the reward function failing mid-run
(`reward_faults`: a `trainer.faults.UserCodeError` naming `reward.function`, the step and the
checkpoint kept; train.py prints it as one `error:` line, exit 1), and a fork's registered
formulas named when a step's losses are not finite (`finite_hint`, the last sentence of the
loop's non-finite stop). Load-time faults are ConfigErrors of `stages.ppo.checks` instead.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from ppo_jax.core import (
    get_advantage_estimator, get_policy_loss, get_reward_shaping, get_value_loss, uses_critic,
)
from ppo_jax.trainer.environments import ENVIRONMENTS
from ppo_jax.trainer.faults import UserCodeError, checkpoint_kept
from ppo_jax.trainer.rewards.calls import RewardFunctionError
from ppo_jax.trainer.rewards.functions import REWARD_FUNCTIONS


@contextmanager
def reward_faults(name: str, when: str, checkpointer) -> Iterator[None]:
    """Run the block; a `RewardFunctionError` raised in it (the reward function raised, timed
    out or returned something unusable) becomes a UserCodeError.

    Args:
      name: `reward.function`.
      when: the moment, e.g. "step 3" or "the evaluation at step 2".
      checkpointer: the run's `Checkpointer` (its latest step is the one kept), or None.

    Raises:
      UserCodeError: "reward.function='name' failed at <when>: it <what it did>; stopped before
        saving (<the checkpoint kept>)".
    """
    try:
        yield
    except RewardFunctionError as e:
        last = None if checkpointer is None else checkpointer.latest_step()
        raise UserCodeError(f"reward.function={name!r} failed at {when}: it {e}; stopped before "
                            f"saving ({checkpoint_kept(last)})") from e


def forks_in_play(cfg) -> list[str]:
    """The config's registered functions that a fork registered (module outside `ppo_jax`), as
    `"ppo.policy_loss='name' (module.function)"`: reward shaping, the advantage estimator, the
    policy loss, the value loss when the estimator trains a critic, and the reward function's
    or the environment's factory (their scores reach the losses)."""
    p = cfg.ppo
    estimator = get_advantage_estimator(p.advantage_estimator)
    used = [("ppo.reward_shaping", p.reward_shaping, get_reward_shaping(p.reward_shaping)),
            ("ppo.advantage_estimator", p.advantage_estimator, estimator),
            ("ppo.policy_loss", p.policy_loss, get_policy_loss(p.policy_loss))]
    if uses_critic(estimator):
        used.append(("ppo.value_loss", p.value_loss, get_value_loss(p.value_loss)))
    if cfg.env.name:
        used.append(("env.name", cfg.env.name, ENVIRONMENTS.get(cfg.env.name)))
    elif cfg.reward.kind == "function":
        used.append(("reward.function", cfg.reward.function,
                     REWARD_FUNCTIONS.get(cfg.reward.function)))
    forks = []
    for key, name, fn in used:
        module = getattr(fn, "__module__", None) or "?"
        if not module.startswith("ppo_jax."):
            forks.append(f"{key}={name!r} ({module}.{getattr(fn, '__qualname__', fn)})")
    return forks


def finite_hint(cfg, advice: str) -> str:
    """The words ending a non-finite stop of the run `cfg`: the loop's `advice`
    (`StageTrainer.finite_hint`), after the fork's formulas in play when there are any
    (`forks_in_play`), since a new formula is the likelier cause."""
    forks = forks_in_play(cfg)
    if not forks:
        return advice
    return (f"A fork's registered function is in play, {', '.join(forks)}: check what it "
            f"returns first. {advice}")
