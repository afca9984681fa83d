"""Stage 3, PPO: one step is sample -> score -> learn (`trainer.py`, read top to bottom).

  trainer.py      `PPOTrainer`: builds the models, states and jitted programs; `step()`
  parts.py        the three parts' values (`Sampled`, `Scored`, `Learned`) and step metrics
  settings.py     the static settings of a run, built once from its config
  checks.py       start-up checks of the registered functions a config names
  samplers.py     the step's sampler: the static batch or the paged engine, one signature
  rewards.py      reward functions on the decoded responses of a step
  dynamic.py      DAPO's dynamic sampling (over-sample, keep groups with signal)
  update.py       the PPO update: ppo_epochs x minibatches x micro-batches, one pure function
  evaluation.py   held-out evaluation of the actor (`eval.*`)
  columns.py      prompt and response column buckets (one compile per width)
  programs.py     the step's jitted programs with abstract arguments (`--compile-for`)

The experience pass (log-probs, values, KL-shaped rewards, advantages) is
`ppo_jax.rollout.experience`; the sampler and engine are `ppo_jax.rollout`; the math is
`ppo_jax.core`. `from ppo_jax.trainer.stages.ppo import PPOTrainer` works (imported on first
use).
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "PPOTrainer":
        from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

        return PPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
