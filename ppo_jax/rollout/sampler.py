"""The sampler: one interface over the static batch and the paged engine, built once per run
and called by training, ReMax's greedy baseline, dynamic sampling, episodes and evaluation, so
`generation.engine` means the same thing everywhere.

    sampler = Sampler(engine_settings, model_cfg, actor_shardings=..., by_row=..., replicated=...)
    out = sampler(actor, prompt_ids, prompt_mask, key, settings)              # single-turn
    out = sampler(actor, prompt_ids, prompt_mask, key, settings, on_turn_end)  # episodes

What runs behind it:

  engine settings   settings.turns   runs
  None (static)     None             `static_batch.sample`, one jitted call
  None (static)     TurnSettings     the engine's turn loop, one page per row
                                     (`engine.static_layout`)
  EngineSettings    either           the paged engine, `engine.PagedEngine`

Both layouts draw token t of row b with the same key, so they give the same tokens; see
`rollout.draws`. Jitted static calls are cached per settings, engines per (settings, batch, width):
each compiles on first use.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax

from ppo_jax.models.functional import Model
from ppo_jax.rollout.draws import Generation, SamplingSettings
from ppo_jax.rollout.engine import PagedEngine, static_layout
from ppo_jax.rollout.engine_layout import EngineSettings, EngineStats
from ppo_jax.rollout.static_batch import sample
from ppo_jax.rollout.turns import TurnCallback


class Sampler:
    """Samples responses, or plays episodes, for batches of left-padded prompts (module doc).

    Args:
      engine: the paged engine's `EngineSettings` (`generation.engine: paged`), or None for
        the static batch.
      model_cfg: the actor's `ModelConfig` (the engine's pool and checks).
      actor_shardings: the layout of the actor's params as the static batch receives them (a
        `Model` of shardings; None: whatever layout they come with); by_row, replicated: the
        batch's row and replicated shardings (None: no constraint). The engine lays itself
        out by `settings.mesh` instead.

    Attributes:
      last_stats: the paged engine's `EngineStats` of the last call; None with the static
        batch (`generation.engine: static` logs no `rollout/*` figures, turns or not).
    """

    def __init__(self, engine: Optional[EngineSettings], model_cfg, *,
                 actor_shardings: Optional[Model] = None, by_row=None, replicated=None):
        self.engine, self.model_cfg = engine, model_cfg
        self.actor_shardings, self.by_row, self.replicated = actor_shardings, by_row, replicated
        self.statics: dict[SamplingSettings, object] = {}
        self.engines: dict[tuple, PagedEngine] = {}
        self.last_stats: Optional[EngineStats] = None

    def laid_out(self, actor_shardings: Optional[Model]) -> "Sampler":
        """This sampler for an actor in another layout (the evaluator's trained params, where
        the step samples from the rollout copy): its own jitted static calls, the same
        engines (they take params in any layout)."""
        other = Sampler(self.engine, self.model_cfg, actor_shardings=actor_shardings,
                        by_row=self.by_row, replicated=self.replicated)
        other.engines = self.engines
        return other

    def records_routes(self, settings: SamplingSettings) -> bool:
        """Whether calls with `settings` return routes: asked for, and the actor is an MoE."""
        return settings.record_routes and bool(getattr(self.model_cfg, "num_moe_layers", 0))

    def static(self, settings: SamplingSettings):
        """The jitted static batch of single-turn `settings`: `(actor, prompt_ids, prompt_mask,
        key) -> (response_ids, response_mask, logprobs[, routes])`, laid out as the
        constructor says."""
        if settings not in self.statics:
            fn = partial(sample, settings=settings)
            if self.by_row is None:
                self.statics[settings] = jax.jit(fn)
            else:
                rows, rep = self.by_row, self.replicated
                outputs = 4 if self.records_routes(settings) else 3
                self.statics[settings] = jax.jit(
                    fn, in_shardings=(self.actor_shardings, rows, rows, rep),
                    out_shardings=(rows,) * outputs)
        return self.statics[settings]

    def paged(self, graphdef, settings: SamplingSettings, batch: int, width: int) -> PagedEngine:
        """The engine of `settings` for a `[batch, width]` prompt batch: the paged engine, or
        with the static batch and turns the engine in its static layout (raises ValueError on
        bad settings, before any compile)."""
        key = (settings, batch, width)
        if key not in self.engines:
            engine = self.engine or static_layout(batch, width, settings.max_new_tokens)
            self.engines[key] = PagedEngine(graphdef, self.model_cfg, settings, engine,
                                            batch=batch, prompt_width=width)
        return self.engines[key]

    def uses_engine(self, settings: SamplingSettings) -> bool:
        """Whether `settings` run on the engine (paged, or static with turns)."""
        return self.engine is not None or settings.turns is not None

    def __call__(self, actor: Model, prompt_ids, prompt_mask, key, settings: SamplingSettings,
                 on_turn_end: Optional[TurnCallback] = None) -> Generation:
        """Responses to `[B, P]` left-padded prompts (rows in adjacent groups of
        `settings.samples_per_prompt` copies) drawn with `key`.

        Args:
          actor: the actor (`Model`: graphdef and params).
          settings: `SamplingSettings`; with `turns`, `on_turn_end` is the environment
            (`engine.PagedEngine.generate`: required then, refused otherwise).

        Returns:
          a `Generation` `[B, N]` (`episodes` None single-turn).

        Raises:
          ValueError: bad settings or prompts, `on_turn_end` without turns or turns without
            it, an environment's bad answer (naming the row).
        """
        if not self.uses_engine(settings):
            if on_turn_end is not None:
                raise ValueError(f"on_turn_end={on_turn_end!r}: single-turn settings (turns "
                                 "None) take none")
            self.last_stats = None
            ids, mask, logprobs, *routes = self.static(settings)(actor, prompt_ids, prompt_mask,
                                                                 key)
            return Generation(ids, mask, logprobs, None, routes[0] if routes else None)
        engine = self.paged(actor.graphdef, settings, *prompt_ids.shape)
        out = engine.generate(actor.params, prompt_ids, prompt_mask, key, on_turn_end)
        self.last_stats = engine.last_stats if self.engine is not None else None
        return out

    def programs(self, actor: Model, prompt_ids, prompt_mask, key, settings: SamplingSettings,
                 prefix: str = "") -> list[dict]:
        """The jitted programs of one call with abstract arguments (`jax.ShapeDtypeStruct`s),
        for `train.py --compile-for`: `{"name", "fn", "args", "per_step", "while_trips"}`
        each, named `prefix + name`. The static batch: `sampler`, its decode loop at most
        N - 1 steps; the engine: `PagedEngine.programs`."""
        if not self.uses_engine(settings):
            return [{"name": prefix + "sampler", "fn": self.static(settings), "per_step": 1.0,
                     "while_trips": settings.max_new_tokens - 1,
                     "args": (actor, prompt_ids, prompt_mask, key)}]
        engine = self.paged(actor.graphdef, settings, *prompt_ids.shape)
        return [{**p, "name": prefix + p["name"]}
                for p in engine.programs(actor.params, prompt_ids, prompt_mask, key)]


def engine_metrics(stats: Optional[EngineStats]) -> dict:
    """The engine's figures of a call (`rollout/*`; none after a static batch): preemptions,
    the mean fraction of slots live per chunk, decode steps, prefill calls, the most pages in
    use at once (in one replica); with an environment, the host rounds that answered waiting
    turns."""
    if stats is None:
        return {}
    out = {"rollout/preemptions": float(stats.preemptions),
           "rollout/slot_occupancy": stats.slot_occupancy,
           "rollout/decode_steps": float(stats.steps), "rollout/prefills": float(stats.prefills),
           "rollout/peak_pages": float(stats.peak_pages)}
    if stats.turn_rounds:
        out["rollout/turn_rounds"] = float(stats.turn_rounds)
    return out
