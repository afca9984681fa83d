"""Responses of the starting actor and a trained one to the same prompts, with their reward.

Both actors sample with the same seed and settings (temperature 1, the default run's 40 new
tokens), so the difference is the training. Prints each prompt with the two responses and the
VADER score of each, and the mean score over all the prompts given.

Usage:
  .venv/bin/python scripts/compare_actors.py runs/default/actor_hf [--base smollm2]
      [--prompts configs/prompts/reviews.jsonl] [--first 32] [--show 2] [--seed 0]
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from ppo_jax.models import load_model, load_tokenizer, split_model
from ppo_jax.rollout.sampler import generate
from ppo_jax.trainer.data import read_prompts, tokenize_prompts
from ppo_jax.trainer.reward_functions import get_reward_function
from ppo_jax.trainer.config import Config
from ppo_jax.trainer.setup import pad_token_id, resolve_model_path, stop_token_ids


def sample(path, texts, *, seed, max_new_tokens, max_prompt_length):
    tokenizer = load_tokenizer(path)
    model, cfg = load_model(path, "causal_lm")
    graphdef, params = split_model(model)
    pad = pad_token_id(tokenizer)
    prompts = tokenize_prompts(texts, tokenizer, max_prompt_length=max_prompt_length, pad_token_id=pad)
    stops = stop_token_ids(Config(), tokenizer, cfg)  # the trainer's default: the EOS ids
    ids, mask = generate(graphdef, params, prompts.ids, prompts.mask, jax.random.PRNGKey(seed),
                         max_new_tokens=max_new_tokens, stop_token_ids=stops, pad_token_id=pad)
    ids, mask = np.asarray(ids), np.asarray(mask)
    return [tokenizer.decode(r[m.astype(bool)], skip_special_tokens=True).strip()
            for r, m in zip(ids, mask)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trained", help="HF directory of the trained actor (runs/<run>/actor_hf)")
    parser.add_argument("--base", default="smollm2", help="starting actor: a directory or 'smollm2'")
    parser.add_argument("--prompts", default="configs/prompts/reviews.jsonl")
    parser.add_argument("--first", type=int, default=32, help="use the first N prompts")
    parser.add_argument("--show", type=int, default=2, help="print this many prompt/response pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--max-prompt-length", type=int, default=64)
    args = parser.parse_args()

    texts = read_prompts(args.prompts)[:args.first]
    reward = get_reward_function("vader")
    kw = dict(seed=args.seed, max_new_tokens=args.max_new_tokens,
              max_prompt_length=args.max_prompt_length)
    before = sample(resolve_model_path(args.base, "--base"), texts, **kw)
    after = sample(resolve_model_path(args.trained, "trained"), texts, **kw)
    s_before, s_after = reward(texts, before), reward(texts, after)
    for i in range(min(args.show, len(texts))):
        print(f"prompt: {texts[i]}\n  before ({s_before[i]:+.3f}): {before[i]}\n"
              f"  after  ({s_after[i]:+.3f}): {after[i]}\n")
    print(f"mean VADER score over {len(texts)} prompts: before {s_before.mean():+.3f}, "
          f"after {s_after.mean():+.3f}")


if __name__ == "__main__":
    main()
