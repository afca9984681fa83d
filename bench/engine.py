"""The paged engine against the static sampler: useful generated tokens per second at equal KV
memory, SmolLM2-135M-Instruct, float32, the same tokens on both sides (checked on the CPU in
float32; elsewhere the share of identical rows is reported).

Workloads (`--workload`, one or more):
  heavy:   `--responses` (256) responses to the everyday prompts (configs/default.yaml's data) at
           temperature 1, up to `--new-tokens` (256) tokens, stopping at EOS. The static
           sampler's KV memory holds `--rows` (64) rows at full length, so it answers the batch
           in sub-batches of `rows`, each decoding until its longest row stops; the engine gets
           the same memory (a pool of rows x (P + N) / page_size pages) and `--slots` slots.
  default: `make train`'s sampler: 16 everyday prompts, 40 tokens, one batch on both sides.
  rlvr:    `make rlvr`'s: 8 chain-sum problems x 8 samples, 16 tokens, one prefill per group.
Each round times every side, in alternating order, after a warm-up call (compiles).

Accelerators (no model download there; bench/gpu.sh): `--random-stops K` runs random weights
of SmolLM2's shape (harness.SHAPES, in `--dtype`) with K stop tokens spread over the vocabulary:
a response ends at each token with probability ~K / V, geometric lengths cut at `--new-tokens`.

Usage: python bench/engine.py [--workload heavy default rlvr] [--rounds 2] [--slots 64 128]
    [--rows 64] [--responses 256] [--new-tokens 256] [--chunk 8] [--page-size 16] [--tiny]
    [--random-stops K] [--dtype float32] [--buckets 4] [--json PATH]
    (--tiny: random weights of the tiny shape, a check of the script, not a figure; several --slots:
    one engine per slot count against the same static sub-batches)
"""

from __future__ import annotations

from functools import partial

import numpy as np

from harness import (ROOT, finish, fmt, interleaved, log, options, random_model, ratio, stats, table,
                     timed, under_malloc_settings)


def workload(name: str, args):
    """`(config, batch rows, static rows per call, EngineSettings kwargs)` of a workload."""
    from ppo_jax.trainer.config import load_config

    if name == "heavy":
        cfg = load_config(ROOT / "configs/default.yaml",
                          [f"generation.max_new_tokens={args.new_tokens}"])
        return cfg, args.responses, args.rows, dict(max_concurrent=args.slots)
    cfg = load_config(ROOT / ("configs/default.yaml" if name == "default" else "configs/rlvr.yaml"))
    return cfg, cfg.ppo.batch_size, cfg.ppo.batch_size, {}


def model_dir(args):
    """SmolLM2-135M-Instruct, or random weights of the tiny shape (`--tiny`) or of SmolLM2's
    (`--random-stops`)."""
    from ppo_jax.models.packaged import ensure_packaged

    if args.tiny or args.random_stops:
        return random_model("tiny" if args.tiny else "smollm2")
    return ensure_packaged("smollm2")


def build(name: str, args):
    """Blocking calls `{"static", "paged <slots>"}` -> (tokens, mask), the engines and the
    workload's facts."""
    import jax

    from ppo_jax.models import load_model, load_tokenizer, split_model
    from ppo_jax.rollout.engine import PagedEngine
    from ppo_jax.rollout.engine_layout import EngineSettings
    from ppo_jax.rollout.scheduler import pages_for
    from ppo_jax.rollout.draws import SamplingSettings
    from ppo_jax.rollout.static_batch import generate
    from ppo_jax.trainer.loading.models import pad_token_id, prompt_set, stop_token_ids

    cfg, batch, rows, extra = workload(name, args)
    path = model_dir(args)
    tok, (model, _) = load_tokenizer(path), load_model(path, "causal_lm", param_dtype=args.dtype,
                                                        dtype=args.dtype)
    graphdef, params = split_model(model)
    prompts = prompt_set(cfg, tok, model.cfg, cfg.data.prompts, "data.prompts")
    n, g = cfg.generation.samples_per_prompt, cfg.generation
    idx = np.repeat(np.arange(batch // n) % len(prompts), n)
    ids, mask = prompts.ids[idx], prompts.mask[idx]  # left-padded to the set's widest prompt
    width = ids.shape[1]
    vocab, k = model.cfg.vocab_size, args.random_stops
    stops = (tuple(range(vocab // k // 2, vocab, vocab // k))[:k] if k
             else stop_token_ids(cfg, tok, model.cfg))
    kw = dict(max_new_tokens=g.max_new_tokens, temperature=g.temperature, stop_token_ids=stops,
              pad_token_id=pad_token_id(tok, model.cfg), samples_per_prompt=n)
    pool = 1 + rows * pages_for(width + g.max_new_tokens, args.page_size)
    sampling = SamplingSettings(**kw, top_k=0, top_p=1.0, greedy=False, mesh=None, turns=None)
    engines = [PagedEngine(graphdef, model.cfg, sampling,
                           EngineSettings(page_size=args.page_size, num_pages=pool, max_concurrent=slots,
                                          decode_chunk=args.chunk, decode_buckets=args.buckets,
                                          attention="reference"),
                           batch=batch, prompt_width=width) for slots in (args.slots if extra else [0])]
    engines = {f"paged {e.layout.slots * e.layout.replicas}": e for e in engines}
    key = jax.random.PRNGKey(0)

    def static():
        outs = [generate(graphdef, params, ids[s:s + rows], mask[s:s + rows], key, first_row=s,
                         **kw) for s in range(0, batch, rows)]
        return tuple(np.concatenate([np.asarray(o[i]) for o in outs]) for i in (0, 1))

    def paged(engine):
        out = engine.generate(params, jax.numpy.asarray(ids), jax.numpy.asarray(mask), key)
        return tuple(np.asarray(x) for x in out[:2])

    facts = dict(batch=batch, static_rows=rows, pool_pages=pool, page_size=args.page_size, chunk=args.chunk,
                 buckets=args.buckets, device=jax.devices()[0].device_kind, new_tokens=g.max_new_tokens,
                 prompt_width=width, samples_per_prompt=n, dtype=args.dtype, random_stops=k)
    return {"static": static, **{side: partial(paged, e) for side, e in engines.items()}}, engines, facts


def measure(name: str, args) -> dict:
    """Warm-up calls (compiles; the tokens checked equal), then `rounds` rounds of every side in
    alternating order: lengths, seconds, tokens / s and each engine's ratio to static."""
    fns, engines, facts = build(name, args)
    out = {}
    for side, fn in fns.items():
        seconds = timed(lambda: out.__setitem__(side, fn()))
        log(f"{name} warm-up {side}: {seconds:.1f} s")
    # share of rows with equal tokens and mask: 1.0 in float32 on the CPU (checked); in bfloat16, or
    # where a GPU picks its matmul algorithm by batch shape, some sampled rows part ways
    agree = {side: float((np.all(out["static"][0] == out[side][0], axis=1)
                          & np.all(out["static"][1] == out[side][1], axis=1)).mean()) for side in engines}
    if facts["dtype"] == "float32" and facts["device"] == "cpu":
        for side, same in agree.items():
            if same < 1.0:
                raise AssertionError(f"{name}: {side}'s tokens differ from the static sampler's")
    lengths, rows = out["static"][1].sum(axis=1), facts["static_rows"]
    times = {side: [t for (t,) in blocks] for side, blocks in interleaved(fns, args.rounds).items()}
    useful = int(lengths.sum())
    sides = {side: {"slots": e.layout.slots * e.layout.replicas, "rows_identical": agree[side],
                    "useful_tokens": int(out[side][1].sum()),
                    "tokens_per_s": int(out[side][1].sum()) / stats(times[side])["median"],
                    "ratio": stats((s / useful) / (p / int(out[side][1].sum()))
                                   for s, p in zip(times["static"], times[side])),
                    **{k: getattr(e.last_stats, k) for k in ("steps", "row_steps", "chunks", "prefills",
                                                             "slot_occupancy", "preemptions", "peak_pages")}}
             for side, e in engines.items()}
    return {**facts, "useful_tokens": useful, "seconds": {k: stats(t) for k, t in times.items()},
            "lengths": {"mean": float(lengths.mean()), "p50": float(np.percentile(lengths, 50)),
                        "p90": float(np.percentile(lengths, 90)), "max": int(lengths.max())},
            "static_steps": int(sum(lengths[s:s + rows].max() for s in range(0, len(lengths), rows))),
            "static_tokens_per_s": useful / stats(times["static"])["median"], "engines": sides}


def render(data: dict) -> str:
    rows = []
    for name, r in data["workloads"].items():
        ln = r["lengths"]
        for side in r["engines"].values():
            rows.append([name, f"{r['batch']} / {r['static_rows']} / {side['slots']}",
                         f"{fmt(ln['mean'], 1)} / {fmt(ln['p50'], 0)} / {fmt(ln['p90'], 0)} / "
                         f"{ln['max']} of {r['new_tokens']} ({ln['mean'] / r['new_tokens']:.2f})",
                         fmt(r["static_tokens_per_s"], 1), fmt(side["tokens_per_s"], 1),
                         ratio(side["ratio"]["median"], st=side["ratio"]),
                         f"{r['static_steps']} x {r['static_rows']} / {side['row_steps']}",
                         f"{side['slot_occupancy']:.2f}", side["preemptions"],
                         f"{side['rows_identical']:.2f}"])
    head = ["workload", "responses / static rows / slots", "length mean / p50 / p90 / max (mean/max)",
            "static tok/s", "paged tok/s", "paged / static", "decode row-steps static / paged",
            "slot occupancy", "preemptions", "rows identical"]
    first = next(iter(data["workloads"].values()))
    model = (f"random weights of SmolLM2-135M's shape with {first['random_stops']} stop tokens"
             if first["random_stops"] else "SmolLM2-135M-Instruct")
    return ("Useful generated tokens per second (response tokens up to and including the stop "
            f"token), {model}, {first['dtype']}, {first['device']}, equal KV memory (pool = "
            f"static rows x cache length); each side's tokens / s counts its own responses "
            f"(identical rows: checked equal in float32 on the CPU); {data['rounds']} rounds, "
            f"medians (ratio: per-round pairs).\n\n" + table(head, rows))


def main() -> None:
    args = options(__doc__, workload=["heavy", "default", "rlvr"], rounds=2, slots=[64], rows=64,
                   responses=256, new_tokens=256, chunk=8, page_size=16, tiny=False,
                   random_stops=0, dtype="float32", buckets=4, json=None)
    under_malloc_settings()
    data = {"rounds": args.rounds,
            "workloads": {name: measure(name, args) for name in args.workload}}
    finish(data, render, args.json)


if __name__ == "__main__":
    main()
