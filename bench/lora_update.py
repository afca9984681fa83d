"""LoRA against the full fine-tune: the actor's forward + backward of one update micro-batch,
gradients for the trained params only (all params / the rank-r adapters), in interleaved rounds
of fresh processes; then one traced run per variant splits the op time into matmuls and the rest.

Two widths: SmolLM2-135M-Instruct (the default run's model, hidden 576) and Llama-3.2-1B's
shapes (hidden 2048, `configs/model_shapes`, random weights, `--wide-layers` of its 16 layers),
so the ratio's dependence on width is measured, not guessed. Matmul FLOPs are counted from the
jaxpr (`bench/flops.py`).

Usage: python bench/lora_update.py [--tiny] [--rank 16] [--batch 8] [--prompt 46]
    [--response 48] [--wide-layers 4] [--rounds 3] [--calls 3] [--profile-calls 2] [--json PATH]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import ppo_step
import update_profile
from harness import (ROOT, emit, finish, fmt, log, options, run_worker, spread, stats, table, timed,
                     under_malloc_settings)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WIDE = ROOT / "configs/model_shapes/llama-3.2-1b-instruct"


def jax_worker(args) -> dict:
    """Time (and with --trace, profile) value_and_grad of the response log-prob loss."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from flops import count_flops

    from ppo_jax.models.functional import causal_lm_hidden, lm_head_logits, split_model
    from ppo_jax.models.heads import init_model
    from ppo_jax.models.hf_io import load_config
    from ppo_jax.models.lora import join, split_params
    from ppo_jax.trainer.loading.lora import is_trained

    kw = dict(lora_rank=args.rank, lora_alpha=2.0 * args.rank, lora_targets=TARGETS) if args.lora else {}
    if args.layers:
        kw["num_layers"] = args.layers
    cfg = load_config(args.model_dir, **kw)
    graphdef, params = split_model(init_model(cfg, "causal_lm", seed=0))
    params = nnx.to_pure_dict(params)
    trained, frozen = split_params(params, is_trained) if args.lora else (params, {})
    b, p, r = args.batch, args.prompt, args.response
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (b, p + r)), jnp.int32)

    def loss(trained, frozen):  # LM head on the response positions only, as the update does
        both = join(frozen, trained)
        hidden = causal_lm_hidden(graphdef, both, ids, jnp.ones_like(ids))[:, p - 1:-1]
        logprobs = jax.nn.log_softmax(lm_head_logits(graphdef, both, hidden), axis=-1)
        return -jnp.take_along_axis(logprobs, ids[:, p:, None], axis=-1).mean()

    step, forward = jax.jit(jax.value_and_grad(loss)), jax.jit(loss)
    call = lambda: jax.block_until_ready(step(trained, frozen))  # noqa: E731
    out = {"variant": "lora" if args.lora else "full", "first_call_s": timed(call),
           "flops": count_flops(step, trained, frozen, with_xla=False)["flops"],
           "trained_params": sum(int(x.size) for x in jax.tree.leaves(trained))}
    if args.trace:
        return {**out, **update_profile.traced(call, args.calls)}
    jax.block_until_ready(forward(trained, frozen))
    return {**out, "seconds": [timed(call) for _ in range(args.calls)],
            "forward_s": [timed(lambda: jax.block_until_ready(forward(trained, frozen)))
                          for _ in range(args.calls)]}


def worker(args, model_dir: Path, layers: int, lora: bool, trace: bool = False) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", f"--model-dir={model_dir}",
           f"--layers={layers}", *["--lora"] * lora, *["--trace"] * trace,
           *(f"--{k}={getattr(args, k)}" for k in ("rank", "batch", "prompt", "response")),
           f"--calls={args.profile_calls if trace else args.calls}"]
    name = f"{model_dir.name} {'lora' if lora else 'full'}{' traced' if trace else ''}"
    r = run_worker(cmd, None, name)
    if r is None:
        raise SystemExit(f"worker {name} failed (see above)")
    return r


def measure(args, model_dir: Path, layers: int) -> dict:
    """Interleaved rounds (the order flipped every round), then one traced run of each."""
    med = {"full": [], "lora": []}
    fwd, res = {"full": [], "lora": []}, {}
    for rnd in range(args.rounds):
        for lora in ((False, True) if rnd % 2 == 0 else (True, False)):
            r = worker(args, model_dir, layers, lora)
            name = r["variant"]
            med[name].append(statistics.median(r["seconds"]))
            fwd[name].append(statistics.median(r["forward_s"]))
            res[name] = r
            log(f"round {rnd + 1}/{args.rounds} {model_dir.name} {name}: {med[name][-1]:.3f} s")
    prof = {v: worker(args, model_dir, layers, v == "lora", trace=True) for v in ("full", "lora")}
    return {"model": model_dir.name, "layers": layers or None,
            **{v: {"seconds": stats(med[v]), "forward_s": stats(fwd[v]), "flops": res[v]["flops"],
                   "trained_params": res[v]["trained_params"], "profile": prof[v]} for v in med},
            "ratio": stats(lo / fu for lo, fu in zip(med["lora"], med["full"]))}


def markdown(d: dict) -> str:
    rows, kinds = [], []
    for m in d["models"]:
        name = m["model"] + (f" ({m['layers']} layers)" if m["layers"] else "")
        for v in ("full", "lora"):
            prof = m[v]["profile"]["kinds"]
            rows.append([name, v, f"{m[v]['trained_params'] / 1e6:.2f}M", spread(m[v]["seconds"]),
                         spread(m[v]["forward_s"]), f"{m[v]['flops'] / 1e9:.1f}",
                         fmt(prof["matmul"]["ms_per_call"], 0),
                         fmt(sum(k["ms_per_call"] for n, k in prof.items() if n != "matmul"), 0)])
        flops = m["lora"]["flops"] / m["full"]["flops"]
        kinds.append([name, spread(m["ratio"]), f"{flops:.2f}", fmt(
            m["lora"]["profile"]["kinds"]["matmul"]["ms_per_call"]
            / m["full"]["profile"]["kinds"]["matmul"]["ms_per_call"])])
    return "\n".join([
        ("DRY RUN on the tiny random model: not a figure to quote. " if d["tiny"] else "")
        + f"The actor's loss forward + backward, gradients of the trained params only, one "
        f"micro-batch of {d['batch']} rows x ({d['prompt']} prompt + {d['response']} response) "
        f"tokens, float32, LoRA rank {d['rank']} on all seven projections; {d['rounds']} "
        f"interleaved rounds of fresh processes, median of {d['calls']} calls each; op times from "
        f"{d['profile_calls']} traced calls (`jax.profiler.trace`).", "",
        table(["model", "variant", "trained params", "fwd + bwd s", "forward s", "matmul GFLOP",
               "matmul ms", "other ops ms"], rows), "",
        table(["model", "LoRA / full time, per round", "LoRA / full matmul FLOPs",
               "LoRA / full matmul time"], kinds)])


def main() -> None:
    args = options(__doc__, tiny=False, rank=16, batch=8, prompt=46, response=48, wide_layers=4,
                   rounds=3, calls=3, profile_calls=2, json=None, worker=False, trace=False,
                   lora=False, model_dir=None, layers=0)
    if args.worker:
        return emit(jax_worker(args))
    with tempfile.TemporaryDirectory(prefix="lora_update_") as tmp:
        small = ppo_step.resolve_model_dir(None, args.tiny and tmp)
        models = [measure(args, small, 0)]
        if not args.tiny:
            models.append(measure(args, WIDE, args.wide_layers))
    finish({"bench": "lora_update", **{k: getattr(args, k) for k in (
        "tiny", "rank", "batch", "prompt", "response", "rounds", "calls", "profile_calls")},
            "models": models}, markdown, args.json)


if __name__ == "__main__":
    under_malloc_settings()
    main()
