"""Where the PPO update's time goes on this CPU: ppo_jax's jitted forward + backward against
PyTorch's, op by op, and which XLA:CPU flags change it (issue 13: profile both updates, A/B the
flags in one run, report what did not help).

The work measured on both sides is the model part of one PPO update minibatch: the actor's
forward + backward over `--batch` rows of `--prompt` prompt + `--response` response tokens (the
shape bench/ppo_step.py's update runs: 8 x (46 + 48) for SmolLM2-135M-Instruct), loss = minus the
mean log-prob of the response tokens, gradients of every parameter. No optimiser step.

- jax: `jax.jit(jax.value_and_grad(loss))` over ppo_jax's CausalLM (random weights of the
  model's config), the LM head applied to the response positions only (as ppo_jax's update does).
- torch: transformers' `LlamaForCausalLM` of the same config (random weights, eager attention,
  `torch.set_num_threads(cores)`), logits at every position then sliced (as TRL 0.11 does).
- FLOPs: counted on each side, never assumed: jax from the jaxpr (bench/flops.py), torch with
  `torch.utils.flop_counter.FlopCounterMode`.

What is measured, in this order, in one run:

1. flags A/B: each XLA_FLAGS setting of `--flags` (and torch, the peer) runs in its own fresh
   subprocess (XLA reads its flags once per process), `--calls` timed calls after one warm-up
   call; the settings alternate (A B C ... A B C ...) for `--rounds` rounds, so drift of the
   machine's speed hits them alike. Per round: each setting's median over the default's; the
   table gives the median and range of that ratio over rounds.
2. profile: one more subprocess per side traces `--profile-calls` calls (`jax.profiler.trace`
   with its Perfetto file; `torch.profiler`) and sums op time by kind: matmul (XLA's YNN / XNN /
   oneDNN fusions and dots; aten mm / bmm / addmm), layout copies (XLA copy / transpose fusions;
   aten copy_ / clone / cat / fill_), layer-scan stacking (XLA dynamic(-update)-slice fusions and
   the zero-filled buffers of the scan's stacked gradients: ppo_jax scans its layers), other
   (elementwise, reductions, softmax). XLA:CPU runs independent ops on its 2+ threads at once,
   so its op times can add up to more than the wall time; shares of the op time are comparable.

Prints the CPU model and instruction sets first; `--json PATH` writes everything (bench/report.py
turns it into results.md's "Update profile" section).

Usage: python bench/update_profile.py [--tiny | --model-dir DIR] [--batch 8] [--prompt 46]
           [--response 48] [--rounds 3] [--calls 3] [--profile-calls 2] [--no-torch]
           [--flags NAME=XLA_FLAGS ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, uninstalled
sys.path.insert(0, str(ROOT / "bench"))
import ppo_step  # noqa: E402  (model directory and command line as the other benchmarks)
from common import cpu_info, cpu_line, run_record, under_malloc_settings, stats, write_json  # noqa: E402

# XLA:CPU settings compared against the default (name, XLA_FLAGS); names the issue asked about
FLAGS = (
    ("default", ""),
    ("xnnpack off", "--xla_cpu_use_xnnpack=false"),
    ("oneDNN on", "--xla_cpu_use_onednn=true"),
    ("concurrency scheduler", "--xla_cpu_enable_concurrency_optimized_scheduler=true"),
    ("vector width 512", "--xla_cpu_prefer_vector_width=512"),
    ("YNN dot fusion", "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT"),
)
KINDS = ("matmul", "layout copies", "layer-scan stacking", "other")
_TRACE_SKIP = ("ThunkExecutor", "$", "SlinkyThreadPool", "PjitFunction", "end: ", "CommonPjRt", "PjRt")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def xla_op_kind(name: str) -> str | None:
    """The kind of one XLA:CPU trace event by its HLO name (None: not an op, e.g. the executor's
    own spans). `ynn_fusion.27` -> matmul, `copy_bitcast_fusion.4` -> layout copies,
    `bitcast_dynamic-update-slice_fusion` / `wrapped_broadcast` -> layer-scan stacking."""
    if name.startswith(_TRACE_SKIP):
        return None
    n = re.sub(r"\.\d+$", "", name)
    if any(k in n for k in ("ynn_fusion", "xnn_fusion", "onednn")) or n.startswith(("dot", "convolution")):
        return "matmul"
    if "dynamic-update-slice" in n or "dynamic-slice" in n or n.startswith("wrapped_broadcast"):
        return "layer-scan stacking"
    if n.startswith(("copy", "transpose")):
        return "layout copies"
    return "other"


def torch_op_kind(name: str) -> str:
    """The kind of one torch profiler op by its aten name (self time is counted)."""
    if name in ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::matmul", "aten::linear"):
        return "matmul"
    if name in ("aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::fill_",
                "aten::zero_", "aten::zeros", "aten::empty_like", "aten::transpose", "aten::t"):
        return "layout copies"
    return "other"


def kinds_table(ms: dict[str, float], calls: int) -> dict:
    """`{kind: {"ms_per_call", "share"}}` plus `"total_ms_per_call"` from op time sums in ms."""
    total = sum(ms.values()) or 1.0
    out = {k: {"ms_per_call": ms.get(k, 0.0) / calls, "share": ms.get(k, 0.0) / total} for k in KINDS}
    return {"kinds": out, "total_ms_per_call": total / calls}


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
    mask = jnp.ones((b, p + r), jnp.int32)

    def loss(params):
        hidden = causal_lm_hidden(graphdef, params, ids, mask)[:, p - 1:-1]
        logprobs = jax.nn.log_softmax(lm_head_logits(graphdef, params, hidden), axis=-1)
        return -jnp.take_along_axis(logprobs, ids[:, p:, None], axis=-1).mean()

    step = jax.jit(jax.value_and_grad(loss))
    t0 = time.perf_counter()
    jax.block_until_ready(step(params))
    first = time.perf_counter() - t0
    out = {"side": "jax", "first_call_s": first, "flops": count_flops(step, params, with_xla=False)["flops"],
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__}
    if args.trace:
        with tempfile.TemporaryDirectory(prefix="update_trace_") as tmp:
            with jax.profiler.trace(tmp, create_perfetto_trace=True):
                for _ in range(args.calls):
                    jax.block_until_ready(step(params))
            files = sorted(Path(tmp).rglob("perfetto_trace.json.gz"))
            if not files:
                raise SystemExit("jax.profiler.trace wrote no perfetto_trace.json.gz")
            trace = json.loads(gzip.open(files[-1]).read())
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        ms, top = collections.Counter(), collections.Counter()
        for e in events:
            kind = xla_op_kind(e.get("name", "")) if e.get("ph") == "X" else None
            if kind is not None:
                ms[kind] += e.get("dur", 0) / 1e3
                top[re.sub(r"\.\d+$", "", e["name"])] += e.get("dur", 0) / 1e3
        out.update(kinds_table(ms, args.calls))
        out["top_ops"] = [[n, t / args.calls] for n, t in top.most_common(8)]
        return out
    out["seconds"] = [_timed(lambda: jax.block_until_ready(step(params))) for _ in range(args.calls)]
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


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

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits[:, p - 1:-1].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, p:, None])
        (-logprobs.mean()).backward()

    first = _timed(step)
    with FlopCounterMode(display=False) as counter:
        step()
    out = {"side": "torch", "first_call_s": first, "flops": int(counter.get_total_flops()),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "torch_threads": torch.get_num_threads()}
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.calls):
                step()
        ms, top = collections.Counter(), collections.Counter()
        for e in prof.key_averages():
            ms[torch_op_kind(e.key)] += e.self_cpu_time_total / 1e3
            top[e.key] += e.self_cpu_time_total / 1e3
        out.update(kinds_table(ms, args.calls))
        out["top_ops"] = [[n, t / args.calls] for n, t in top.most_common(8)]
        return out
    out["seconds"] = [_timed(step) for _ in range(args.calls)]
    return out


def run_worker(side: str, args, xla_flags: str = "", trace: bool = False, calls: int | None = None) -> dict:
    """One fresh subprocess of this script as a worker; returns its JSON result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--model-dir",
           str(args.model_dir), "--batch", str(args.batch), "--prompt", str(args.prompt),
           "--response", str(args.response), "--calls", str(calls or args.calls)]
    if trace:
        cmd.append("--trace")
    env = {**os.environ, "XLA_FLAGS": xla_flags}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{side} worker (XLA_FLAGS={xla_flags!r}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the run
def flags_ab(args, settings, with_torch: bool) -> dict:
    """Interleaved rounds over the settings (and torch); per-setting medians and ratios."""
    sides = [(name, flags) for name, flags in settings] + ([("torch", None)] if with_torch else [])
    per_round: dict[str, list[float]] = {name: [] for name, _ in sides}
    first: dict[str, list[float]] = {name: [] for name, _ in sides}
    flops = {}
    for rnd in range(args.rounds):
        for name, flags in sides:
            r = run_worker("torch" if flags is None else "jax", args, flags or "")
            per_round[name].append(statistics.median(r["seconds"]))
            first[name].append(r["first_call_s"])
            flops["torch" if flags is None else "jax"] = r["flops"]
            log(f"round {rnd + 1}/{args.rounds} {name:22s} median {per_round[name][-1]:.3f} s "
                f"(first call {r['first_call_s']:.1f} s)")
    base = per_round[settings[0][0]]
    rows = []
    for name, flags in sides:
        ratios = [x / y for x, y in zip(per_round[name], base)]
        side = "torch" if flags is None else "jax"
        med = statistics.median(per_round[name])
        rows.append({"name": name, "xla_flags": flags, "side": side, "seconds": stats(per_round[name]),
                     "first_call_s": stats(first[name]), "ratio_to_default": stats(ratios),
                     "gflops_per_s": flops[side] / med / 1e9})
    return {"rows": rows, "flops": flops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model-dir", default=None, help="HF directory (default: ensure_smollm2())")
    which.add_argument("--tiny", action="store_true", help="the tiny random Llama (a dry run)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=46, help="prompt tokens per row")
    parser.add_argument("--response", type=int, default=48, help="response tokens per row")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3, help="timed calls per worker")
    parser.add_argument("--profile-calls", type=int, default=2)
    parser.add_argument("--flags", nargs="*", default=None, metavar="NAME=XLA_FLAGS",
                        help="settings to compare (the first is the baseline); default: " +
                        "; ".join(n for n, _ in FLAGS))
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        out = (jax_worker if args.worker == "jax" else torch_worker)(args)
        print(json.dumps(out))
        return
    for name in ("batch", "prompt", "response", "rounds", "calls", "profile_calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    settings = FLAGS
    if args.flags is not None:
        bad = [f for f in args.flags if "=" not in f]
        if bad or not args.flags:
            parser.error(f"--flags takes NAME=XLA_FLAGS items, got {args.flags}")
        settings = tuple(tuple(f.split("=", 1)) for f in args.flags)
    cpu = cpu_info()
    log(f"CPU: {cpu_line(cpu)}")
    with tempfile.TemporaryDirectory(prefix="update_profile_") as tmp:
        if args.tiny:
            from ppo_jax.models.tiny_random import ensure_tiny_random

            args.model_dir = ensure_tiny_random(Path(tmp) / "tiny-random-llama")
        else:
            args.model_dir = ppo_step.resolve_model_dir(args.model_dir)
        ab = flags_ab(args, settings, with_torch=not args.no_torch)
        profiles = {"jax": run_worker("jax", args, settings[0][1], trace=True, calls=args.profile_calls)}
        if not args.no_torch:
            profiles["torch"] = run_worker("torch", args, trace=True, calls=args.profile_calls)
        model = "tiny-random-llama" if args.tiny else Path(args.model_dir).name
    data = {
        "bench": "update_profile", "tiny": args.tiny,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu, "model": model, "batch": args.batch, "prompt": args.prompt,
        "response": args.response, "rounds": args.rounds, "calls": args.calls,
        "profile_calls": args.profile_calls, "flags_ab": ab, "profiles": profiles,
        "command": ppo_step.command_line(),
        "load_average": os.getloadavg()[0], **run_record(),
    }
    from sections import update_profile_markdown

    print(update_profile_markdown(data))
    if args.json:
        write_json(args.json, data)
        log(f"wrote {args.json}")


if __name__ == "__main__":
    under_malloc_settings()  # as train.py runs (ppo_jax.trainer.host_memory)
    main()
