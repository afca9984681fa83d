"""Generation throughput: ppo_jax's jitted KV-cache sampler vs transformers `generate`.

Same model (SmolLM2-135M-Instruct converted to an HF directory by `ensure_smollm2()`), same
dtype (float32), same batch of real chat-template prompts (left-padded, attention mask passed),
same number of new tokens, greedy decoding on both sides, in the same process:

- ppo_jax: `ppo_jax.rollout.sampler.generate` (prefill + `lax.while_loop` decode, one jitted
  call). Its compile time is reported separately: the wall time the first call spent tracing,
  lowering and compiling (JAX's `/jax/core/compile/*` monitoring events, overlapping spans
  merged), next to the whole first call.
- transformers: `AutoModelForCausalLM.generate(do_sample=False)` on PyTorch CPU (its default
  dynamic KV cache), under `torch.inference_mode()`, once per `--torch-threads` setting
  (default: torch's default thread count, and 1 thread). On a machine shared with other jobs
  PyTorch's OpenMP threads can slow down many times over (each op's barrier waits for a
  descheduled thread), so the headline ratio is taken against the fastest setting measured.

Neither side may stop early: no stop tokens are passed to ours and `eos_token_id=None` to
transformers, and the script checks that every row got exactly `--new-tokens` tokens.
Tokens/s = batch * new_tokens / wall time of one whole `generate` call (prefill included).
After one warm-up call each, the `--runs` timed calls alternate (ours, then transformers at each
thread setting, then ours again, ...) so that load from other processes drifting over time hits
both sides alike; steady state is the median, with min and max, and the paired ratio of each
ours/transformers pair.
It also reports how many rows of the two greedy outputs agree token for token.

Usage: ``python bench/generate.py [--batch 8] [--new-tokens 64] [--runs 5]
[--torch-threads 0 1] [--json PATH]``.
`--json` writes the figures (the `generate.json` that `bench/report.py` reads). torch is a
benchmark-only dependency.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import jax
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_info, cpu_line, machine_load, run_record, under_malloc_settings, stats, write_json  # noqa: E402
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
COMPILE_EVENTS = "/jax/core/compile/"  # jaxpr trace, jaxpr -> MLIR, backend (XLA) compile


def chat_batch(tok, batch: int):
    """`batch` chat-template prompts, tokenized and left-padded -> (ids, mask) int32 numpy."""
    texts = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                     tokenize=False, add_generation_prompt=True)
             for i in range(batch)]
    enc = tok(texts, return_tensors="np", padding=True)
    return enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)


class CompileClock:
    """Wall time spent in JAX tracing / lowering / XLA compilation while active.

    Listens to JAX's `/jax/core/compile/*` time-span events and merges overlapping spans (a
    nested jit is traced inside its caller's trace), so nothing is counted twice.
    """

    def __init__(self):
        self.spans: list[tuple[str, float, float]] = []
        self.active = False
        jax.monitoring.register_event_time_span_listener(self._on_span)

    def _on_span(self, event, start, end, **_):
        if self.active and event.startswith(COMPILE_EVENTS):
            self.spans.append((event, start, end))

    def total_s(self, event_suffix: str = "") -> float:
        spans = sorted((s, e) for ev, s, e in self.spans if ev.endswith(event_suffix))
        total, cur_s, cur_e = 0.0, None, None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                total += 0.0 if cur_e is None else cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        return total + (0.0 if cur_e is None else cur_e - cur_s)


def timed_call(fn, clock: CompileClock | None = None):
    """(seconds, result) of one call, with `clock` recording compilation during it."""
    if clock is not None:
        clock.active = True
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    if clock is not None:
        clock.active = False
    return dt, out


def summary(name: str, times, tokens: int) -> dict:
    """Print one line of steady-state figures; return them as a JSON-able dict."""
    med = statistics.median(times)
    tps = [tokens / t for t in times]
    print(f"{name:>20}: {tokens / med:8.1f} tok/s  (median {med * 1e3:7.1f} ms/call, "
          f"min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}; tok/s range "
          f"{min(tps):.1f}-{max(tps):.1f}; {len(times)} runs)")
    return {"tokens_per_s": stats(tps), "seconds": stats(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5,
                        help="timed calls per side after one warm-up")
    parser.add_argument("--model-dir", default=None, help="HF dir (default: ensure_smollm2())")
    parser.add_argument("--torch-threads", type=int, nargs="+", default=[0, 1],
                        help="torch thread counts to time transformers with (0 = torch's default)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    n, runs = args.new_tokens, max(args.runs, 3)
    print(f"CPU: {cpu_line(cpu_info())}", flush=True)

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

    clock = CompileClock()
    first, (ours_ids, ours_mask) = timed_call(ours, clock)
    compile_s, xla_s = clock.total_s(), clock.total_s("backend_compile_duration")
    ours_ids, ours_mask = np.asarray(ours_ids), np.asarray(ours_mask)
    assert ours_ids.shape == (ids.shape[0], n) and ours_mask.all(), "ours stopped early"

    # ------------------------------------------------------------------ transformers
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t_ids, t_mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
    default_threads = torch.get_num_threads()
    settings = list(dict.fromkeys(t if t > 0 else default_threads for t in args.torch_threads))

    def theirs(threads: int):
        torch.set_num_threads(threads)
        with torch.inference_mode():
            return hf.generate(t_ids, attention_mask=t_mask, max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id,
                               temperature=None, top_p=None, top_k=None)

    hf_first, hf_ids = {}, {}
    for th in settings:
        hf_first[th], out = timed_call(partial(theirs, th))
        hf_ids[th] = out[:, ids.shape[1]:].numpy()
        assert hf_ids[th].shape == (ids.shape[0], n), \
            f"transformers generated {hf_ids[th].shape[1]} tokens"

    # ------------------------------------------------------------------ timed, alternating
    jax_times, hf_times = [], {th: [] for th in settings}
    for _ in range(runs):
        jax_times.append(timed_call(ours)[0])
        for th in settings:
            hf_times[th].append(timed_call(partial(theirs, th))[0])
    torch.set_num_threads(default_threads)

    # ------------------------------------------------------------------ report
    print(f"ppo_jax compile: {compile_s:.1f} s (trace + lower + XLA compile in the first call; "
          f"XLA alone {xla_s:.1f} s); first call {first:.1f} s; transformers first call "
          + ", ".join(f"{hf_first[th]:.2f} s ({th} threads)" for th in settings))
    ours_fig = summary("ppo_jax", jax_times, tokens)
    hf_figs = {th: summary(f"transformers ({th} thr)" if len(settings) > 1 else "transformers",
                           hf_times[th], tokens) for th in settings}
    best = max(settings, key=lambda th: hf_figs[th]["tokens_per_s"]["median"])
    ratios = {th: ours_fig["tokens_per_s"]["median"] / hf_figs[th]["tokens_per_s"]["median"]
              for th in settings}
    paired = {th: [h / j for j, h in zip(jax_times, hf_times[th])] for th in settings}
    for th in settings:
        tag = " <- the fastest setting" if len(settings) > 1 and th == best else ""
        print(f"ratio ppo_jax / transformers ({th} threads): {ratios[th]:.2f}x (medians; "
              f"paired-run range {min(paired[th]):.2f}-{max(paired[th]):.2f}x){tag}")
    print(f"ratio ppo_jax / transformers: {ratios[best]:.2f}x (vs its fastest setting, {best} "
          f"threads); target >= 2x")
    same = {th: (ours_ids == hf_ids[th]).all(axis=1) for th in settings}
    first_diff = {th: [int(np.argmax(a != b))
                       for a, b, s in zip(ours_ids, hf_ids[th], same[th]) if not s]
                  for th in settings}
    print(f"greedy rows identical token for token: {int(same[best].sum())}/{len(same[best])}"
          + (f" (first divergence at steps {first_diff[best]})" if first_diff[best] else ""))

    if args.json:
        data = {
            "model": model_dir.name, "dtype": "float32", "batch": int(ids.shape[0]),
            "prompt_width": int(ids.shape[1]), "new_tokens": n, "runs": runs,
            "ppo_jax": {**ours_fig, "first_call_s": first},
            "transformers": {**hf_figs[best], "first_call_s": hf_first[best],
                             "torch_threads": best},
            "transformers_by_threads": {str(th): {**hf_figs[th], "first_call_s": hf_first[th]}
                                        for th in settings},
            "ratio": ratios[best], "paired_ratio": stats(paired[best]),
            "ratio_by_threads": {str(th): ratios[th] for th in settings},
            "paired_ratio_by_threads": {str(th): stats(paired[th]) for th in settings},
            "target_ratio": 2.0,
            "compile_s": compile_s, "xla_compile_s": xla_s,
            "identical_rows": int(same[best].sum()), "first_divergence_steps": first_diff[best],
            "versions": {"jax": jax.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "torch_default_threads": default_threads,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), **machine_load(), **run_record(),
            "command": ".venv/bin/python bench/generate.py " + shlex.join(sys.argv[1:]),
        }
        write_json(args.json, data)


if __name__ == "__main__":
    under_malloc_settings()  # as train.py runs (ppo_jax.trainer.host_memory)
    main()
