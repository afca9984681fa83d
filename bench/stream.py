"""The paged engine's stream (rollout.stream) against one `generate` call per batch: decode
steps, slot occupancy and wall time for K batches of heavy-tailed responses, random weights.

Each response stops at any of `--stops` tokens spread over the vocabulary (geometric lengths,
mean about V / stops, cut at `--new-tokens`). `generate` answers the batches one after another,
each until its longest row stops; the stream (`--in-flight` batches in its ring) admits the
next batch's rows as slots free up. Modes: `fixed` (one set of weights, the tokens checked
equal to generate's), `partial` (new weights, a perturbed copy, after every returned batch,
KV recomputed), `keep` (the same, KV kept), `consistent` (no partial rollouts: a drain per
switch). Times are the median of `--rounds` rounds after a warm-up round (compiles).

Usage: python bench/stream.py [--batches 8] [--batch 32] [--new-tokens 128] [--stops 16]
    [--slots 32] [--chunk 8] [--in-flight 2] [--rounds 3]
(a 4-layer, 128-wide Llama of random weights, vocabulary 512, prompts of 16 tokens)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ppo_jax.models import split_model  # noqa: E402
from ppo_jax.models.heads import init_model  # noqa: E402
from ppo_jax.models.tiny_random import tiny_config  # noqa: E402
from ppo_jax.rollout.draws import SamplingSettings  # noqa: E402
from ppo_jax.rollout.engine import PagedEngine  # noqa: E402
from ppo_jax.rollout.engine_layout import EngineSettings  # noqa: E402

VOCAB, WIDTH = 512, 16


def build(args):
    cfg = tiny_config(VOCAB, hidden_size=128, intermediate_size=256, num_layers=4, head_dim=32)
    graphdef, params = split_model(init_model(cfg, seed=0))
    stops = tuple(int(x) for x in np.linspace(3, VOCAB - 1, args.stops).astype(int))
    sampling = SamplingSettings(max_new_tokens=args.new_tokens, temperature=1.0, top_k=0,
                                top_p=1.0, greedy=False, stop_token_ids=stops, pad_token_id=0,
                                samples_per_prompt=1, mesh=None, turns=None, record_routes=False)
    settings = EngineSettings(page_size=16, num_pages=0, max_concurrent=args.slots,
                              decode_chunk=args.chunk, decode_buckets=4, attention="reference")
    engine = PagedEngine(graphdef, cfg, sampling, settings, batch=args.batch, prompt_width=WIDTH)
    rng = np.random.default_rng(0)
    batches = [(jnp.asarray(rng.integers(4, VOCAB, (args.batch, WIDTH)), jnp.int32),
                jnp.ones((args.batch, WIDTH), jnp.int32), jax.random.PRNGKey(100 + i))
               for i in range(args.batches)]
    other = jax.tree.map(lambda x: x * 1.01, params)  # "new weights": a perturbed copy
    return engine, params, other, batches


def run_generate(engine, params, batches):
    steps, row_steps, outs = 0, 0, []
    for ids, mask, key in batches:
        outs.append(engine.generate(params, ids, mask, key))
        steps, row_steps = steps + engine.last_stats.steps, row_steps + engine.last_stats.row_steps
    jax.block_until_ready(outs)
    return outs, {"decode_steps": steps, "row_steps": row_steps}


def run_stream(engine, params, other, batches, mode, in_flight):
    stream = engine.stream(params, 0, max_batches_in_flight=in_flight,
                           partial_rollouts=mode != "consistent",
                           kv_on_switch="keep" if mode == "keep" else "recompute")
    for i, (ids, mask, key) in enumerate(batches):
        stream.submit(ids, mask, key, tag=i)
    done, given = [], 0
    while stream.in_flight:
        for b in stream.step():
            done.append(b)
            if mode != "fixed":  # a trainer step per returned batch: new weights
                given += 1
                stream.set_params(other if given % 2 else params, given)
    jax.block_until_ready([b.generation for b in done])
    s = stream.stats
    spread = max(int(b.versions.max() - b.versions[b.versions >= 0].min()) for b in done)
    return done, {"decode_steps": s.engine.steps, "row_steps": s.engine.row_steps,
                  "chunks": s.engine.chunks,
                  "occupancy": round(s.engine.slot_occupancy / max(s.engine.chunks, 1), 3),
                  "mixed_chunks": s.mixed_chunks, "drain_chunks": s.drain_chunks,
                  "refills": s.refills, "switches": s.switches, "max_version_spread": spread}


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("batches", 8), ("batch", 32), ("new-tokens", 128), ("stops", 16),
                          ("slots", 32), ("chunk", 8), ("in-flight", 2), ("rounds", 3)):
        ap.add_argument(f"--{name}", type=int, default=default)
    args = ap.parse_args()
    engine, params, other, batches = build(args)
    results = {}
    for name in ("generate", "fixed", "partial", "keep", "consistent"):
        times = []
        for _ in range(args.rounds + 1):
            t0 = time.perf_counter()
            if name == "generate":
                out, figures = run_generate(engine, params, batches)
            else:
                out, figures = run_stream(engine, params, other, batches, name, args.in_flight)
            times.append(time.perf_counter() - t0)
        if name == "generate":
            want = out
            tokens = sum(int(np.asarray(g.response_mask).sum()) for g in out)
        if name == "fixed":
            for b in out:
                for g, w in zip(b.generation[:2], want[b.tag][:2]):
                    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        figures["seconds"] = round(float(np.median(times[1:])), 3)
        results[name] = figures
        print(name, figures, flush=True)
    base = results["generate"]["seconds"]
    print(f"responses {args.batches} x {args.batch}, {tokens} tokens "
          f"(mean {tokens / args.batches / args.batch:.1f} of {args.new_tokens}); "
          f"generate {tokens / base:.0f} tok/s; " + ", ".join(
              f"{k} x{base / v['seconds']:.2f}" for k, v in results.items() if k != "generate"))


if __name__ == "__main__":
    main()
