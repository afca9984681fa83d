"""Settings for tests, the fields not given at the config's defaults: `sampling_settings`, a
`SamplingSettings` (`generation.*`: one sample per prompt, no stop token, pad id 0, no mesh,
single-turn; `turns=(stop_sequences, max_turns)` gives a `TurnSettings`), and
`engine_settings`, an `EngineSettings`."""

from __future__ import annotations

from ppo_jax.rollout.draws import SamplingSettings, TurnSettings
from ppo_jax.rollout.engine_layout import EngineSettings

DEFAULTS = dict(temperature=1.0, top_k=0, top_p=1.0, greedy=False, stop_token_ids=(),
                pad_token_id=0, samples_per_prompt=1, mesh=None, turns=None, record_routes=False)


def sampling_settings(max_new_tokens: int, **fields) -> SamplingSettings:
    turns = fields.pop("turns", None)
    if isinstance(turns, tuple):
        turns = TurnSettings(*turns)
    return SamplingSettings(max_new_tokens=max_new_tokens, **{**DEFAULTS, **fields, "turns": turns})


ENGINE_DEFAULTS = dict(page_size=16, num_pages=0, max_concurrent=0, decode_chunk=8,
                       decode_buckets=4, attention="reference")


def engine_settings(**fields) -> EngineSettings:
    return EngineSettings(**{**ENGINE_DEFAULTS, **fields})
