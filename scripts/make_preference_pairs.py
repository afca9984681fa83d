"""Preference pairs and best-of-k SFT data from an actor's own samples (AI feedback, no download).

For every prompt the actor samples k responses (temperature sampling with the trainer's
sampler, chat template, stop tokens and padding); a registered reward function scores each
(VADER by default). The best and worst response of a prompt make a preference pair for the
reward-model stage; the best alone is a row of rejection-sampling fine-tuning data for SFT.
An empty response (the model stopped at once) is never the chosen / SFT response, but it may
be the rejected one.

Usage:
  .venv/bin/python scripts/make_preference_pairs.py --actor smollm2 \
      --prompts configs/prompts/reviews.jsonl --k 4 --out runs/prefs [--reward vader] \
      [--max-new-tokens 40] [--temperature 1.0] [--batch-size 32] [--seed 0] \
      [--max-prompt-length 64] [--first N] [--import MODULE] [--overwrite]
      [--all-pairs-gap GAP] [--eval-fraction F]

Writes, in --out:
  pairs.jsonl    one row per usable prompt (more with --all-pairs-gap): {"prompt", "chosen",
                 "rejected", "chosen_score", "rejected_score", "chosen_truncated",
                 "rejected_truncated"}; a prompt is skipped (and counted) when its best and
                 worst scores are equal, its best and worst texts are identical, or all k are
                 empty. `*_truncated`: the response hit --max-new-tokens before a stop token.
  sft.jsonl      one row per prompt with a non-empty response: {"prompt", "response", "score",
                 "truncated"}, the best of its k samples.
  pairs_eval.jsonl, sft_eval.jsonl   with --eval-fraction F: the rows of a seeded random F of
                 the prompts, held out by prompt (no response of theirs is in the training files).
  samples.jsonl  every sample: {"prompt", "responses": [k], "scores": [k]} (for audits).
  summary.json   counts, mean score of all samples, mean best / worst per prompt, generated
                 tokens, tokens/s, wall time, and the arguments (also printed).
"prompt" fields are the raw prompt strings (no chat template), so the SFT and reward-model
stages template them exactly as PPO does. Same arguments and seed -> identical jsonl files.

What is measured: generation time is the wall time of all `generate` calls (the first batch
includes compilation, also reported on its own); tokens are the generated tokens of real rows
(up to and including the stop token), not of the rows that pad the last batch.

Errors: a missing prompt file, an unknown reward name, bad settings or an --out that already
holds outputs (without --overwrite) print `error: ...` and exit with status 2 before any model
is loaded.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

OUTPUTS = ("pairs.jsonl", "sft.jsonl", "pairs_eval.jsonl", "sft_eval.jsonl", "samples.jsonl",
           "summary.json")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--actor", required=True,
                   help="HF directory, 'smollm2', 'gemma3-270m' or 'tiny-random'")
    p.add_argument("--prompts", required=True, help="prompt file (.jsonl/.json/.txt/.parquet)")
    p.add_argument("--k", type=int, default=4, help="samples per prompt (>= 2)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--reward", default="vader", help="registered reward function name")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=32, help="rows per generate call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt-length", type=int, default=64)
    p.add_argument("--first", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import a module first, e.g. one registering a reward function")
    p.add_argument("--overwrite", action="store_true", help="replace outputs already in --out")
    p.add_argument("--all-pairs-gap", type=float, default=None, metavar="GAP",
                   help="besides best vs worst, every other pair of a prompt's responses whose "
                        "scores differ by at least GAP (more pairs from the same samples)")
    p.add_argument("--eval-fraction", type=float, default=0.0,
                   help="share of the prompts (a seeded random choice) whose rows go to "
                        "pairs_eval.jsonl / sft_eval.jsonl instead: held out by prompt")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Settings, the prompt file and the output directory, before any model loads.

    Raises:
      ValueError: a setting out of range, or --out already holds outputs (no --overwrite).
      FileNotFoundError: --prompts is not a file.
    """
    for name, low in (("k", 2), ("max_new_tokens", 1), ("batch_size", 1),
                      ("max_prompt_length", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= {low}")
    if not 0.0 <= args.eval_fraction < 1.0:
        raise ValueError(f"--eval-fraction={args.eval_fraction} must lie in [0, 1)")
    if args.all_pairs_gap is not None and not args.all_pairs_gap > 0:
        raise ValueError(f"--all-pairs-gap={args.all_pairs_gap} must be > 0")
    if args.first is not None and args.first < 1:
        raise ValueError(f"--first={args.first} must be >= 1")
    if not 0 < args.temperature < float("inf"):
        raise ValueError(f"--temperature={args.temperature} must be a finite number > 0")
    if not Path(args.prompts).is_file():
        raise FileNotFoundError(f"--prompts: prompt file not found: {args.prompts}")
    held = [f for f in OUTPUTS if (Path(args.out) / f).exists()]
    if held and not args.overwrite:
        raise ValueError(f"--out {args.out} already holds {', '.join(held)}; pass --overwrite "
                         "or choose another directory")


@dataclass
class Actor:
    """A causal LM ready for `generate`: split model, tokenizer, stop and pad ids."""

    graphdef: Any
    params: Any
    tokenizer: Any
    stops: tuple[int, ...]
    pad: int


def load_actor(source: str) -> Actor:
    """Load the actor as the trainer does (`resolve_model_path`, float32, EOS stop tokens).

    Raises:
      FileNotFoundError: `source` is neither a packaged model ('smollm2', 'gemma3-270m'),
        'tiny-random' nor an HF directory.
    """
    from ppo_jax.models import load_model, load_tokenizer, split_model
    from ppo_jax.trainer.config import Config
    from ppo_jax.trainer.loading.models import pad_token_id, resolve_model_path, stop_token_ids

    path = resolve_model_path(source, "--actor")
    tokenizer = load_tokenizer(path)
    model, cfg = load_model(path, "causal_lm")
    graphdef, params = split_model(model)
    return Actor(graphdef, params, tokenizer, stop_token_ids(Config(), tokenizer, cfg),
                 pad_token_id(tokenizer))


def batch_rows(n_prompts: int, k: int, batch_size: int) -> tuple[np.ndarray, int]:
    """Prompt index of every row, each prompt repeated k times in a row, padded by repeating rows
    (from the start) to whole batches. Returns (rows `[n_batches * B]`, B) with
    B = min(batch_size, n_prompts * k); rows past n_prompts * k are padding to drop."""
    real = np.repeat(np.arange(n_prompts), k)
    width = min(batch_size, real.size)
    n_batches = -(-real.size // width)
    return np.resize(real, n_batches * width), width


def sample_responses(actor: Actor, texts: list[str], args) -> tuple[list[str], list[bool], dict]:
    """k decoded responses per prompt, `[len(texts) * k]` (prompt i at rows i*k .. i*k+k-1),
    and whether each was truncated (hit --max-new-tokens before a stop token).

    Every batch has the same shape, so `generate` compiles once; batch b samples with
    `fold_in(PRNGKey(seed), b)`. Returns (responses, truncated, timing: generated tokens and seconds, in
    all and of the first batch, which holds the compilation).
    """
    import jax

    from ppo_jax.rollout.static_batch import generate
    from ppo_jax.trainer.data.prompts import tokenize_prompts

    prompts = tokenize_prompts(texts, actor.tokenizer, max_prompt_length=args.max_prompt_length,
                               pad_token_id=actor.pad)
    rows, width = batch_rows(len(texts), args.k, args.batch_size)
    n_real, key = len(texts) * args.k, jax.random.PRNGKey(args.seed)
    responses, truncated, tokens, start = [], [], 0, time.perf_counter()
    stops = np.asarray(actor.stops)
    for b in range(rows.size // width):
        idx = rows[b * width:(b + 1) * width]
        ids, mask = generate(actor.graphdef, actor.params, prompts.ids[idx], prompts.mask[idx],
                             jax.random.fold_in(key, b), max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, stop_token_ids=actor.stops,
                             pad_token_id=actor.pad)
        ids, mask = np.asarray(ids), np.asarray(mask).astype(bool)
        keep = min(width, n_real - b * width)  # the last batch's padding rows are dropped
        tokens += int(mask[:keep].sum())
        responses += [actor.tokenizer.decode(r[m], skip_special_tokens=True).strip()
                      for r, m in zip(ids[:keep], mask[:keep])]
        truncated += [not np.isin(r[m], stops).any() for r, m in zip(ids[:keep], mask[:keep])]
        if b == 0:
            first_s, first_tokens = time.perf_counter() - start, tokens
    return responses, truncated, {"generated_tokens": tokens, "generation_s": time.perf_counter() - start,
                       "first_batch_s": first_s, "first_batch_tokens": first_tokens}


def score_all(reward, texts: list[str], flat: list[str], k: int) -> np.ndarray:
    """Scores `[N, k]` float64 of the `[N * k]` responses, each the shortest decimal of the
    reward's own float (float32 0.7 is written 0.7, not 0.699999988079071).

    Raises:
      ValueError: the reward returns the wrong number of scores or a non-finite one.
    """
    raw = np.asarray(reward([t for t in texts for _ in range(k)], flat)).reshape(-1)
    if raw.size != len(flat):
        raise ValueError(f"returned {raw.size} scores for {len(flat)} responses")
    if not np.isfinite(raw).all():
        raise ValueError(f"{int((~np.isfinite(raw)).sum())} non-finite scores")
    return np.array([float(str(x)) for x in raw], np.float64).reshape(len(texts), k)


def pair_row(prompt: str, resp: list[str], s, cut: list[bool], i: int, j: int) -> dict:
    """The pairs.jsonl row of response i preferred over response j."""
    return {"prompt": prompt, "chosen": resp[i], "rejected": resp[j], "chosen_score": float(s[i]),
            "rejected_score": float(s[j]), "chosen_truncated": bool(cut[i]),
            "rejected_truncated": bool(cut[j])}


def extra_pairs(prompt: str, resp: list[str], s: np.ndarray, cut: list[bool], gap: float,
                best: tuple) -> list[dict]:
    """Every pair (i, j) of one prompt's responses with s_i - s_j >= gap, response i non-empty,
    texts different, other than the best-vs-worst pair `best`."""
    return [pair_row(prompt, resp, s, cut, i, j) for i in range(len(resp)) for j in range(len(resp))
            if (i, j) != best and resp[i] and resp[i] != resp[j] and s[i] - s[j] >= gap]


def select(texts: list[str], responses: list[list[str]], scores: np.ndarray,
           gap: float | None = None, truncated: list[list[bool]] | None = None) -> dict:
    """Best and worst of each prompt's k responses.

    Args:
      texts: N raw prompts. responses: N lists of k strings. scores: `[N, k]` float.
    Chosen / SFT = the first highest-scored non-empty response; rejected = the first
    lowest-scored response (empty allowed). A prompt gives no pair when best and worst scores
    are equal or their texts identical, and neither a pair nor an SFT row when all k are empty.
    With `gap`, `extra_pairs` adds the prompt's other pairs at least `gap` apart. `truncated`
    (N lists of k flags; default all False) marks responses cut at --max-new-tokens: rows say so
    (`truncated`, `chosen_truncated`, `rejected_truncated`) and the stages append no stop token.

    Returns:
      {"pairs": [row], "sft": [row], "skipped": {"equal_score", "identical_text", "all_empty"},
       "best": [N_sft] scores, "worst": [N] scores}.
    """
    pairs, sft, worst, skipped = [], [], [], {"equal_score": 0, "identical_text": 0,
                                               "all_empty": 0}
    truncated = truncated or [[False] * len(r) for r in responses]
    for prompt, resp, s, cut in zip(texts, responses, np.asarray(scores, np.float64), truncated):
        lo = int(np.argmin(s))
        worst.append(float(s[lo]))
        nonempty = np.array([bool(r) for r in resp])
        if not nonempty.any():
            skipped["all_empty"] += 1
            continue
        hi = int(np.argmax(np.where(nonempty, s, -np.inf)))
        sft.append({"prompt": prompt, "response": resp[hi], "score": float(s[hi]),
                    "truncated": bool(cut[hi])})
        if s[hi] == s[lo]:
            skipped["equal_score"] += 1
        elif resp[hi] == resp[lo]:
            skipped["identical_text"] += 1
        else:
            pairs.append(pair_row(prompt, resp, s, cut, hi, lo))
            if gap is not None:
                pairs.extend(extra_pairs(prompt, resp, s, cut, gap, (hi, lo)))
    return {"pairs": pairs, "sft": sft, "skipped": skipped,
            "best": [r["score"] for r in sft], "worst": worst}


def summarize(args, scores: np.ndarray, responses: list[str], chosen: dict, timing: dict,
              wall_s: float) -> dict:
    """The figures of summary.json (rounded; means are over prompts unless said otherwise)."""
    gen_s, first_s = timing["generation_s"], timing["first_batch_s"]
    rest_tokens, rest_s = timing["generated_tokens"] - timing["first_batch_tokens"], gen_s - first_s
    return {
        "prompts": int(scores.shape[0]), "samples": int(scores.size),
        "pairs": len(chosen["pairs"]), "sft_rows": len(chosen["sft"]),
        "skipped": chosen["skipped"], "empty_responses": sum(not r for r in responses),
        "mean_score": round(float(scores.mean()), 4),
        "mean_best": round(float(np.mean(chosen["best"])), 4) if chosen["best"] else None,
        "mean_worst": round(float(np.mean(chosen["worst"])), 4),
        "generated_tokens": timing["generated_tokens"],
        "tokens_per_s": round(timing["generated_tokens"] / gen_s, 1) if gen_s > 0 else None,
        "tokens_per_s_after_first_batch": round(rest_tokens / rest_s, 1) if rest_tokens else None,
        "generation_s": round(gen_s, 2), "first_batch_s": round(first_s, 2),
        "wall_s": round(wall_s, 2),
        "args": {k: v for k, v in vars(args).items() if k != "overwrite"},
    }


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")


def held_out_prompts(texts: list[str], fraction: float, seed: int) -> set[str]:
    """A seeded random `fraction` of the prompts (rounded up when > 0): their rows are held out."""
    n = int(np.ceil(fraction * len(texts))) if fraction > 0 else 0
    order = np.random.default_rng(seed).permutation(len(texts))
    return {texts[i] for i in order[:n]}


def write_outputs(out: Path, texts, responses, scores, chosen: dict, summary: dict,
                  held: set[str] = frozenset()) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("pairs", "sft"):
        rows = chosen[name]
        write_jsonl(out / f"{name}.jsonl", [r for r in rows if r["prompt"] not in held])
        if held:
            write_jsonl(out / f"{name}_eval.jsonl", [r for r in rows if r["prompt"] in held])
    write_jsonl(out / "samples.jsonl",
                [{"prompt": t, "responses": r, "scores": [float(x) for x in s]}
                 for t, r, s in zip(texts, responses, scores)])
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def import_modules(names: list[str]) -> None:
    """Import --import modules (from the current directory or installed packages)."""
    sys.path.insert(0, os.getcwd())
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ValueError(f"--import {name}: {e}") from None


def main(argv=None) -> int:
    """Run the script; returns the exit status (0, or 2 on a usage / input error)."""
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        import_modules(args.imports)
        check_args(args)
        from ppo_jax.trainer.data.prompts import read_prompts
        from ppo_jax.trainer.rewards.functions import get_reward_function

        reward = get_reward_function(args.reward)
        texts = read_prompts(args.prompts)[:args.first]
        actor = load_actor(args.actor)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    flat, flat_cut, timing = sample_responses(actor, texts, args)
    try:
        scores = score_all(reward, texts, flat, args.k)
    except ValueError as e:
        print(f"error: --reward {args.reward}: {e}", file=sys.stderr)
        return 2
    responses = [flat[i * args.k:(i + 1) * args.k] for i in range(len(texts))]
    truncated = [flat_cut[i * args.k:(i + 1) * args.k] for i in range(len(texts))]
    chosen = select(texts, responses, scores, args.all_pairs_gap, truncated)
    held = held_out_prompts(texts, args.eval_fraction, args.seed)
    summary = summarize(args, scores, flat, chosen, timing, time.perf_counter() - start)
    summary["held_out_prompts"] = len(held)
    summary["truncated_responses"] = int(sum(flat_cut))
    write_outputs(Path(args.out), texts, responses, scores, chosen, summary, held)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
