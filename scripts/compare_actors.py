"""Responses of the starting actor and a trained one to the same prompts, with their reward.

Both actors sample with the same seed and settings (temperature 1, the default run's 40 new
tokens), so the difference is the training. Prints each prompt with the two responses and the
VADER score of each, and the mean score over all the prompts given.

With several sampling seeds (`--seeds 0 1 2`) each actor samples every prompt once per seed;
the script prints the mean score of base and trained for each seed, then the mean over seeds
and the rise (trained - base) with its min / max over the seeds: a rise smaller than its spread
over seeds is sampling noise. Each model loads once; all seeds reuse one compiled sampler.
`--json PATH` writes those figures (one seed too).

Usage:
  .venv/bin/python scripts/compare_actors.py runs/default/actor_hf [--base smollm2]
      [--prompts configs/prompts/reviews.jsonl] [--first 32] [--show 2]
      [--seed 0 | --seeds 0 1 2] [--json PATH]

`--base` and the trained actor are local HF directories (e.g. an SFT stage's actor_hf) or
'smollm2'. Errors: a missing model directory or prompt file prints `error: ...` and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np

from ppo_jax.models import load_model, load_tokenizer, split_model
from ppo_jax.rollout.static_batch import generate
from ppo_jax.trainer.data.prompts import read_prompts, tokenize_prompts
from ppo_jax.trainer.rewards.functions import get_reward_function
from ppo_jax.trainer.config import Config
from ppo_jax.trainer.loading.models import pad_token_id, resolve_model_path, stop_token_ids


def sample_seeds(path, texts, *, seeds, max_new_tokens, max_prompt_length) -> list[list[str]]:
    """Load the actor at `path` once and sample every prompt with each seed.

    Returns one list of len(texts) decoded responses per seed (same prompt shapes for all
    seeds, so `generate` compiles once).
    """
    tokenizer = load_tokenizer(path)
    model, cfg = load_model(path, "causal_lm")
    graphdef, params = split_model(model)
    pad = pad_token_id(tokenizer)
    prompts = tokenize_prompts(texts, tokenizer, max_prompt_length=max_prompt_length,
                               pad_token_id=pad)
    stops = stop_token_ids(Config(), tokenizer, cfg)  # the trainer's default: the EOS ids
    out = []
    for seed in seeds:
        ids, mask = generate(graphdef, params, prompts.ids, prompts.mask, jax.random.PRNGKey(seed),
                             max_new_tokens=max_new_tokens, stop_token_ids=stops, pad_token_id=pad)
        ids, mask = np.asarray(ids), np.asarray(mask)
        out.append([tokenizer.decode(r[m.astype(bool)], skip_special_tokens=True).strip()
                    for r, m in zip(ids, mask)])
    return out


def seed_figures(seeds, before: list[np.ndarray], after: list[np.ndarray]) -> dict:
    """Per-seed mean scores of base and trained, and the rise's mean / min / max over seeds."""
    per_seed = [{"seed": s, "before": float(b.mean()), "after": float(a.mean()),
                 "rise": float(a.mean() - b.mean())} for s, b, a in zip(seeds, before, after)]
    rises = [r["rise"] for r in per_seed]
    return {"per_seed": per_seed,
            "mean_before": float(np.mean([r["before"] for r in per_seed])),
            "mean_after": float(np.mean([r["after"] for r in per_seed])),
            "mean_rise": float(np.mean(rises)), "min_rise": min(rises), "max_rise": max(rises)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("trained", help="HF directory of the trained actor (runs/<run>/actor_hf)")
    parser.add_argument("--base", default="smollm2",
                        help="starting actor: a directory, 'smollm2' or 'gemma3-270m'")
    parser.add_argument("--prompts", default="configs/prompts/reviews.jsonl")
    parser.add_argument("--first", type=int, default=32, help="use the first N prompts")
    parser.add_argument("--show", type=int, default=2, help="print this many prompt/response pairs")
    seeds = parser.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=0, help="one sampling seed")
    seeds.add_argument("--seeds", type=int, nargs="+", help="several sampling seeds")
    parser.add_argument("--json", help="write the per-seed and overall figures to this file")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--max-prompt-length", type=int, default=64)
    return parser.parse_args(argv)


def report(texts, seeds, before, after, s_before, s_after, show: int) -> dict:
    """Print the first seed's sample pairs and the means (the one-seed output is unchanged)."""
    for i in range(min(show, len(texts))):
        print(f"prompt: {texts[i]}\n  before ({s_before[0][i]:+.3f}): {before[0][i]}\n"
              f"  after  ({s_after[0][i]:+.3f}): {after[0][i]}\n")
    figures = seed_figures(seeds, s_before, s_after)
    if len(seeds) == 1:
        print(f"mean VADER score over {len(texts)} prompts: before {s_before[0].mean():+.3f}, "
              f"after {s_after[0].mean():+.3f}")
        return figures
    for r in figures["per_seed"]:
        print(f"seed {r['seed']}: before {r['before']:+.3f}, after {r['after']:+.3f}, "
              f"rise {r['rise']:+.3f}")
    print(f"mean VADER score over {len(texts)} prompts and {len(seeds)} seeds: before "
          f"{figures['mean_before']:+.3f}, after {figures['mean_after']:+.3f}, rise "
          f"{figures['mean_rise']:+.3f} (min {figures['min_rise']:+.3f}, max "
          f"{figures['max_rise']:+.3f} over seeds)")
    return figures


def main(argv=None) -> int:
    args = parse_args(argv)
    seeds = args.seeds if args.seeds else [args.seed]
    try:
        texts = read_prompts(args.prompts)[:args.first]
        base_path = resolve_model_path(args.base, "--base")
        trained_path = resolve_model_path(args.trained, "trained")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    reward = get_reward_function("vader")
    kw = dict(seeds=seeds, max_new_tokens=args.max_new_tokens,
              max_prompt_length=args.max_prompt_length)
    before = sample_seeds(base_path, texts, **kw)
    after = sample_seeds(trained_path, texts, **kw)
    s_before = [reward(texts, b) for b in before]
    s_after = [reward(texts, a) for a in after]
    figures = report(texts, seeds, before, after, s_before, s_after, args.show)
    if args.json:
        meta = {"trained": args.trained, "base": args.base, "prompts": args.prompts,
                "n_prompts": len(texts), "max_new_tokens": args.max_new_tokens, "seeds": seeds,
                "reward": "vader"}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**meta, **figures}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
