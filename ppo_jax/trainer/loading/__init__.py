"""Building a run's models from its config, and loading a trained actor back.

  models.py       the four models (actor, critic, reference, reward model), the tokenizer and
                  prompt sets: local HF directories, the shipped SmolLM2 GGUF, random tiny models
  lora.py         a LoRA run: which params train, the frozen base shared with the reference
  saved_actor.py  a run's saved actor (actor_hf/, a PEFT adapter, a checkpoint step) for
                  `python -m ppo_jax.generate` and `python -m ppo_jax.evaluate`
"""
