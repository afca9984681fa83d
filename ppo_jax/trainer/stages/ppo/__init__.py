"""Stage 3, PPO: one step is sample -> score -> learn (`trainer.py`, read top to bottom).

  trainer.py      `PPOTrainer` (no mixins): builds the run, binds and jits its programs;
                  `step()` = `sample_rollout` (or `dynamic_rollout`, `episode_rollout`) ->
                  `score_rollout` -> `learn`
  steps.py        the step's programs as module-level pure functions (`experience_step`,
                  `update_step`, `split_keys`, `reward_model_scores`; `jax.jit` is applied in
                  `build.build_programs`) and `Jitted`, the bound and jitted set
  build.py        what a run builds once: optimisers, train states and frozen params
                  (`build_params`), `join_models`, the held-out evaluator (`build_evaluator`),
                  the jitted programs (`build_programs`)
  parts.py        the step's values: `PromptBatch` (`next_prompts`), `Sampled`, `Scored`,
                  `Learned`, `LastRollout`, and the step's metrics (`step_metrics`)
  settings.py     the static settings of a run, built once from its config
  checks.py       every start-up check beyond one config key: registered functions, prompt
                  files, the batch on the mesh, the paged engine, the TPU kernel
  samplers.py     the step's sampler: the static batch or the paged engine, one signature;
                  the rollout copy and ReMax's greedy sampler (`rollout_samplers`)
  text_rewards.py reward functions on the decoded responses (`decode_responses`,
                  `text_scores`), the decoded samples of the last step (`sample_records`)
  dynamic.py      DAPO's dynamic sampling: `draw_round`, `draw_rounds`, `select_rollout`,
                  `informative_rollout`
  episodes.py     multi-turn episodes with an environment (`env.*`): `EpisodeRunner`,
                  `sampled_episodes`, `EpisodeEvaluator`
  update.py       the PPO update: ppo_epochs x minibatches x micro-batches, one pure function
  evaluation.py   held-out evaluation of the actor (`eval.*`)
  columns.py      prompt and response column buckets (one compile per width)
  compile_for.py  the step's jitted programs with abstract arguments (`--compile-for`):
                  `step_programs` and `resident`, of the same `Jitted` objects `step()` calls

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
