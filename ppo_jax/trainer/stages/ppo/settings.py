"""The static settings of a PPO run, built once from its config: sampling, experience making
(with its scoring passes), the update and the held-out evaluation.

Each layer takes its own frozen settings dataclass (`rollout.sampler.SamplingSettings`,
`rollout.scoring.ScoringSettings`, `rollout.experience.ExperienceSettings`,
`trainer.stages.ppo.update.UpdateSettings`, `trainer.stages.ppo.evaluation.EvalSettings`). A field is read from the
config section that has a field of the same name (`settings_from`), so no field is copied by
hand; what the config does not hold (the mesh, stop and pad ids from the tokenizer, the reward
model's score statistics) is given by the trainer. Checking the config is separate
(`stages.ppo.checks`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from ppo_jax.rollout.experience import ExperienceSettings
from ppo_jax.rollout.sampler import SamplingSettings
from ppo_jax.rollout.scoring import ScoringSettings
from ppo_jax.trainer.config import Config, static_kwargs
from ppo_jax.trainer.stages.ppo.evaluation import EvalSettings
from ppo_jax.trainer.stages.ppo.update import UpdateSettings


def settings_from(cls, sections: tuple, **given: Any):
    """An instance of the frozen dataclass `cls`: each field from `given`, else from the one
    config section (a dataclass) of `sections` with a field of that name; dicts become sorted
    `(name, value)` tuples (`static_kwargs`) and lists tuples, so the result is hashable.

    Raises:
      TypeError: a field is in no section and not given, or in several sections and not given
        (ambiguous): a programming error, caught by the tests.
    """
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            values[f.name] = given[f.name]
            continue
        found = [s for s in sections if f.name in {g.name for g in dataclasses.fields(s)}]
        if len(found) != 1:
            where = [type(s).__name__ for s in found] or "no config section"
            raise TypeError(f"{cls.__name__}.{f.name}: in {where}; give it explicitly")
        value = getattr(found[0], f.name)
        values[f.name] = (static_kwargs(value) if isinstance(value, dict)
                          else tuple(value) if isinstance(value, list) else value)
    return cls(**values)


@dataclass(frozen=True)
class PPOSettings:
    """The static settings of every jitted call of a PPO step (`settings_for`)."""

    sampling: SamplingSettings
    experience: ExperienceSettings
    update: UpdateSettings
    eval: EvalSettings


def settings_for(cfg: Config, *, shared_critic: bool = False, mesh=None,
                 score_normalizer: Optional[tuple[float, float]] = None,
                 reward_eos_id: Optional[int] = None, stop_token_ids: tuple[int, ...] = (),
                 pad_token_id: int = 0) -> PPOSettings:
    """The `PPOSettings` of `cfg`.

    Args:
      shared_critic: the value head sits on the actor (`model.shared_critic`).
      mesh: the mesh of in-jit sharding constraints (None on one device).
      score_normalizer: the reward model's `(mean, std)` when `reward.normalize`, else None.
      reward_eos_id: the EOS id the reward model reads at (`reward.eos_at_end`), else None.
      stop_token_ids, pad_token_id: from the tokenizer and model config (`trainer.loading.models`);
        `generation.ignore_eos` samples with no stop token.
    """
    p, g, m, e = cfg.ppo, cfg.generation, cfg.model, cfg.eval
    stops = () if g.ignore_eos else tuple(stop_token_ids)
    scoring = settings_from(ScoringSettings, (p, g, m), mesh=mesh,
                            score_normalizer=score_normalizer, reward_eos_id=reward_eos_id)
    shared = g.samples_per_prompt if g.share_prompt_prefill else 1  # one prefill per group
    sampling = settings_from(SamplingSettings, (g,), stop_token_ids=stops,
                             pad_token_id=pad_token_id, samples_per_prompt=shared, mesh=mesh)
    eval_sampling = dataclasses.replace(  # eval.samples_per_prompt answers share a prefill too
        sampling, max_new_tokens=e.max_new_tokens or g.max_new_tokens,
        temperature=e.temperature, greedy=e.greedy,
        samples_per_prompt=e.samples_per_prompt if g.share_prompt_prefill else 1)
    return PPOSettings(
        sampling=sampling,
        experience=settings_from(ExperienceSettings, (p,), scoring=scoring,
                                 shared_critic=shared_critic,
                                 max_response_length=g.max_new_tokens),
        update=settings_from(UpdateSettings, (p, g, m), shared_critic=shared_critic, mesh=mesh,
                             train_actor=True, max_response_length=g.max_new_tokens),
        eval=EvalSettings(eval_sampling,
                          dataclasses.replace(scoring, temperature=e.temperature)))
