"""Stage 3, PPO. One step runs one way: sample (`ppo_jax.rollout`) -> score -> experience ->
update.

  trainer.py        `PPOTrainer`: builds the run; `step()` reads top to bottom
  step_data.py      the values the step's parts pass on (`Sampled`, `Scored`, `Learned`), the
                    prompt batch, the column buckets, the step's metrics
  rewards.py        the reward function on decoded responses; its failures named
  dynamic.py        DAPO's dynamic sampling (rounds until the batch is informative)
  episodes.py       multi-turn episodes with an environment (`env.*`)
  experience.py     the experience pass: forward passes, reward shaping, advantages (GAE and
                    the registered estimators), the KL controller
  update.py         the PPO update: ppo_epochs x minibatches x micro-batches
  evaluation.py     the held-out evaluation (`eval.*`)
  settings.py       every static setting, composed once from the config
  load_checks.py    the checks that need more than one config key, before any compile
  build.py          what a run builds once: optimisers, train states, frozen params, evaluator
  step_programs.py  the step's jitted programs, bound once; their abstract view for
                    `--compile-for`

`from ppo_jax.trainer.stages.ppo import PPOTrainer` works (imported on first use).
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "PPOTrainer":
        from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

        return PPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
