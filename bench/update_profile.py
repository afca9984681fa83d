"""The update's forward + backward (actor, one minibatch, no optimiser step), ppo_jax on XLA:CPU
under several XLA_FLAGS settings against PyTorch (transformers, eager) in interleaved rounds of
fresh processes; then one traced run per side sums op time by kind (matmul, copies, scan, other).

Usage: python bench/update_profile.py [--tiny] [--batch 8] [--prompt 46] [--response 48]
    [--rounds 3] [--calls 3] [--profile-calls 2] [--flags NAME=XLA_FLAGS ...] [--json PATH]
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

import ppo_step
from harness import (emit, finish, fmt, log, options, run_worker, spread, stats, table,
                     timed, under_malloc_settings)

FLAGS = (  # XLA:CPU settings (name, XLA_FLAGS), the first the baseline
    ("default", ""), ("xnnpack off", "--xla_cpu_use_xnnpack=false"),
    ("oneDNN on", "--xla_cpu_use_onednn=true"),
    ("concurrency scheduler", "--xla_cpu_enable_concurrency_optimized_scheduler=true"),
    ("vector width 512", "--xla_cpu_prefer_vector_width=512"),
    ("YNN dot fusion", "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT"),
)
KINDS = ("matmul", "layout copies", "layer-scan stacking", "other")
_TRACE_SKIP = ("ThunkExecutor", "$", "SlinkyThreadPool", "PjitFunction", "end: ", "CommonPjRt", "PjRt")
TORCH_MATMUL = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::matmul", "aten::linear")
TORCH_COPIES = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::fill_",
                "aten::zero_", "aten::zeros", "aten::empty_like", "aten::transpose", "aten::t")


def xla_op_kind(name: str) -> str | None:
    """The kind of an XLA:CPU trace event by its HLO name (None: not an op)."""
    if name.startswith(_TRACE_SKIP):
        return None
    n = re.sub(r"\.\d+$", "", name)
    if any(k in n for k in ("ynn_fusion", "xnn_fusion", "onednn")) or n.startswith(("dot", "convolution")):
        return "matmul"
    if "dynamic-update-slice" in n or "dynamic-slice" in n or n.startswith("wrapped_broadcast"):
        return "layer-scan stacking"
    return "layout copies" if n.startswith(("copy", "transpose")) else "other"


def torch_op_kind(name: str) -> str:
    return "matmul" if name in TORCH_MATMUL else "layout copies" if name in TORCH_COPIES else "other"


def op_profile(events, calls: int) -> dict:
    """From (name, kind, ms) events: per kind ms per call and share, the total, the 8 largest ops."""
    ms, top = collections.Counter(), collections.Counter()
    for name, kind, t in events:
        if kind is not None:
            ms[kind] += t
            top[name] += t
    total = sum(ms.values()) or 1.0
    return {"kinds": {k: {"ms_per_call": ms[k] / calls, "share": ms[k] / total} for k in KINDS},
            "total_ms_per_call": total / calls, "top_ops": [[n, t / calls] for n, t in top.most_common(8)]}


# --------------------------------------------------------------------------- workers
def jax_worker(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flops import count_flops

    from ppo_jax.models.functional import causal_lm_hidden, lm_head_logits, split_model
    from ppo_jax.models.heads import init_model
    from ppo_jax.models.hf_io import load_config

    cfg = load_config(args.model_dir)
    graphdef, params = split_model(init_model(cfg, "causal_lm", seed=0))
    b, p, r = args.batch, args.prompt, args.response
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (b, p + r)), jnp.int32)

    def loss(params):  # LM head on the response positions only
        hidden = causal_lm_hidden(graphdef, params, ids, jnp.ones_like(ids))[:, p - 1:-1]
        logprobs = jax.nn.log_softmax(lm_head_logits(graphdef, params, hidden), axis=-1)
        return -jnp.take_along_axis(logprobs, ids[:, p:, None], axis=-1).mean()

    step = jax.jit(jax.value_and_grad(loss))
    call = lambda: jax.block_until_ready(step(params))  # noqa: E731
    out = {"side": "jax", "first_call_s": timed(call),
           "flops": count_flops(step, params, with_xla=False)["flops"],
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__}
    if not args.trace:
        return {**out, "seconds": [timed(call) for _ in range(args.calls)]}
    return {**out, **traced(call, args.calls)}


def traced(call, calls: int) -> dict:
    """`op_profile` of `calls` calls of the jitted `call` under `jax.profiler.trace`."""
    import jax

    with tempfile.TemporaryDirectory(prefix="update_trace_") as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(calls):
                call()
        files = sorted(Path(tmp).rglob("perfetto_trace.json.gz"))
        if not files:
            raise SystemExit("jax.profiler.trace wrote no perfetto_trace.json.gz")
        trace = json.loads(gzip.open(files[-1]).read())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return op_profile(((re.sub(r"\.\d+$", "", e.get("name", "")), xla_op_kind(e.get("name", "")),
                        e.get("dur", 0) / 1e3) for e in events if e.get("ph") == "X"), calls)


def torch_worker(args) -> dict:
    import torch
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(args.model_dir)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    b, p, r = args.batch, args.prompt, args.response
    ids = torch.randint(0, config.vocab_size, (b, p + r), generator=torch.Generator().manual_seed(0))

    def step():  # logits at every position, as TRL 0.11
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits[:, p - 1:-1].float()
        (-torch.log_softmax(logits, dim=-1).gather(-1, ids[:, p:, None]).mean()).backward()

    first = timed(step)
    with FlopCounterMode(display=False) as counter:
        step()
    out = {"side": "torch", "first_call_s": first, "flops": int(counter.get_total_flops()),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "torch_threads": torch.get_num_threads()}
    if not args.trace:
        return {**out, "seconds": [timed(step) for _ in range(args.calls)]}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.calls):
            step()
    return {**out, **op_profile(((e.key, torch_op_kind(e.key), e.self_cpu_time_total / 1e3)
                                 for e in prof.key_averages()), args.calls)}


def worker(side: str, args, xla_flags: str = "", calls: int | None = None) -> dict:
    """One fresh worker process of this script (traced with `calls`); SystemExit when it fails."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, f"--model-dir={args.model_dir}",
           *(f"--{k}={getattr(args, k)}" for k in ("batch", "prompt", "response")),
           f"--calls={calls or args.calls}", *["--trace"] * bool(calls)]
    r = run_worker(cmd, {**os.environ, "XLA_FLAGS": xla_flags},
                   f"{side} (XLA_FLAGS={xla_flags!r}){' traced' if calls else ''}")
    if r is None:
        raise SystemExit(f"{side} worker (XLA_FLAGS={xla_flags!r}) failed (see above)")
    return r


def flags_ab(args, settings) -> dict:
    """Interleaved rounds over the settings and torch: per setting the stats of its round medians
    and of its ratio to the baseline's in the same round, its GFLOP/s."""
    sides = list(settings) + [("torch", None)]
    per_round, first, flops = {n: [] for n, _ in sides}, {n: [] for n, _ in sides}, {}
    for rnd in range(args.rounds):
        for name, flags in sides:
            r = worker("torch" if flags is None else "jax", args, flags or "")
            per_round[name].append(statistics.median(r["seconds"]))
            first[name].append(r["first_call_s"])
            flops[r["side"]] = r["flops"]
            log(f"round {rnd + 1}/{args.rounds} {name:22s} median {per_round[name][-1]:.3f} s "
                f"(first call {r['first_call_s']:.1f} s)")
    base = per_round[settings[0][0]]
    rows = [{"name": name, "xla_flags": flags, "side": side,
             "seconds": stats(per_round[name]), "first_call_s": stats(first[name]),
             "ratio_to_default": stats(x / y for x, y in zip(per_round[name], base)),
             "gflops_per_s": flops[side] / statistics.median(per_round[name]) / 1e9}
            for name, flags in sides for side in ["torch" if flags is None else "jax"]]
    return {"rows": rows, "flops": flops}


def markdown(d: dict) -> str:
    ab, prof = d["flags_ab"], d["profiles"]
    gflop = lambda x: f"{x / 1e9:.3g}"  # noqa: E731
    rows = [[r["name"], "PyTorch peer (transformers, eager)" if r["side"] == "torch" else
             f"`{r['xla_flags']}`" if r["xla_flags"] else "XLA:CPU defaults",
             spread(r["seconds"]), spread(r["ratio_to_default"]), fmt(r["gflops_per_s"], 1),
             fmt(r["first_call_s"]["median"], 1)] for r in ab["rows"]]
    kinds = [[k] + [f"{fmt(prof[s]['kinds'][k]['ms_per_call'], 1)} ms "
                    f"({100 * prof[s]['kinds'][k]['share']:.0f}%)" for s in ("jax", "torch")] for k in KINDS]
    kinds.append(["all ops"] + [f"{fmt(prof[s]['total_ms_per_call'], 1)} ms" for s in ("jax", "torch")])
    return "\n".join([
        ("DRY RUN on the tiny random model: not a figure to quote. " if d["tiny"] else "")
        + f"The actor's forward + backward of one update minibatch, `{d['model']}`, {d['batch']} "
        f"rows x ({d['prompt']} prompt + {d['response']} response) tokens, float32. {d['rounds']} "
        f"interleaved rounds of fresh processes, median of {d['calls']} calls each; ratio = the "
        "setting's median / the default's in the same round, median (min–max) (< 1 is faster).", "",
        table(["setting", "flags", "seconds per call", "ratio to default", "GFLOP/s", "first call s"], rows),
        "", f"FLOPs per call, counted: jax {gflop(ab['flops']['jax'])} GFLOP (LM head on the response "
        f"positions), torch {gflop(ab['flops']['torch'])} GFLOP (LM head everywhere, as TRL).", "",
        f"Op time per call by kind ({d['profile_calls']} traced calls; jax: `jax.profiler.trace`, "
        "XLA:CPU's ops may overlap on its threads; torch: `torch.profiler` self CPU time):", "",
        table(["kind", "ppo_jax (XLA:CPU)", "PyTorch"], kinds),
        *(f"\nLargest {s} ops per call: " + ", ".join(f"`{n}` {fmt(t, 1)} ms" for n, t in top[:6]) + "."
          for s, top in ((s, prof[s]["top_ops"]) for s in ("jax", "torch")))])


def main() -> None:
    args = options(__doc__, tiny=False, model_dir=None, batch=8, prompt=46, response=48, rounds=3,
                   calls=3, profile_calls=2, flags=[f"{n}={f}" for n, f in FLAGS], json=None,
                   worker="", trace=False)
    if args.worker:
        return emit((jax_worker if args.worker == "jax" else torch_worker)(args))
    if any("=" not in f for f in args.flags):
        raise SystemExit(f"--flags takes NAME=XLA_FLAGS items, got {args.flags}")
    settings = [tuple(f.split("=", 1)) for f in args.flags]
    with tempfile.TemporaryDirectory(prefix="update_profile_") as tmp:
        args.model_dir = ppo_step.resolve_model_dir(args.model_dir, args.tiny and tmp)
        ab = flags_ab(args, settings)
        profiles = {s: worker(s, args, settings[0][1] if s == "jax" else "", args.profile_calls)
                    for s in ("jax", "torch")}
    finish({"bench": "update_profile", "model": "tiny-random-llama" if args.tiny else args.model_dir.name,
            **{k: getattr(args, k) for k in ("tiny", "batch", "prompt", "response", "rounds", "calls",
                                             "profile_calls")}, "flags_ab": ab, "profiles": profiles},
           markdown, args.json)


if __name__ == "__main__":
    under_malloc_settings()  # as train.py runs (ppo_jax.trainer.host.memory)
    main()
