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
[--torch-threads 2]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(Path(__file__).resolve().parent))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, default=0, help="0 = torch's default")
    args = parser.parse_args()
    if args.new_tokens < 2 or args.batch < 1:
        parser.error(f"--new-tokens {args.new_tokens} must be >= 2 (the floor is per decode step "
                     f"after the first token) and --batch {args.batch} >= 1")
    n, runs, med = args.new_tokens, max(args.runs, 3), statistics.median

    model_dir = ensure_smollm2()
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
    for form, (fn, h0, _) in floors.items():
        fns[form] = partial(lambda fn, h0: jax.block_until_ready(fn(h0)), fn, h0)
    for fn in fns.values():
        fn()  # warm-up: compile
    times = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():
            times[k].append(timed(fn))

    prefill, whole, hf_s = med(times["prefill"]), med(times["generate"]), med(times["transformers"])
    step = (whole - prefill) / (n - 1)
    per_form = {form: med(times[form]) / (n - 1) for form in floors}
    form = min(per_form, key=per_form.get)
    floor = per_form[form]
    print(f"model {model_dir.name}, float32, batch {ids.shape[0]}, prompt width {ids.shape[1]}, "
          f"{n} new tokens, greedy; jax {jax.__version__} ({jax.default_backend()}), torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads), CPUs {os.cpu_count()}; "
          f"medians of {runs} alternating runs")
    print(f"ppo_jax generate: {whole * 1e3:.0f} ms = prefill {prefill * 1e3:.0f} ms + "
          f"{n - 1} decode steps of {step * 1e3:.1f} ms")
    for f, t in per_form.items():
        print(f"weight matmuls alone, layers {f}: {t * 1e3:.1f} ms per step ({nbytes / 1e6:.0f} MB "
              f"of weights -> {nbytes / t / 1e9:.1f} GB/s); {t / step:.0%} of our decode step")
    print(f"transformers generate: {hf_s * 1e3:.0f} ms; ratio now {hf_s / whole:.2f}x")
    best = hf_s / (prefill + (n - 1) * floor)
    print(f"best-case ratio (everything but the weight matmuls free, layers {form}): {best:.2f}x; "
          f"a 2x sampler needs decode steps of {(hf_s / 2 - prefill) / (n - 1) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
