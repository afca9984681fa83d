"""The rollout: responses sampled from the actor, and the forward passes over them.

  sampler.py          `Sampler`, the one interface: training, dynamic sampling, episodes and
                      evaluation call it; `generation.engine` picks what runs behind it
  draws.py            `SamplingSettings` (with `TurnSettings`), the draw (filters, one key per
                      sample, its log-prob), `Generation` (what a sampler returns)
  static_batch.py     single-turn sampling with one preallocated KV cache: prefill, then one
                      jitted decode loop up to the stop token (`generation.engine: static`)
  prefill.py          the prompts run once into a fresh cache, shared within a group
  engine.py           the engine: KV pages, decode slots refilled as rows finish
                      (`generation.engine: paged`), and the turn loop of multi-turn episodes
                      with either engine (static: one page per row, `static_layout`)
  stream.py           the engine as a stream: batches sharing the slots (a ring of row
                      blocks), new weights at chunk boundaries, each token's policy version
  engine_programs.py  the engine's jitted prefill / decode-chunk / resume / refill / gather
                      programs
  engine_layout.py    the engine's settings and sizes, what one call did
  scheduler.py        the engine's host scheduler (slots, pages, preemption)
  page_pool.py        a replica's free pages, with reference counts
  turns.py            multi-turn episodes: turn settings checked, the environment asked at
                      turn ends, the observations written, `Episodes`
  observations.py     an environment's text as observation ids, framed by the chat template
  weights.py          the rollout copy of the actor's weights (dtype, layout)
  forward.py          forward passes over prompt + response: log-probs, values, reward-model
                      scores
"""
