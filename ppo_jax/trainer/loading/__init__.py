"""Building a run's models from its config.

  models.py       the four models (actor, critic, reference, reward model), the tokenizer and
                  prompt sets: local HF directories, the shipped SmolLM2 GGUF, random tiny models
  lora.py         a LoRA run: which params train, the frozen base shared with the reference

A trained actor is loaded back after a run by `ppo_jax.saved_actor` (for `python -m
ppo_jax.generate` and `python -m ppo_jax.evaluate`), which sits above the stages.
"""
