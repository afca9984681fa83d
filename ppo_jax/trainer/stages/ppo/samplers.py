"""The PPO step's sampler: the static batch (`rollout.sampler`) jitted with the rollout copy's
layout, or the paged engine (`rollout.engine`), behind one call signature
`(actor Model, prompt_ids, prompt_mask, key) -> (response_ids, response_mask, logprobs)`;
`rollout_samplers` makes a run's (with the rollout copy of the weights and ReMax's greedy
sampler); their settings are checked before any load in `stages.ppo.checks`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Optional

import jax

from ppo_jax.models.functional import Model
from ppo_jax.parallel.rules import tree_shardings
from ppo_jax.rollout.engine import EngineSettings, EngineStats, PagedEngine
from ppo_jax.rollout.sampler import SamplingSettings, sample
from ppo_jax.rollout.weights import rollout_copy_fn, rollout_rules
from ppo_jax.trainer.config import Config
from ppo_jax.trainer.stages.ppo.settings import engine_settings


def rollout_shardings(actor: Model, actor_sh: Model, place, layout: str, copied: bool) -> Model:
    """The shardings of the actor as the sampler receives it (`actor`: its arrays or shapes,
    `actor_sh`: their training shardings): the training ones, or, when the trainer makes a
    rollout copy on a mesh, `rollout_rules(layout)`'s."""
    if not copied or place.constraint_mesh is None:
        return actor_sh
    return replace(actor_sh, params=tree_shardings(actor.params, place.mesh,
                                                   rollout_rules(layout)))


class EngineSampler:
    """The paged engine behind the sampler's signature: one `PagedEngine` per prompt width
    (built, and compiled, on first use); `last_stats` is the last call's `EngineStats`."""

    def __init__(self, sampling: SamplingSettings, engine: EngineSettings, model_cfg):
        self.sampling, self.settings, self.model_cfg = sampling, engine, model_cfg
        self.engines: dict[tuple, PagedEngine] = {}
        self.last_stats = EngineStats()

    def engine(self, graphdef, batch: int, width: int) -> PagedEngine:
        """The engine of a `[batch, width]` prompt batch (raises ValueError on bad settings)."""
        key = (batch, width)
        if key not in self.engines:
            self.engines[key] = PagedEngine(graphdef, self.model_cfg, self.sampling, self.settings,
                                            batch=batch, prompt_width=width)
        return self.engines[key]

    def programs(self, actor: Model, prompt_ids, prompt_mask, key, prefix: str = "") -> list:
        """The engine's programs for abstract arguments (`PagedEngine.programs`), as
        `trainer.programs.Program`s named `prefix + name`."""
        from ppo_jax.trainer.programs import Program

        engine = self.engine(actor.graphdef, *prompt_ids.shape)
        return [Program(prefix + p["name"], p["fn"], p["args"], per_step=p["per_step"],
                        while_trips=p["while_trips"])
                for p in engine.programs(actor.params, prompt_ids, prompt_mask, key)]

    def __call__(self, actor: Model, prompt_ids, prompt_mask, key):
        engine = self.engine(actor.graphdef, *prompt_ids.shape)
        out = engine.generate(actor.params, prompt_ids, prompt_mask, key)
        self.last_stats = engine.last_stats
        return out


def make_sampler(sampling: SamplingSettings, engine: Optional[EngineSettings], actor_sh: Model,
                 place, model_cfg):
    """The static sampler (`engine` None), jitted with the actor's layout `actor_sh` and the
    batch layout of `place`, or an `EngineSampler`."""
    if engine is not None:
        return EngineSampler(sampling, engine, model_cfg)
    by_row, rep = place.by_row, place.replicated
    return jax.jit(partial(sample, settings=sampling), in_shardings=(actor_sh, by_row, by_row, rep),
                   out_shardings=(by_row, by_row, by_row))


@dataclass(frozen=True)
class RolloutSamplers:
    """A run's sampling programs (`rollout_samplers`): the rollout copy of the actor's params
    (None: the sampler takes the trained params as they are), the sampler, and the greedy
    sampler of ReMax's baseline (None when the estimator needs none)."""

    rollout_copy: Optional[Callable]
    sample: Callable
    sample_greedy: Optional[Callable]


def rollout_samplers(cfg: Config, sampling: SamplingSettings, place, actor: Model,
                     actor_sh: Model, layout: str, model_cfg, *, greedy: bool) -> RolloutSamplers:
    """The rollout copy of `actor` (its arrays or shapes; `rollout.weights.rollout_copy_fn`:
    cast to `generation.param_dtype`, laid out by the resolved `layout`) and the samplers
    (`make_sampler`, with `sampling`; a greedy one too when `greedy`) on the layout the
    sampler receives (`rollout_shardings`; `actor_sh`: the training shardings)."""
    copy = rollout_copy_fn(actor.params, place.constraint_mesh, layout, cfg.generation.param_dtype)
    sh = rollout_shardings(actor, actor_sh, place, layout, copy is not None)
    engine = engine_settings(cfg)
    return RolloutSamplers(
        rollout_copy=copy, sample=make_sampler(sampling, engine, sh, place, model_cfg),
        sample_greedy=(make_sampler(replace(sampling, greedy=True), engine, sh, place, model_cfg)
                       if greedy else None))


def engine_metrics(sampler) -> dict:
    """The paged engine's figures of its last call (`rollout/*`; none for the static sampler):
    preemptions, the mean fraction of slots live per chunk, decode steps, prefill calls, the
    most pages in use at once (in one replica); with an environment, the host rounds that
    answered waiting turns."""
    stats = getattr(sampler, "last_stats", None)
    if stats is None:
        return {}
    out = {"rollout/preemptions": float(stats.preemptions),
           "rollout/slot_occupancy": stats.slot_occupancy,
           "rollout/decode_steps": float(stats.steps), "rollout/prefills": float(stats.prefills),
           "rollout/peak_pages": float(stats.peak_pages)}
    if stats.turn_rounds:
        out["rollout/turn_rounds"] = float(stats.turn_rounds)
    return out
