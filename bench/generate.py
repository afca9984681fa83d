"""Generation throughput: ppo_jax's jitted KV-cache sampler vs transformers `generate`.

Same model (SmolLM2-135M-Instruct converted to an HF directory by `ensure_smollm2()`), same
dtype (float32), same batch of real chat-template prompts (left-padded, attention mask passed),
same number of new tokens, greedy decoding on both sides, in the same process:

- ppo_jax: `ppo_jax.rollout.sampler.generate` (prefill + `lax.while_loop` decode, one jitted
  call). Compile time (first call minus a steady-state call) is reported separately.
- transformers: `AutoModelForCausalLM.generate(do_sample=False)` on PyTorch CPU (its default
  dynamic KV cache), under `torch.inference_mode()`.

Neither side may stop early: no stop tokens are passed to ours and `eos_token_id=None` to
transformers, and the script checks that every row got exactly `--new-tokens` tokens.
Tokens/s = batch * new_tokens / wall time of one whole `generate` call (prefill included).
Steady state is the median of `--runs` timed calls after one warm-up call, with min and max.
It also reports how many rows of the two greedy outputs agree token for token.

Usage: ``python bench/generate.py [--batch 8] [--new-tokens 64] [--runs 5]``.
torch is a benchmark-only dependency.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from ppo_jax.models import load_model, load_tokenizer, split_model  # noqa: E402
from ppo_jax.models.smollm2 import ensure_smollm2  # noqa: E402
from ppo_jax.rollout.sampler import generate  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying focused while studying.",
    "Explain photosynthesis to a ten-year-old.",
    "How do I boil an egg?",
    "What are the benefits of regular exercise?",
    "Tell me a short story about a brave little robot who wanted to see the ocean.",
    "Why is the sky blue?",
]


def chat_batch(tok, batch: int):
    """`batch` chat-template prompts, tokenized and left-padded -> (ids, mask) int32 numpy."""
    texts = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                     tokenize=False, add_generation_prompt=True)
             for i in range(batch)]
    enc = tok(texts, return_tensors="np", padding=True)
    return enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)


def timed(fn, runs: int):
    """(first-call seconds, [steady seconds] of `runs` calls after the first, last result)."""
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return first, times, out


def summary(name: str, times, tokens: int) -> float:
    med = statistics.median(times)
    tps = [tokens / t for t in times]
    print(f"{name:>13}: {tokens / med:8.1f} tok/s  (median {med * 1e3:7.1f} ms/call, "
          f"min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}; tok/s range "
          f"{min(tps):.1f}-{max(tps):.1f}; {len(times)} runs)")
    return tokens / med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5, help="timed calls after one warm-up")
    parser.add_argument("--model-dir", default=None, help="HF dir (default: ensure_smollm2())")
    args = parser.parse_args()
    n, runs = args.new_tokens, max(args.runs, 3)

    model_dir = Path(args.model_dir) if args.model_dir else ensure_smollm2()
    tok = load_tokenizer(model_dir)
    ids, mask = chat_batch(tok, args.batch)
    tokens = ids.shape[0] * n
    print(f"model {model_dir.name}, float32, batch {ids.shape[0]}, prompt width {ids.shape[1]} "
          f"(real lengths {mask.sum(1).min()}-{mask.sum(1).max()}), {n} new tokens, greedy")
    print(f"jax {jax.__version__} ({jax.default_backend()}, XLA_FLAGS="
          f"{os.environ.get('XLA_FLAGS', '')!r}); torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); CPUs {os.cpu_count()}")

    # ------------------------------------------------------------------ ppo_jax
    model, _ = load_model(model_dir, "causal_lm", param_dtype="float32", dtype="float32")
    graphdef, params = split_model(model)
    rng = jax.random.PRNGKey(0)

    def ours():
        out, out_mask = generate(graphdef, params, ids, mask, rng, max_new_tokens=n, greedy=True,
                                 stop_token_ids=(), pad_token_id=int(tok.pad_token_id))
        return jax.block_until_ready((out, out_mask))

    first, jax_times, (ours_ids, ours_mask) = timed(ours, runs)
    ours_ids, ours_mask = np.asarray(ours_ids), np.asarray(ours_mask)
    assert ours_ids.shape == (ids.shape[0], n) and ours_mask.all(), "ours stopped early"
    compile_s = first - statistics.median(jax_times)

    # ------------------------------------------------------------------ transformers
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t_ids, t_mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def theirs():
        with torch.inference_mode():
            return hf.generate(t_ids, attention_mask=t_mask, max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id,
                               temperature=None, top_p=None, top_k=None)

    hf_first, hf_times, hf_out = timed(theirs, runs)
    hf_ids = hf_out[:, ids.shape[1]:].numpy()
    assert hf_ids.shape == (ids.shape[0], n), f"transformers generated {hf_ids.shape[1]} tokens"

    # ------------------------------------------------------------------ report
    print(f"ppo_jax compile: {compile_s:.1f} s (first call {first:.1f} s minus a steady call); "
          f"transformers first call {hf_first:.2f} s")
    ours_tps = summary("ppo_jax", jax_times, tokens)
    hf_tps = summary("transformers", hf_times, tokens)
    ratios = sorted(h / j for j, h in zip(jax_times, hf_times))
    print(f"ratio ppo_jax / transformers: {ours_tps / hf_tps:.2f}x (medians; paired-run range "
          f"{ratios[0]:.2f}-{ratios[-1]:.2f}x); target >= 2x")
    same = (ours_ids == hf_ids).all(axis=1)
    print(f"greedy rows identical token for token: {int(same.sum())}/{len(same)}", end="")
    if not same.all():
        first_diff = [int(np.argmax(a != b)) for a, b, s in zip(ours_ids, hf_ids, same) if not s]
        print(f" (first divergence at steps {first_diff})", end="")
    print()


if __name__ == "__main__":
    main()
