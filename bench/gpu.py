"""PPO-step throughput, MFU and sampler bandwidth of ppo_jax on an accelerator, bf16 (run by
bench/gpu.sh): per model x critic layout, bench/ppo_step.py's worker on random weights; no peer
runs there. FLOPs: 6N per token (Kaplan et al. 2020; N = matmul params, attention scores not
counted: MFU is a slight under-estimate), MFU against the datasheet peak; sampler bytes: every
weight per pass plus the KV cache per decode pass (bandwidth a lower bound). `--dry-run`: the
same code path on the CPU with a tiny model and nominal 1 TFLOP/s, 1 TB/s peaks.

Usage: python bench/gpu.py [--dry-run] [--json PATH]; environment: PPO_BENCH_PEAK_TFLOPS,
    PPO_BENCH_PEAK_HBM_TBS (where the device is not in the tables), PPO_BENCH_DRY=1.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also imported from tests and report.py
from harness import (ROOT, command_line, fmt, log, now, options, run_record, run_worker,  # noqa: E402
                     table, write_json)

TOKENIZER_SRC = ROOT / "bench/smollm2_tokenizer"
TOKENIZER_SHA256 = "bf346d64f6f0fbcefb4c1b6928a98241467dff36c6fbae5fe1785c4ff90667f4"
DIM_KEYS = ("hidden", "layers", "intermediate", "heads", "kv_heads", "head_dim", "rope_theta")
SHAPES = {m: dict(zip(DIM_KEYS, dims)) for m, dims in (  # SmolLM2-135M's shape; Llama-3.2-1B's
    ("smollm2", (576, 30, 1536, 9, 3, 64, 1e5)),           # decoder with SmolLM2's vocabulary
    ("llama1b", (2048, 16, 8192, 32, 8, 64, 5e5)),         # (~1.07B); a tiny one for dry runs
    ("tiny", (64, 2, 128, 4, 2, 16, 1e4)))}
PHASES = ("generation", "scoring", "update", "step")
# Dense bf16 tensor-core peak per chip (vendor data sheets, without sparsity), TFLOP/s, and memory
# bandwidth per chip, TB/s. Matched as a case-insensitive substring of device_kind, longest first.
PEAK_BF16_TFLOPS = {
    "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0,  # SXM ("NVIDIA H100 80GB HBM3")
    "H800": 989.0, "H200": 989.0,  # also "GH200"
    "B200": 2250.0, "B100": 1750.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0, "L4": 121.0,
    "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v5": 459.0,
    "TPU v6 lite": 918.0, "TPU v6e": 918.0,  # v5 lite = v5e, v6 lite = v6e (Trillium)
}
HBM_TBS = {
    "H100 PCIe": 2.0, "H100 NVL": 3.9, "H100": 3.35, "H800": 3.35, "H200": 4.8, "B200": 8.0,
    "B100": 8.0, "A100-SXM4-40GB": 1.555, "A100-PCIE-40GB": 1.555, "A100": 2.039,  # 80GB SXM
    "A800": 2.039, "L40S": 0.864, "L4": 0.3, "TPU v4": 1.2, "TPU v5 lite": 0.819,
    "TPU v5e": 0.819, "TPU v5p": 2.765, "TPU v5": 2.765, "TPU v6 lite": 1.64, "TPU v6e": 1.64,
}
SETTINGS = {False: dict(models=["smollm2", "llama1b"], epochs=[4], batch=64, new_tokens=128, steps=3,
                        time_budget=420.0),  # < 8 min on one H200 (an estimate)
            True: dict(models=["tiny"], epochs=[1], batch=2, new_tokens=4, steps=1, time_budget=0.0)}


def lookup(by_kind: dict, device_kind: str, override: float | None) -> tuple[float | None, str]:
    """(the device's entry of `PEAK_BF16_TFLOPS` or `HBM_TBS`, or `override`; where it came from)."""
    if override:
        return float(override), "override"
    for key in sorted(by_kind, key=len, reverse=True):
        if key.lower() in device_kind.lower():
            return by_kind[key], f"table ({key})"
    return None, "unknown"


# --------------------------------------------------------------------------- FLOPs and bytes
def matmul_params(mc: dict) -> tuple[int, int]:
    """(N_lm, N_value): params used in matmuls per token by a Llama causal LM / value model."""
    h, layers, inter = mc["hidden_size"], mc["num_layers"], mc["intermediate_size"]
    q, kv = mc["num_heads"] * mc["head_dim"], mc["num_kv_heads"] * mc["head_dim"]
    body = layers * (h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h) + h
    return body + mc["vocab_size"] * h, body + h


def phase_flops(r: dict) -> dict:
    """FLOPs of each phase of one PPO step of the worker result `r` (per step, real tokens)."""
    n_lm, n_value = matmul_params(r["model_config"])
    tokens, extra = r["seq_tokens_mean"], n_value if r["mode"] == "separate" else 0
    gen, scoring = 2 * n_lm * tokens, 2 * tokens * (2 * n_lm + extra)
    update = r["epochs"] * 6 * tokens * (n_lm + extra)
    return {"generation": gen, "scoring": scoring, "update": update, "step": gen + scoring + update,
            "n_lm": n_lm, "n_value": n_value}


def sampler_bytes(r: dict) -> dict:
    """HBM bytes of one `generate` call: every matmul weight per pass, the KV cache per decode pass."""
    mc, n = r["model_config"], r["new_tokens"]
    item = 2 if r["dtype"] in ("bfloat16", "float16") else 4
    weights, slots = matmul_params(mc)[0] * item, r["prompt_width"] + n - 1
    kv = 2 * mc["num_layers"] * r["batch"] * slots * mc["num_kv_heads"] * mc["head_dim"] * item
    return {"weight_bytes": weights, "kv_cache_bytes": kv, "cache_slots": slots,
            "bytes": n * weights + (n - 1) * kv}


def sampler_figures(r: dict, hbm_tbs: float | None) -> dict:
    """Sampler tokens/s, achieved bandwidth (GB/s) and its fraction of `hbm_tbs`."""
    gbs = (r.get("sampler_bytes") or sampler_bytes(r))["bytes"] / r["stats"]["time/generation"]["median"] / 1e9
    return {"tokens_per_s": r["stats"]["tokens_per_s/generation"]["median"], "gb_per_s": gbs,
            "hbm_fraction": None if not hbm_tbs else gbs / (hbm_tbs * 1e3)}


# --------------------------------------------------------------------------- markdown
GPU_HEADING = "## PPO step on "


def gpu_section(gpu: dict) -> str:
    """The GPU section of results.md from a gpu.json: settings, a summary (the figures to quote),
    per-phase tokens/s and times, achieved TFLOP/s (MFU)."""
    st, chips, peak, hbm = gpu["settings"], gpu["devices"], gpu["peak_tflops"], gpu.get("peak_hbm_tbs")
    summary, rows, mfu_rows = [], [], []
    for r in gpu["results"]:
        med, key = {k: v["median"] for k, v in r["stats"].items()}, [r["model"], r["mode"], r["epochs"]]
        tflops = {k: r["flops"][k] / med[f"time/{k}"] / 1e12 for k in PHASES}
        mfu = {k: "" if not peak else f" ({100 * tflops[k] / (peak * chips):.1f}%)" for k in PHASES}
        smp, dev_bytes = sampler_figures(r, hbm), r.get("peak_device_bytes")
        frac = "" if smp["hbm_fraction"] is None else f" ({100 * smp['hbm_fraction']:.1f}%)"
        summary.append(key + [fmt(med["time/step"], 3), fmt(med["tokens_per_s/step"], 1),
                              f"{fmt(tflops['update'])}{mfu['update']}", fmt(smp["tokens_per_s"], 1),
                              f"{fmt(smp['gb_per_s'])}{frac}",
                              "n/a" if dev_bytes is None else f"{dev_bytes / 2**30:.1f}"])
        rows.append(key + [fmt(med[f"tokens_per_s/{k}"], 1) for k in PHASES]
                    + [fmt(med[f"time/{k}"], 3) for k in PHASES] + [fmt(r.get("compile_s"))])
        mfu_rows.append([r["model"], f"{r['flops']['n_lm'] / 1e6:.0f}M", r["mode"], r["epochs"]]
                        + [f"{tflops[k]:.2f}{mfu[k]}" for k in PHASES])
    peak_txt = (f"peak {peak:g} TFLOP/s per chip x {chips} chip(s), {gpu['peak_source']}" if peak
                else "peak unknown for this device: set PPO_BENCH_PEAK_TFLOPS for MFU")
    hbm_txt = (f"{hbm:g} TB/s per chip, {gpu.get('peak_hbm_source', 'unknown')}" if hbm
               else "bandwidth unknown for this device: set PPO_BENCH_PEAK_HBM_TBS")
    out = [f"{GPU_HEADING}{chips} x {gpu['device_kind']} (bench/gpu.sh"
           + (", DRY RUN on a tiny model" if gpu.get("dry_run") else "") + ")", "",
           f"ppo_jax only, random weights, {st['dtype']}, batch {st['batch']} (one minibatch), "
           f"{st['new_tokens']} new tokens per response (no early stop), prompts up to "
           f"{st['max_prompt_length']} tokens, {st['warmup']} warm-up + {st['steps']} measured "
           f"steps per configuration (medians). Measured {gpu['date']} with jax {gpu['jax']}, "
           f"code at commit `{gpu.get('commit') or 'unknown'}`" + (" (dirty tree)" if gpu.get("dirty") else "")
           + f"; host CPU {gpu['cpu']['model']}; command `{gpu['command']}`.", ""]
    if shapes := gpu.get("shapes"):
        out += ["Shapes: " + "; ".join(
            f"{m}: hidden {d['hidden']}, {d['layers']} layers, intermediate {d['intermediate']}, "
            f"{d['heads']} heads / {d['kv_heads']} KV heads of {d['head_dim']}"
            for m, d in shapes.items()) + "; SmolLM2's 49152-token vocabulary, tied embeddings.", ""]
    out += [
        f"Summary (medians; MFU: {peak_txt}; HBM: {hbm_txt}):", "",
        table(["model", "critic", "epochs", "step s", "step tok/s", "update TFLOP/s (MFU)",
               "sampler tok/s", "sampler GB/s (of HBM)", "peak device GiB"], summary), "",
        "Per phase (tokens/s: generation = new tokens; scoring, step = real prompt + response "
        "tokens; update = epochs x those; compile = first step minus the median step):", "",
        table(["model", "critic", "epochs"] + [f"{k} tok/s" for k in PHASES]
              + [f"{k} s" for k in PHASES] + ["compile s"], rows), "",
        f"Achieved TFLOP/s (MFU; {peak_txt}; 6N train / 2N inference FLOPs per real token):", "",
        table(["model", "N (matmul)", "critic", "epochs", *PHASES], mfu_rows)]
    for key, what in (("skipped", "skipped (time budget)"), ("failed", "FAILED")):
        if gpu.get(key):
            out += ["", f"{what}: " + ", ".join(f"{x['model']} / {x['mode']} critic / {x['epochs']} epochs"
                                                 for x in gpu[key])]
    return "\n".join(out)


def replace_gpu_section(text: str, section: str) -> str:
    """`text` (a results.md) with its GPU section replaced by `section` (or that appended)."""
    start = text.find("\n" + GPU_HEADING)
    if start < 0:
        return text.rstrip("\n") + "\n\n" + section.strip("\n") + "\n"
    end = text.find("\n## ", start + 1)
    rest = "" if end < 0 else "\n" + text[end:].lstrip("\n")
    return text[:start].rstrip("\n") + "\n\n" + section.strip("\n") + "\n" + rest


# --------------------------------------------------------------------------- models
def unpack_tokenizer(out: Path) -> Path:
    """The shipped SmolLM2 tokenizer as a directory `out` (unpacked once, checked by sha256)."""
    if not (out / "tokenizer.json").is_file():
        data = gzip.decompress((TOKENIZER_SRC / "tokenizer.json.gz").read_bytes())
        if (digest := hashlib.sha256(data).hexdigest()) != TOKENIZER_SHA256:
            raise SystemExit(f"{TOKENIZER_SRC}/tokenizer.json.gz: sha256 {digest}, expected {TOKENIZER_SHA256}")
        out.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(TOKENIZER_SRC / name, out / name)
        (out / "tokenizer.json").write_bytes(data)  # last: it marks a complete directory
    return out


def write_random_llama(out: Path, tokenizer_dir: Path, dims: dict, seed: int = 0) -> Path:
    """A random-init Llama HF directory (bf16) with `tokenizer_dir`'s tokenizer; reused if there."""
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from ppo_jax.models import ModelConfig, init_model, load_tokenizer, save_pretrained

    tok = load_tokenizer(tokenizer_dir)
    eos = int(tok.eos_token_id)
    cfg = ModelConfig(
        model_type="llama", vocab_size=len(tok), hidden_size=dims["hidden"],
        intermediate_size=dims["intermediate"], num_layers=dims["layers"], num_heads=dims["heads"],
        num_kv_heads=dims["kv_heads"], head_dim=dims["head_dim"], max_position_embeddings=8192,
        norm_eps=1e-5, rope_theta=float(dims["rope_theta"]), tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_ids=(eos,), param_dtype="bfloat16", dtype="bfloat16",
        pad_token_id=int(tok.pad_token_id if tok.pad_token_id is not None else eos))
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))  # renamed once complete
    try:
        save_pretrained(init_model(cfg, "causal_lm", seed=seed), cfg, tmp, tok, dtype="bfloat16")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return out


def configurations(models: list[str], modes: list[str], epochs: list[int]) -> list[tuple]:
    """(model, mode, epochs), every model's first mode before any second (a budget drops rows)."""
    return [(name, mode, e) for e in epochs for mode in modes for name in models]


# --------------------------------------------------------------------------- main
def main() -> None:
    env, t_start = os.environ.get, time.perf_counter()
    args = options(__doc__, dry_run=False, json=None)
    dry = args.dry_run or env("PPO_BENCH_DRY", "") not in ("", "0")
    st = {**SETTINGS[dry], "modes": ["shared", "separate"], "warmup": 1, "max_prompt_length": 64,
          "dtype": "bfloat16", "dry_run": dry}
    import jax

    devices = jax.devices()
    kind = devices[0].device_kind
    peak, src = lookup(PEAK_BF16_TFLOPS, kind, float(env("PPO_BENCH_PEAK_TFLOPS") or 0))
    hbm, hbm_src = lookup(HBM_TBS, kind, float(env("PPO_BENCH_PEAK_HBM_TBS") or 0))
    if dry and not peak:
        peak, src = 1.0, "nominal (dry run)"
    if dry and not hbm:
        hbm, hbm_src = 1.0, "nominal (dry run)"
    log(f"jax {jax.__version__}: {len(devices)} x {kind} ({devices[0].platform}); peak bf16 "
        f"{peak or 'unknown'} TFLOP/s per chip ({src}); memory {hbm or 'unknown'} TB/s ({hbm_src})"
        + ("; DRY RUN (tiny model)" if dry else ""))
    if devices[0].platform == "cpu" and not dry:
        log("warning: JAX sees only the CPU; figures are not accelerator figures")
    cache = Path(env("PPO_JAX_CACHE") or Path.cwd() / ".cache")
    worker_env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": env("JAX_COMPILATION_CACHE_DIR")
                  or str(cache / "jax-compile")}  # a persistent XLA cache shared by the workers
    tokenizer = unpack_tokenizer(cache / "smollm2-tokenizer")
    data = {"bench": "gpu", "dry_run": dry, "device_kind": kind, "devices": len(devices),
            "platform": devices[0].platform, "jax": jax.__version__, **run_record(),
            "command": env("PPO_BENCH_COMMAND") or command_line(), "peak_tflops": peak, "peak_source": src,
            "peak_hbm_tbs": hbm, "peak_hbm_source": hbm_src, "settings": st,
            "shapes": {m: SHAPES[m] for m in st["models"]}, "results": [], "skipped": [], "failed": []}

    def save(complete: bool) -> None:
        data.update(complete=complete, wall_s=time.perf_counter() - t_start, date=now())
        if args.json:
            write_json(args.json, data)

    longest, budget = 0.0, st["time_budget"]
    for name, mode, epochs in configurations(st["models"], st["modes"], st["epochs"]):
        which, elapsed = {"model": name, "mode": mode, "epochs": epochs}, time.perf_counter() - t_start
        if budget and data["results"] and elapsed + 1.25 * longest > budget:
            log(f"--- skipped {name}, {mode} critic, {epochs} epoch(s): {elapsed:.0f} s spent + "
                f"1.25 x {longest:.0f} s > the time budget of {budget:.0f} s")
            data["skipped"].append(which)
            continue
        t0, dims = time.perf_counter(), SHAPES[name]  # writing a model counts (1B: a while)
        model_dir = write_random_llama(cache / f"random-llama-{'-'.join(str(dims[k]) for k in DIM_KEYS[:-1])}",
                                       tokenizer, dims)
        r = run_worker([sys.executable, str(ROOT / "bench/ppo_step.py"), "--worker=jax", f"--mode={mode}",
                        f"--model-dir={model_dir}", f"--epochs={epochs}",
                        *(f"--{k.replace('_', '-')}={st[k]}" for k in (
                            "batch", "new_tokens", "steps", "warmup", "max_prompt_length", "dtype"))],
                       worker_env, f"{name}, {mode} critic, {epochs} epoch(s)")
        longest = max(longest, time.perf_counter() - t0)
        if r is None:
            data["failed"].append(which)
            continue
        n = r["n_params"]
        r.update(flops=phase_flops(r), sampler_bytes=sampler_bytes(r), weights="random",
                 model=f"{name}-{f'{n / 1e9:.2f}B' if n >= 1e9 else f'{n / 1e6:.0f}M'}")
        data["results"].append(r)
        smp = sampler_figures(r, hbm)
        log(f"    step {r['stats']['time/step']['median']:.3f} s; sampler {smp['tokens_per_s']:.1f} tok/s, "
            f"{smp['gb_per_s']:.1f} GB/s; worker {r['wall_s']:.0f} s")
        save(complete=False)
    save(complete=True)
    if not data["results"]:
        raise SystemExit("no configuration ran")
    print(gpu_section(data), flush=True)
    if data["failed"]:
        raise SystemExit("some configurations failed (see above)")


if __name__ == "__main__":
    main()
