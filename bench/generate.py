"""Generation: ppo_jax's jitted KV-cache sampler against transformers `generate` (PyTorch CPU, at
its default thread count), SmolLM2-135M-Instruct, float32, the same left-padded chat prompts,
greedy, exactly `--new-tokens` tokens (checked); timed calls alternate.

Usage: python bench/generate.py [--new-tokens 64] [--runs 5] [--json PATH]
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import torch

from harness import (compare, finish, fmt, interleaved, log, options, ratio, spread, stats,
                     table, timed, under_malloc_settings)
from ppo_jax.models import load_model, load_tokenizer, split_model
from ppo_jax.models.packaged import ensure_packaged
from ppo_jax.rollout.static_batch import generate

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Give me three tips for staying focused while studying.",
    "Explain photosynthesis to a ten-year-old.", "How do I boil an egg?",
    "What are the benefits of regular exercise?",
    "Tell me a short story about a brave little robot who wanted to see the ocean.",
    "Why is the sky blue?",
]


def load_sides(model_dir: Path, batch: int, n: int) -> SimpleNamespace:
    """Both samplers on the same left-padded chat prompts, float32: `ours()`, `theirs()`, one
    greedy call of exactly `n` new tokens each; also the prompts' `ids`."""
    import transformers

    tok = load_tokenizer(model_dir)
    enc = tok([tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                       tokenize=False, add_generation_prompt=True)
               for i in range(batch)], return_tensors="np", padding=True)
    ids, mask = enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)
    model, _ = load_model(model_dir, "causal_lm", param_dtype="float32", dtype="float32")
    graphdef, params = split_model(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t_ids, t_mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def ours():
        return jax.block_until_ready(generate(
            graphdef, params, ids, mask, jax.random.PRNGKey(0), max_new_tokens=n, greedy=True,
            stop_token_ids=(), pad_token_id=int(tok.pad_token_id)))

    def theirs():
        with torch.inference_mode():
            return hf.generate(t_ids, attention_mask=t_mask, max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id,
                               temperature=None, top_p=None, top_k=None)

    return SimpleNamespace(ids=ids, ours=ours, theirs=theirs, transformers=transformers.__version__)


def markdown(d: dict) -> str:
    r, t, p = d["ppo_jax"], d["transformers"], d["paired_ratio"]
    rows = [["ppo_jax jitted KV-cache sampler", spread(r["tokens_per_s"], 1), spread(r["seconds"], 3),
             fmt(r["first_call_s"]), "—"],
            [f"transformers `generate` (PyTorch CPU, {t['torch_threads']} threads)", spread(t["tokens_per_s"], 1),
             spread(t["seconds"], 3), fmt(t["first_call_s"]),
             f"{ratio(d['ratio'])} (paired runs {ratio(p['min'])}–{ratio(p['max'])})"]]
    return "\n".join([
        f"Model `{d['model']}`, float32, batch {d['batch']}, prompt width {d['prompt_width']}, "
        f"{d['new_tokens']} new tokens, greedy; tokens/s = batch x new tokens / one whole call; "
        f"median (min–max) of {d['runs']} alternating calls after one warm-up call.", "",
        table(["implementation", "tokens/s", "s per call", "first call s", "ppo_jax / this (medians)"], rows), "",
        f"ppo_jax compile (first call minus the median): {d['compile_s']:.1f} s; greedy rows identical "
        f"token for token: {d['identical_rows']}/{d['batch']}."])


def main() -> None:
    args = options(__doc__, new_tokens=64, runs=5, json=None)
    n, runs, model_dir = args.new_tokens, max(args.runs, 3), ensure_packaged("smollm2")
    sides = load_sides(model_dir, 8, n)
    batch, width = sides.ids.shape
    log(f"model {model_dir.name}, float32, batch {batch}, prompt width {width}, {n} new tokens, "
        f"greedy; jax {jax.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads)")
    fns, out = {"ppo_jax": sides.ours, "transformers": sides.theirs}, {}
    first = {name: timed(lambda name=name: out.update({name: fns[name]()})) for name in fns}  # warm-up calls
    ours_ids, ours_mask = (np.asarray(x) for x in out["ppo_jax"])
    theirs_ids = out["transformers"][:, width:].numpy()
    assert ours_ids.shape == (batch, n) and ours_mask.all(), "ours stopped early"
    assert theirs_ids.shape == (batch, n), f"transformers generated {theirs_ids.shape[1]} tokens"
    blocks = interleaved(fns, runs)

    def figures(name):
        times = [t for r in blocks[name] for t in r]
        return {"tokens_per_s": stats(batch * n / t for t in times), "seconds": stats(times),
                "first_call_s": first[name]}

    ours, hf = figures("ppo_jax"), figures("transformers")
    same = (ours_ids == theirs_ids).all(axis=1)
    finish({"bench": "generate", "model": model_dir.name, "dtype": "float32", "batch": batch,
            "prompt_width": width, "new_tokens": n, "runs": runs, "ppo_jax": ours,
            "transformers": {**hf, "torch_threads": torch.get_num_threads()},
            "ratio": ours["tokens_per_s"]["median"] / hf["tokens_per_s"]["median"],
            "paired_ratio": compare(blocks["transformers"], blocks["ppo_jax"])["paired_ratio"],
            "compile_s": first["ppo_jax"] - ours["seconds"]["median"], "identical_rows": int(same.sum()),
            "first_divergence_steps": [int(np.argmax(a != b))
                                       for a, b, s in zip(ours_ids, theirs_ids, same) if not s],
            "versions": {"jax": jax.__version__, "torch": torch.__version__,
                         "transformers": sides.transformers},
            "xla_flags": os.environ.get("XLA_FLAGS", "")}, markdown, args.json)


if __name__ == "__main__":
    under_malloc_settings()  # as train.py runs (ppo_jax.trainer.host.memory)
    main()
