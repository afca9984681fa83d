"""The paged engine against the static sampler: useful generated tokens per second at equal KV
memory, SmolLM2-135M-Instruct, float32, the same tokens on both sides (checked).

Workloads (`--workload`, one or more):
  heavy:   `--responses` (256) responses to the everyday prompts (configs/default.yaml's data) at
           temperature 1, up to `--new-tokens` (256) tokens, stopping at EOS. The static
           sampler's KV memory holds `--rows` (64) rows at full length, so it answers the batch
           in sub-batches of `rows`, each decoding until its longest row stops; the engine gets
           the same memory (a pool of rows x (P + N) / page_size pages) and `--slots` slots.
  default: `make train`'s sampler: 16 everyday prompts, 40 tokens, one batch on both sides.
  rlvr:    `make rlvr`'s: 8 chain-sum problems x 8 samples, 16 tokens, one prefill per group.
Each round times both sides in alternating order after a warm-up call (compiles); the table
gives the length distribution, tokens / s of each side and their ratio, the engine's decode
steps and slot occupancy against the static decode steps (every sub-batch runs to its longest).

Usage: python bench/engine.py [--workload heavy default rlvr] [--rounds 2] [--slots 64]
    [--rows 64] [--responses 256] [--new-tokens 256] [--chunk 8] [--page-size 16] [--tiny]
    [--json PATH]   (--tiny: the tiny random model, a check of the script, not a figure)
"""

from __future__ import annotations

import numpy as np

from harness import ROOT, finish, fmt, log, options, ratio, stats, table, timed, under_malloc_settings


def workload(name: str, args):
    """`(config, batch rows, static rows per call, EngineSettings kwargs)` of a workload."""
    from ppo_jax.trainer.config import load_config

    if name == "heavy":
        cfg = load_config(ROOT / "configs/default.yaml",
                          [f"generation.max_new_tokens={args.new_tokens}"])
        return cfg, args.responses, args.rows, dict(max_concurrent=args.slots)
    cfg = load_config(ROOT / ("configs/default.yaml" if name == "default" else "configs/rlvr.yaml"))
    return cfg, cfg.ppo.batch_size, cfg.ppo.batch_size, {}


def build(name: str, args):
    """Blocking calls `{"static", "paged"}` -> (tokens, mask) and the workload's facts."""
    import jax

    from ppo_jax.models import load_model, load_tokenizer, split_model
    from ppo_jax.models.smollm2 import ensure_smollm2
    from ppo_jax.models.tiny_random import ensure_tiny_random
    from ppo_jax.rollout.engine import EngineSettings, PagedEngine, pages_for
    from ppo_jax.rollout.sampler import SamplingSettings, generate
    from ppo_jax.trainer.setup import pad_token_id, prompt_set, stop_token_ids

    cfg, batch, rows, extra = workload(name, args)
    path = ensure_tiny_random(ROOT / ".cache" / "tiny-random-llama") if args.tiny else ensure_smollm2()
    tok, (model, _) = load_tokenizer(path), load_model(path, "causal_lm", param_dtype="float32",
                                                        dtype="float32")
    graphdef, params = split_model(model)
    prompts = prompt_set(cfg, tok, model.cfg, cfg.data.prompts, "data.prompts")
    n, g = cfg.generation.samples_per_prompt, cfg.generation
    idx = np.repeat(np.arange(batch // n) % len(prompts), n)
    ids, mask = prompts.ids[idx], prompts.mask[idx]  # left-padded to the set's widest prompt
    width = ids.shape[1]
    kw = dict(max_new_tokens=g.max_new_tokens, temperature=g.temperature,
              stop_token_ids=stop_token_ids(cfg, tok, model.cfg),
              pad_token_id=pad_token_id(tok, model.cfg), samples_per_prompt=n)
    pool = 1 + rows * pages_for(width + g.max_new_tokens, args.page_size)
    engine = PagedEngine(graphdef, model.cfg, SamplingSettings(**kw),
                         EngineSettings(page_size=args.page_size, num_pages=pool,
                                        decode_chunk=args.chunk, **extra),
                         batch=batch, prompt_width=width)
    key = jax.random.PRNGKey(0)

    def static():
        outs = [generate(graphdef, params, ids[s:s + rows], mask[s:s + rows], key, first_row=s,
                         **kw) for s in range(0, batch, rows)]
        return tuple(np.concatenate([np.asarray(o[i]) for o in outs]) for i in (0, 1))

    def paged():
        out = engine.generate(params, jax.numpy.asarray(ids), jax.numpy.asarray(mask), key)
        return tuple(np.asarray(x) for x in out[:2])

    facts = dict(batch=batch, static_rows=rows, slots=engine.layout.slots, pool_pages=pool,
                 page_size=args.page_size, chunk=args.chunk, new_tokens=g.max_new_tokens,
                 prompt_width=width, samples_per_prompt=n)
    return {"static": static, "paged": paged}, engine, facts


def measure(name: str, args) -> dict:
    fns, engine, facts = build(name, args)
    out = {}
    for side, fn in fns.items():  # warm-up: compiles
        seconds = timed(lambda: out.__setitem__(side, fn()))
        log(f"{name} warm-up {side}: {seconds:.1f} s")
    for i in (0, 1):
        if not np.array_equal(out["static"][i], out["paged"][i]):
            raise AssertionError(f"{name}: the engine's tokens differ from the static sampler's")
    lengths = out["paged"][1].sum(axis=1)
    rows = facts["static_rows"]
    times = {side: [] for side in fns}
    for rnd in range(args.rounds):
        for side in (("static", "paged") if rnd % 2 == 0 else ("paged", "static")):
            times[side].append(timed(fns[side]))
            log(f"{name} round {rnd} {side}: {times[side][-1]:.1f} s")
    useful = int(lengths.sum())
    st = engine.last_stats
    return {**facts, "useful_tokens": useful,
            "lengths": {"mean": float(lengths.mean()), "p50": float(np.percentile(lengths, 50)),
                        "p90": float(np.percentile(lengths, 90)), "max": int(lengths.max())},
            "static_steps": int(sum(lengths[s:s + rows].max() for s in range(0, len(lengths), rows))),
            "engine": {"steps": st.steps, "chunks": st.chunks, "prefills": st.prefills,
                       "slot_occupancy": st.slot_occupancy, "preemptions": st.preemptions,
                       "peak_pages": st.peak_pages},
            "seconds": {side: stats(t) for side, t in times.items()},
            "tokens_per_s": {side: useful / stats(t)["median"] for side, t in times.items()},
            "ratio": stats(s / p for s, p in zip(times["static"], times["paged"]))}


def render(data: dict) -> str:
    rows = []
    for name, r in data["workloads"].items():
        ln = r["lengths"]
        rows.append([name, f"{r['batch']} / {r['static_rows']} / {r['slots']}",
                     f"{fmt(ln['mean'], 1)} / {fmt(ln['p50'], 0)} / {fmt(ln['p90'], 0)} / {ln['max']}"
                     f" of {r['new_tokens']} ({ln['mean'] / r['new_tokens']:.2f})",
                     fmt(r["tokens_per_s"]["static"], 1), fmt(r["tokens_per_s"]["paged"], 1),
                     ratio(r["ratio"]["median"], st=r["ratio"]),
                     f"{r['static_steps']} / {r['engine']['steps']}",
                     f"{r['engine']['slot_occupancy']:.2f}", r["engine"]["preemptions"]])
    head = ["workload", "responses / static rows / slots", "length mean / p50 / p90 / max (mean/max)",
            "static tok/s", "paged tok/s", "paged / static", "decode steps static / paged",
            "slot occupancy", "preemptions"]
    return ("Useful generated tokens per second (response tokens up to and including EOS), "
            "SmolLM2-135M-Instruct float32, equal KV memory, the same tokens on both sides; "
            f"{data['rounds']} rounds, medians.\n\n" + table(head, rows))


def main() -> None:
    args = options(__doc__, workload=["heavy", "default", "rlvr"], rounds=2, slots=64, rows=64,
                   responses=256, new_tokens=256, chunk=8, page_size=16, tiny=False, json=None)
    under_malloc_settings()
    data = {"rounds": args.rounds,
            "workloads": {name: measure(name, args) for name in args.workload}}
    finish(data, render, args.json)


if __name__ == "__main__":
    main()
