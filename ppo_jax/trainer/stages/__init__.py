"""The three stages of RLHF, each a `StageTrainer` (`ppo_jax.trainer.loop`) with one jitted
update: `sft` (stage 1, `SFTTrainer`), `reward_model` (stage 2, `RewardModelTrainer`), `ppo`
(stage 3, `PPOTrainer`, in the package `ppo/`). `config.stage` picks one;
`trainer_class(stage)` returns its class. Stages 1 and 2 share `supervised.py` (a data set of
fixed-width rows, one trained model, minibatch steps, held-out evaluation).

The stage names (`STAGES`, the config's `Stage` type) are defined in the config, which the
trainers import, and re-exported here; the trainers are imported only when asked for.
"""

from __future__ import annotations

from ppo_jax.trainer.config import STAGES, Stage

__all__ = ["STAGES", "Stage", "trainer_class"]


def trainer_class(stage: str):
    """The trainer class of `stage`. Raises ValueError for another name."""
    if stage == "sft":
        from ppo_jax.trainer.stages.sft import SFTTrainer

        return SFTTrainer
    if stage == "reward_model":
        from ppo_jax.trainer.stages.reward_model import RewardModelTrainer

        return RewardModelTrainer
    if stage == "ppo":
        from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

        return PPOTrainer
    raise ValueError(f"stage={stage!r} is not one of {list(STAGES)}")
