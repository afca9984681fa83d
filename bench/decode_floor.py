"""How fast can a decode step be on this machine? The weight-matmul floor of the sampler.

`bench/generate.py` compares whole `generate` calls. This script splits ours into prefill and
per-token decode, and times the part of a decode step that no sampler can skip: the matmuls
that read every weight once (q, k, v, o, gate, up, down in each layer, then the LM head), with
the model's own weights, batch rows and dtype, in a jitted loop of steps, and nothing else
but an RMS normalisation per layer that keeps the numbers finite (no attention, RoPE, cache
or sampling). Layers run both as a scan over the stacked weights (as the model does) and as an
unrolled loop over per-layer arrays; the faster form is the floor.
In the same run it times transformers' `generate` (PyTorch CPU) and prints the ratio the
sampler would reach if everything but those matmuls were free:

    best-case ratio = transformers' time / (our prefill + (new_tokens - 1) * floor step)

Our prefill is timed as a `generate` call with one new token (the prefill pass, its LM head
and one sample: N tokens take the prefill and N - 1 one-token passes). Greedy, float32, no stop tokens, on the converted SmolLM2 by default.

Usage: ``python bench/decode_floor.py [--batch 8] [--new-tokens 64] [--runs 5]
[--torch-threads 2] [--model-dir DIR] [--json PATH]``. `--json` writes the figures (medians with min-max over the
runs, the git commit they came from): the `decode_floor.json` that `bench/report.py` turns into
results.md's "Decode floor" section.
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
import jax.numpy as jnp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_info, cpu_line, machine_load, run_record, under_malloc_settings, stats, write_json  # noqa: E402
from generate import chat_batch  # noqa: E402
from ppo_jax.models import flat_params, load_model, load_tokenizer, split_model  # noqa: E402
from ppo_jax.models.smollm2 import ensure_smollm2  # noqa: E402
from ppo_jax.rollout.sampler import generate  # noqa: E402

MATMULS = ("attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj", "mlp/gate_proj",
           "mlp/up_proj", "mlp/down_proj")


def weight_matmul_steps(params, cfg, batch: int, steps: int, unrolled: bool):
    """A jitted function running `steps` decode steps of weight matmuls only; returns it, its
    input and the bytes of weights one step reads. Layers run as a `lax.scan` over the stacked
    weights (as the model does; XLA:CPU copies each layer's slice out first), or, with
    unrolled=True, as a Python loop over per-layer arrays (no copies)."""
    flat = flat_params(params)
    kernels = {m: flat[f"backbone/layers/{m}/kernel"] for m in MATMULS}  # [L, in, out]
    if cfg.tie_word_embeddings:
        head = flat["backbone/embed_tokens/embedding"]  # [V, D]
        spec = "bd,vd->bv"
    else:
        head = flat["unembed/kernel"]  # [D, V]
        spec = "bd,dv->bv"
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


def timed(fn) -> float:
    """Wall seconds of one call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def floor_figures(times: dict[str, list[float]], new_tokens: int, weight_bytes: int,
                  weight_flops: float) -> dict:
    """The derived figures of one run from its seconds per call (`prefill`, `generate`,
    `transformers`, and one key per layer form of the weight-matmul loop, which ran
    `new_tokens - 1` steps): medians, per-step times, the floor (fastest form), the ratio now and
    the best-case ratio transformers / (prefill + (new_tokens - 1) * floor)."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, default=0, help="0 = torch's default")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="HF dir (default: ensure_smollm2())")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.new_tokens < 2 or args.batch < 1:
        parser.error(f"--new-tokens {args.new_tokens} must be >= 2 (the floor is per decode step "
                     f"after the first token) and --batch {args.batch} >= 1")
    print(f"CPU: {cpu_line(cpu_info())}", flush=True)
    n, runs = args.new_tokens, max(args.runs, 3)

    model_dir = args.model_dir or ensure_smollm2()
    tok = load_tokenizer(model_dir)
    ids, mask = chat_batch(tok, args.batch)
    model, cfg = load_model(model_dir)
    graphdef, params = split_model(model)
    key = jax.random.PRNGKey(0)

    def ours(new_tokens):
        return lambda: jax.block_until_ready(generate(
            graphdef, params, ids, mask, key, max_new_tokens=new_tokens, greedy=True,
            stop_token_ids=(), pad_token_id=int(tok.pad_token_id)))

    floors = {form: weight_matmul_steps(params, cfg, ids.shape[0], n - 1, form == "unrolled")
              for form in ("scan", "unrolled")}

    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    t_ids, t_mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def theirs():
        with torch.inference_mode():
            hf.generate(t_ids, attention_mask=t_mask, max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id,
                        temperature=None, top_p=None, top_k=None)

    # alternate the measurements so drifting load from other processes hits all alike
    fns = {"prefill": ours(1), "generate": ours(n), "transformers": theirs}
    nbytes = floors["scan"][2]
    itemsize = flat_params(params)["backbone/embed_tokens/embedding"].dtype.itemsize
    weight_flops = 2.0 * ids.shape[0] * nbytes / itemsize  # 2 x rows x weights read, per step
    for form, (fn, h0, _) in floors.items():
        fns[form] = partial(lambda fn, h0: jax.block_until_ready(fn(h0)), fn, h0)
    for fn in fns.values():
        fn()  # warm-up: compile
    times = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():
            times[k].append(timed(fn))

    fig = floor_figures(times, n, nbytes, weight_flops)
    step, whole = fig["decode_step_s"], fig["generate_s"]["median"]
    print(f"model {model_dir.name}, float32, batch {ids.shape[0]}, prompt width {ids.shape[1]}, "
          f"{n} new tokens, greedy; jax {jax.__version__} ({jax.default_backend()}), torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads), CPUs {os.cpu_count()}; "
          f"medians of {runs} alternating runs")
    print(f"ppo_jax generate: {whole * 1e3:.0f} ms = prefill {fig['prefill_s']['median'] * 1e3:.0f}"
          f" ms + {n - 1} decode steps of {step * 1e3:.1f} ms ({weight_flops / 1e9:.2f} GFLOP of "
          f"weight matmuls each -> {fig['decode_gflops_per_s']:.1f} GFLOP/s)")
    for f, d in fig["forms"].items():
        print(f"weight matmuls alone, layers {f}: {d['step_s'] * 1e3:.1f} ms per step "
              f"({nbytes / 1e6:.0f} MB of weights -> {d['gb_per_s']:.1f} GB/s, "
              f"{d['gflops_per_s']:.1f} GFLOP/s); {d['fraction_of_decode_step']:.0%} of our "
              "decode step")
    print(f"transformers generate: {fig['transformers_s']['median'] * 1e3:.0f} ms; ratio now "
          f"{fig['ratio_now']:.2f}x")
    print(f"best-case ratio (everything but the weight matmuls free, layers {fig['floor_form']}): "
          f"{fig['best_case_ratio']:.2f}x; a 2x sampler needs decode steps of "
          f"{fig['step_for_2x_s'] * 1e3:.1f} ms")

    if args.json:
        write_json(args.json, {
            "bench": "decode_floor", "model": model_dir.name, "dtype": "float32",
            "batch": int(ids.shape[0]), "prompt_width": int(ids.shape[1]), "new_tokens": n,
            "runs": runs, "weight_bytes": nbytes, "weight_flops_per_step": weight_flops, **fig,
            "versions": {"jax": jax.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "torch_threads": torch.get_num_threads(), **machine_load(), **run_record(),
            "command": ".venv/bin/python bench/decode_floor.py " + shlex.join(sys.argv[1:]),
        })


if __name__ == "__main__":
    under_malloc_settings()  # as train.py runs (ppo_jax.trainer.host_memory)
    main()
