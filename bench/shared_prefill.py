"""One prefill per group: generation with `samples_per_prompt` = n sharing each distinct prompt's
prefill (KV cache) with its n samples, against prefilling all n copies; SmolLM2-135M-Instruct,
float32, distinct chat prompts x n (left-padded), temperature 1, exactly `--new-tokens` tokens
(no stop token); both sides draw the same tokens under one key (checked). Generation and
prefill-only calls of every n alternate in the same rounds.

Usage: python bench/shared_prefill.py [--prompts 4] [--samples 4 8] [--new-tokens 32]
    [--rounds 5] [--tiny] [--json PATH]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax
import numpy as np

from harness import (compare, finish, fmt, interleaved, log, options, ratio, spread, stats, table,
                     timed, under_malloc_settings)
from ppo_jax.models import load_model, load_tokenizer, split_model
from ppo_jax.models.smollm2 import ensure_smollm2
from ppo_jax.models.tiny_random import ensure_tiny_random
from ppo_jax.rollout.sampler import generate, prefill

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Give me three tips for staying focused while studying.",
    "Explain photosynthesis to a ten-year-old.", "How do I boil an egg?",
    "What are the benefits of regular exercise?",
    "Tell me a short story about a brave little robot who wanted to see the ocean.",
    "Why is the sky blue?",
]
SIDES = ("repeated", "shared")


def calls(model_dir: Path, prompts: int, samples: list[int], new_tokens: int) -> tuple[dict, dict]:
    """`(fns, info)`: fns `"{gen|prefill} n={n} {side}"` -> a blocking call (generation of
    `new_tokens` tokens, or the prefill alone) on `prompts` distinct chat prompts x n rows;
    info: the model's name, the prompt width and each n's batch."""
    tok = load_tokenizer(model_dir)
    texts = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                     tokenize=False, add_generation_prompt=True)
             for i in range(prompts)]
    enc = tok(texts, return_tensors="np", padding=True)
    model, _ = load_model(model_dir, "causal_lm", param_dtype="float32", dtype="float32")
    graphdef, params = split_model(model)
    kw = dict(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=(),
              pad_token_id=int(tok.pad_token_id))
    fns = {}
    for n in samples:
        ids, mask = (np.repeat(enc[k].astype(np.int32), n, axis=0)
                     for k in ("input_ids", "attention_mask"))
        for side in SIDES:
            share = n if side == "shared" else 1
            fns[f"gen n={n} {side}"] = lambda ids=ids, mask=mask, share=share: (
                jax.block_until_ready(generate(graphdef, params, ids, mask, jax.random.PRNGKey(0),
                                               samples_per_prompt=share, **kw)))
            fns[f"prefill n={n} {side}"] = lambda ids=ids, mask=mask, share=share: (
                jax.block_until_ready(prefill(graphdef, params, ids, mask,
                                              max_new_tokens=new_tokens, samples_per_prompt=share)))
    return fns, {"model": model_dir.name, "prompt_width": int(enc["input_ids"].shape[1]),
                 "batch": {str(n): prompts * n for n in samples}}


def figures(blocks: dict, first: dict, samples: list[int], info: dict, new_tokens: int) -> dict:
    """Per n: each side's generation tokens/s (B x new tokens / wall s), seconds and prefill
    seconds; shared / repeated tokens/s (of the medians, and per round) and prefill speedup."""
    out = {}
    for n in samples:
        tokens, row = info["batch"][str(n)] * new_tokens, {}
        for side in SIDES:
            gen = [t for b in blocks[f"gen n={n} {side}"] for t in b]
            pre = [t for b in blocks[f"prefill n={n} {side}"] for t in b]
            row[side] = {"tokens_per_s": stats(tokens / t for t in gen), "seconds": stats(gen),
                         "prefill_s": stats(pre), "first_call_s": first[f"gen n={n} {side}"]}
        gen = compare(blocks[f"gen n={n} repeated"], blocks[f"gen n={n} shared"])
        pre = compare(blocks[f"prefill n={n} repeated"], blocks[f"prefill n={n} shared"])
        out[str(n)] = {**row, "ratio": gen["ratio_of_medians"], "paired_ratio":
                       gen["paired_ratio"], "prefill_ratio": pre["ratio_of_medians"]}
    return out


def markdown(d: dict) -> str:
    rows = []
    for n, f in d["by_n"].items():
        rep, sh = f["repeated"], f["shared"]
        rows.append([n, d["batch"][n], spread(rep["tokens_per_s"], 1),
                     spread(sh["tokens_per_s"], 1), ratio(f["ratio"], st=f["paired_ratio"]),
                     fmt(rep["prefill_s"]["median"] * 1e3), fmt(sh["prefill_s"]["median"] * 1e3),
                     ratio(f["prefill_ratio"])])
    dry = " DRY RUN on the tiny random model: not a figure to quote." if d["tiny"] else ""
    return "\n".join([
        f"Model `{d['model']}`, float32, {d['prompts']} distinct chat prompts x n samples, prompt "
        f"width {d['prompt_width']}, {d['new_tokens']} new tokens, temperature 1; tokens/s = "
        f"batch x new tokens / one whole `generate` call; median (min–max) of {d['rounds']} "
        f"interleaved rounds after one warm-up call each.{dry}", "",
        table(["n", "batch", "tokens/s, every row prefilled", "tokens/s, one prefill per prompt",
               "shared / repeated (paired rounds)", "prefill ms, every row",
               "prefill ms, per prompt", "prefill speedup"], rows), "",
        f"Same tokens on both sides under one key: {d['identical']}."])


def main() -> None:
    args = options(__doc__, prompts=4, samples=[4, 8], new_tokens=32, rounds=5, tiny=False,
                   json=None)
    with tempfile.TemporaryDirectory(prefix="shared_prefill_") as tmp:
        model_dir = (ensure_tiny_random(Path(tmp) / "tiny-random-llama") if args.tiny
                     else ensure_smollm2())
        fns, info = calls(model_dir, args.prompts, args.samples, args.new_tokens)
        log(f"model {info['model']}, prompt width {info['prompt_width']}, batches "
            f"{info['batch']}, {args.new_tokens} new tokens; jax {jax.__version__}")
        out, first = {}, {}
        for name, fn in fns.items():  # the warm-up (compiling) calls
            first[name] = timed(lambda name=name, fn=fn: out.update({name: fn()}))
        identical = all(np.array_equal(a, b) for n in args.samples for a, b in
                        zip(out[f"gen n={n} shared"], out[f"gen n={n} repeated"]))
        assert identical, "shared and repeated prefills sampled different tokens"
        blocks = interleaved(fns, max(args.rounds, 1))
    finish({"bench": "shared_prefill", "tiny": args.tiny, **info, "prompts": args.prompts,
            "samples": args.samples, "new_tokens": args.new_tokens, "rounds": args.rounds,
            "by_n": figures(blocks, first, args.samples, info, args.new_tokens),
            "identical": identical, "jax": jax.__version__}, markdown, args.json)


if __name__ == "__main__":
    under_malloc_settings()  # as train.py runs (ppo_jax.trainer.host.memory)
    main()
