"""The sampler's decode step against its floor: the weight matmuls alone (every weight read once
per step, the model's own weights and rows, layers scanned and unrolled, the faster is the floor),
with transformers `generate` in the same alternating run; the best-case ratio is an estimate.

Usage: python bench/decode_floor.py [--batch 8] [--new-tokens 64] [--runs 5] [--model-dir DIR]
    [--json PATH]
"""

from __future__ import annotations

import statistics
from functools import partial

import jax
import jax.numpy as jnp
import torch

from generate import load_sides
from harness import (finish, fmt, interleaved, log, options, ratio, spread, stats, table,
                     under_malloc_settings)
from ppo_jax.models import flat_params
from ppo_jax.models.smollm2 import ensure_smollm2

MATMULS = ("attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj", "mlp/gate_proj",
           "mlp/up_proj", "mlp/down_proj")


def weight_matmul_steps(params, cfg, batch: int, steps: int, unrolled: bool):
    """(a jitted loop of `steps` decode steps of the weight matmuls alone, its input, the weight
    bytes a step reads). Layers as a `lax.scan` over the stacked weights (as the model; XLA:CPU
    copies each slice out) or, `unrolled`, a Python loop over per-layer arrays (no copies)."""
    flat = flat_params(params)
    kernels = {m: flat[f"backbone/layers/{m}/kernel"] for m in MATMULS}  # [L, in, out]
    head, spec = ((flat["backbone/embed_tokens/embedding"], "bd,vd->bv") if cfg.tie_word_embeddings
                  else (flat["unembed/kernel"], "bd,dv->bv"))  # [V, D] / [D, V]
    d = cfg.hidden_size

    def widen(y, n):  # [B, m] -> [B, n] by repeating columns (cheap; feeds the next matmul)
        return jnp.tile(y, (1, -(-n // y.shape[-1])))[:, :n]

    def layer(h, k):
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
        q, kk, v = h @ k["attn/q_proj"], h @ k["attn/k_proj"], h @ k["attn/v_proj"]
        mix = q + widen(kk, q.shape[-1]) + widen(v, q.shape[-1])  # stands in for attention
        h = h + 1e-2 * (mix @ k["attn/o_proj"])
        act = h @ k["mlp/gate_proj"] * (h @ k["mlp/up_proj"])
        return h + 1e-2 * (act @ k["mlp/down_proj"]), None

    def step(kernels, head, per_layer, h):
        if per_layer is None:
            h = jax.lax.scan(layer, h, kernels)[0]
        else:
            for k in per_layer:
                h = layer(h, k)[0]
        return h + 1e-6 * widen(jnp.einsum(spec, h, head), d)

    @jax.jit
    def run(h, kernels, head):  # weights are arguments, not constants baked into the program
        per_layer = None
        if unrolled:  # sliced once, outside the loop of steps
            per_layer = [{m: w[i] for m, w in kernels.items()} for i in range(cfg.num_layers)]
        return jax.lax.fori_loop(0, steps, lambda _, x: step(kernels, head, per_layer, x), h)

    nbytes = sum(int(k.nbytes) for k in kernels.values()) + int(head.nbytes)
    return partial(run, kernels=kernels, head=head), jnp.ones((batch, d), jnp.float32), nbytes


def floor_figures(times: dict[str, list[float]], new_tokens: int, weight_bytes: int,
                  weight_flops: float) -> dict:
    """The figures from seconds per call of `prefill`, `generate`, `transformers` and each layer
    form of the weight-matmul loop (`new_tokens - 1` steps); the floor is the fastest form."""
    med, n = statistics.median, new_tokens
    prefill, whole, hf = med(times["prefill"]), med(times["generate"]), med(times["transformers"])
    step = (whole - prefill) / (n - 1)
    forms = {}
    for form in (k for k in times if k not in ("prefill", "generate", "transformers")):
        t = med(times[form]) / (n - 1)
        forms[form] = {"step_s": t, "gb_per_s": weight_bytes / t / 1e9,
                       "gflops_per_s": weight_flops / t / 1e9, "fraction_of_decode_step": t / step}
    best = min(forms, key=lambda f: forms[f]["step_s"])
    floor = forms[best]["step_s"]
    return {"prefill_s": stats(times["prefill"]), "generate_s": stats(times["generate"]),
            "transformers_s": stats(times["transformers"]),
            "floor_loop_s": {f: stats(times[f]) for f in forms},
            "decode_step_s": step, "decode_gflops_per_s": weight_flops / step / 1e9,
            "forms": forms, "floor_form": best, "floor_step_s": floor,
            "ratio_now": hf / whole, "best_case_ratio": hf / (prefill + (n - 1) * floor),
            "step_for_2x_s": (hf / 2 - prefill) / (n - 1)}


def markdown(d: dict) -> str:
    n, ms = d["new_tokens"], lambda x: fmt(x * 1e3, 1)
    rows = [["ppo_jax `generate`, whole call", spread(d["generate_s"], 1, 1e3)] + ["—"] * 4,
            ["ppo_jax prefill (`generate` with 1 new token)", spread(d["prefill_s"], 1, 1e3)] + ["—"] * 4,
            ["ppo_jax decode step", "—", ms(d["decode_step_s"]), "—", fmt(d["decode_gflops_per_s"], 1),
             "100%"]]
    for form, f in d["forms"].items():
        rows.append([f"weight matmuls alone, layers {form}" + (" (floor)" if form == d["floor_form"] else ""),
                     spread(d["floor_loop_s"][form], 1, 1e3), ms(f["step_s"]), fmt(f["gb_per_s"], 1),
                     fmt(f["gflops_per_s"], 1), f"{f['fraction_of_decode_step']:.0%}"])
    rows.append(["transformers `generate`, whole call", spread(d["transformers_s"], 1, 1e3)] + ["—"] * 4)
    return "\n".join([
        f"Model `{d['model']}`, {d['dtype']}, batch {d['batch']}, prompt width {d['prompt_width']}, "
        f"{n} new tokens, greedy; ms per call: median (min–max) of {d['runs']} alternating runs "
        f"after a warm-up call. Weight matmuls: q/k/v/o/gate/up/down per layer and the LM head "
        f"({d['weight_bytes'] / 1e6:.0f} MB read per step, {d['weight_flops_per_step'] / 1e9:.2f} "
        f"GFLOP = 2 x rows x weights) in a jitted loop of {n - 1} steps, an RMS norm per layer "
        f"besides; our decode step = (generate - prefill) / {n - 1}; torch {d['torch_threads']} threads.", "",
        table(["what", "ms per call", "ms per decode step", "weights GB/s",
               "weight-matmul GFLOP/s", "of our decode step"], rows), "",
        f"Ratio transformers / ppo_jax (medians of whole calls): {ratio(d['ratio_now'])}; "
        f"estimate if everything but the weight matmuls were free (prefill + {n - 1} floor steps): "
        f"**{ratio(d['best_case_ratio'])}**; a ×2 sampler needs decode steps of "
        f"{ms(d['step_for_2x_s'])} ms."])


def main() -> None:
    args = options(__doc__, batch=8, new_tokens=64, runs=5, model_dir=None, json=None)
    if args.new_tokens < 2 or args.batch < 1:
        raise SystemExit(f"--new-tokens {args.new_tokens} must be >= 2 (the floor is per decode "
                         f"step after the first token) and --batch {args.batch} >= 1")
    n, runs = args.new_tokens, max(args.runs, 3)
    model_dir = args.model_dir or ensure_smollm2()
    sides = load_sides(model_dir, args.batch)
    rows = sides.ids.shape[0]
    fns = {"prefill": sides.ours(1), "generate": sides.ours(n), "transformers": sides.theirs(n)}
    nbytes = 0
    for form in ("scan", "unrolled"):
        run, h0, nbytes = weight_matmul_steps(sides.params, sides.cfg, rows, n - 1, form == "unrolled")
        fns[form] = partial(lambda run, h0: jax.block_until_ready(run(h0)), run, h0)
    itemsize = flat_params(sides.params)["backbone/embed_tokens/embedding"].dtype.itemsize
    weight_flops = 2.0 * rows * nbytes / itemsize  # 2 x rows x weights read, per step
    log(f"model {model_dir.name}, batch {rows}, {n} new tokens; {runs} alternating runs")
    for fn in fns.values():
        fn()  # warm-up: compile
    blocks = interleaved(fns, runs)
    times = {k: [t for b in v for t in b] for k, v in blocks.items()}
    finish({"bench": "decode_floor", "model": model_dir.name, "dtype": "float32", "batch": rows,
            "prompt_width": int(sides.ids.shape[1]), "new_tokens": n, "runs": runs, "weight_bytes": nbytes,
            "weight_flops_per_step": weight_flops, **floor_figures(times, n, nbytes, weight_flops),
            "versions": {"jax": jax.__version__, "torch": torch.__version__, "transformers": sides.transformers},
            "torch_threads": torch.get_num_threads()}, markdown, args.json)


if __name__ == "__main__":
    under_malloc_settings()  # as train.py runs (ppo_jax.trainer.host.memory)
    main()
