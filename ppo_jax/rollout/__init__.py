"""The rollout: responses sampled from the actor, and the forward passes that turn them into
PPO's experience.

  sampler.py          the static batch: prefill, then one jitted decode loop with a
                      preallocated KV cache (`ppo_jax.models.kv_cache`), up to the stop token
  prefill.py          the prompts run once into a fresh cache, shared within a group
  sampling.py         drawing the next token: filters, one key per sample, its log-prob
  engine.py           the paged engine (`generation.engine: paged`): KV pages, decode slots
                      refilled as rows finish
  engine_programs.py  the engine's jitted prefill / decode-chunk / gather programs
  scheduler.py        the engine's host scheduler (slots, pages, preemption)
  multi_turn.py       multi-turn episodes on the static batch: a turn ends at a stop sequence
                      or token, a host callback (the environment) answers, its observation
                      joins the same sequence (`action_mask` 0) and decoding resumes
  multi_turn_programs.py  its jitted prefill and decode segments (observations as forced
                      tokens through the same one-token passes and KV cache)
  observations.py     an environment's text as observation ids, framed by the chat template
  page_pool.py        a replica's free pages, with reference counts
  weights.py          the rollout copy of the actor's weights (dtype, layout)
  forward.py          forward passes over prompt + response: log-probs, values, reward-model
                      scores
  experience.py       `make_experience`: the forward passes and the PPO math on one rollout
                      (KL-shaped rewards, advantages, returns)
"""
