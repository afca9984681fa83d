"""PPO-step throughput and model FLOPs utilisation (MFU) of ppo_jax on an accelerator, bf16.

Run by `bench/gpu.sh` (which sets up the environment first). For each model x `--modes` x
`--epochs`, one subprocess runs `bench/ppo_step.py --worker jax --dtype bfloat16` (the same
`PPOTrainer.step()` measurement as the CPU benchmark: warm-up steps holding the compilation,
then the median of the measured steps per phase) and this script turns its times and token
counts into FLOP/s and MFU.

Models:
- `smollm2`: SmolLM2-135M-Instruct converted by `ensure_smollm2()`;
- `random`: a random-init Llama written here once (config.json + bf16 safetensors + SmolLM2's
  tokenizer, so the vocabulary is SmolLM2's 49152 tokens); default hidden 2048, 16 layers,
  intermediate 5632, 16 heads / 8 KV heads of 128: ~0.86B params. Sampled text from a random
  model is noise, which is fine for timing (`generation.ignore_eos=true`: every response is
  `--new-tokens` long).

FLOPs model (Kaplan et al. 2020, "6N"): N = the parameters used in matmuls per token (the
decoder layers, plus vocab x hidden for the LM head; token-embedding lookups are free; a value
model has a 1-wide head instead of the LM head); attention-score FLOPs (which grow with the
sequence length) are not counted, so MFU is a slight under-estimate. Tokens are real tokens
(left padding is wasted work, not credited):
- generation: 2 N_lm x (prompt + response tokens)  (prefill + one decode pass per new token);
- scoring: 2 N_lm x tokens for each of actor and reference, + 2 N_value x tokens for a separate
  critic (shared critic: the values come out of the actor's pass);
- update: ppo_epochs x 6 x (N_lm [+ N_value with a separate critic]) x tokens (forward +
  backward of every trained model).
MFU = FLOPs / wall time / (peak dense bf16 FLOP/s per chip x chips), with the peak taken from
`PEAK_BF16_TFLOPS` keyed on `jax.devices()[0].device_kind`, or from `--peak-tflops` /
`$PPO_BENCH_PEAK_TFLOPS` (per chip) where the chip is not in the table.

`--dry-run`: the same code path on whatever backend JAX has (CPU here) with a tiny random Llama
(SmolLM2's vocabulary, hidden 64, 2 layers), batch 2, 4 new tokens, 1 measured step; MFU then
uses a nominal 1 TFLOP/s peak unless one is given. It checks the script, not the hardware.

Usage: python bench/gpu.py [--dry-run] [--models smollm2,random] [--modes shared,separate]
    [--epochs 4] [--batch 64] [--new-tokens 128] [--steps 3] [--warmup 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

JSON_TAG = "BENCH_JSON "

# Dense bf16 tensor-core peak per chip (vendor data sheets, without sparsity), TFLOP/s.
# Matched as a case-insensitive substring of device_kind, longest key first.
PEAK_BF16_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,  # SXM ("NVIDIA H100 80GB HBM3")
    "H800": 989.0,
    "H200": 989.0,  # also "GH200"
    "B200": 2250.0,
    "B100": 1750.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,  # v5e
    "TPU v5e": 197.0,
    "TPU v5p": 459.0,
    "TPU v5": 459.0,
    "TPU v6 lite": 918.0,  # v6e (Trillium)
    "TPU v6e": 918.0,
}

RANDOM_DEFAULT = dict(hidden=2048, layers=16, intermediate=5632, heads=16, kv_heads=8, head_dim=128)
RANDOM_TINY = dict(hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, head_dim=16)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def peak_tflops(device_kind: str, override: float | None) -> tuple[float | None, str]:
    """(peak per chip in TFLOP/s, where it came from)."""
    if override:
        return float(override), "override"
    kind = device_kind.lower()
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key.lower() in kind:
            return PEAK_BF16_TFLOPS[key], f"table ({key})"
    return None, "unknown"


def matmul_params(mc: dict) -> tuple[int, int]:
    """(N_lm, N_value): params used in matmuls per token by a causal LM and by a value model of
    the config `mc` (see the module docstring). Llama family: q/k/v/o, gate/up/down, norms."""
    h, layers, inter = mc["hidden_size"], mc["num_layers"], mc["intermediate_size"]
    q, kv = mc["num_heads"] * mc["head_dim"], mc["num_kv_heads"] * mc["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    body = layers * per_layer + h
    return body + mc["vocab_size"] * h, body + h


def phase_flops(r: dict) -> dict:
    """FLOPs of each phase of one PPO step of the worker result `r` (per step, real tokens)."""
    n_lm, n_value = matmul_params(r["model_config"])
    tokens, epochs = r["seq_tokens_mean"], r["epochs"]
    separate = r["mode"] == "separate"
    gen = 2 * n_lm * tokens
    scoring = 2 * tokens * (2 * n_lm + (n_value if separate else 0))
    update = epochs * 6 * tokens * (n_lm + (n_value if separate else 0))
    return {"generation": gen, "scoring": scoring, "update": update,
            "step": gen + scoring + update, "n_lm": n_lm, "n_value": n_value}


def write_random_llama(out: Path, tokenizer_dir: Path, dims: dict, seed: int = 0) -> Path:
    """A random-init Llama HF directory (bf16 safetensors) with `tokenizer_dir`'s tokenizer;
    reused when already there (written to a temporary sibling, then renamed)."""
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from ppo_jax.models import ModelConfig, init_model, load_tokenizer, save_pretrained

    tok = load_tokenizer(tokenizer_dir)
    eos = int(tok.eos_token_id)
    cfg = ModelConfig(
        model_type="llama", vocab_size=len(tok), hidden_size=dims["hidden"],
        intermediate_size=dims["intermediate"], num_layers=dims["layers"],
        num_heads=dims["heads"], num_kv_heads=dims["kv_heads"], head_dim=dims["head_dim"],
        max_position_embeddings=2048, norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_ids=(eos,),
        pad_token_id=int(tok.pad_token_id if tok.pad_token_id is not None else eos))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    try:
        t0 = time.perf_counter()
        save_pretrained(init_model(cfg, "causal_lm", seed=seed), cfg, tmp, tok, dtype="bfloat16")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        log(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def run_worker(model_dir: Path, mode: str, epochs: int, args) -> dict | None:
    cmd = [sys.executable, str(ROOT / "bench/ppo_step.py"), "--worker", "jax", "--mode", mode,
           "--model-dir", str(model_dir), "--epochs", str(epochs), "--batch", str(args.batch),
           "--new-tokens", str(args.new_tokens), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--max-prompt-length", str(args.max_prompt_length),
           "--dtype", args.dtype, "--remat", args.remat]
    log(f"--- {model_dir.name}, {mode} critic, {epochs} epoch(s)")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(JSON_TAG)]
    if proc.returncode != 0 or not lines:
        log(f"--- FAILED (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}")
        return None
    return json.loads(lines[-1][len(JSON_TAG):])


def markdown(results: list[dict], peak: float | None, peak_src: str, chips: int) -> str:
    from report import _f, table

    head = ["model", "critic", "epochs", "generation tok/s", "scoring tok/s", "update tok/s",
            "step tok/s", "step s", "compile s", "peak device GiB"]
    rows, mfu_rows = [], []
    for r in results:
        st = r["stats"]
        dev = r.get("peak_device_bytes")
        comp = (r.get("compile_s") or {}).get("time/step")
        rows.append([r["model"], r["mode"], r["epochs"]]
                    + [_f(st[f"tokens_per_s/{k}"]["median"], 1)
                       for k in ("generation", "scoring", "update", "step")]
                    + [_f(st["time/step"]["median"], 3), _f(comp),
                       "n/a" if dev is None else f"{dev / 2**30:.1f}"])
        fl = r["flops"]
        cells = []
        for k in ("generation", "scoring", "update", "step"):
            achieved = fl[k] / st[f"time/{k}"]["median"] / 1e12
            mfu = "" if not peak else f" ({100 * achieved / (peak * chips):.1f}%)"
            cells.append(f"{achieved:.2f}{mfu}")
        mfu_rows.append([r["model"], f"{fl['n_lm'] / 1e6:.0f}M", r["mode"], r["epochs"]] + cells)
    peak_txt = (f"peak {peak:g} TFLOP/s per chip x {chips} chip(s), {peak_src}" if peak
                else "peak unknown for this device: set PPO_BENCH_PEAK_TFLOPS for MFU")
    return "\n".join([
        table(head, rows), "",
        f"Achieved TFLOP/s (MFU; {peak_txt}; 6N train / 2N inference FLOPs per real token):", "",
        table(["model", "N (matmul)", "critic", "epochs", "generation", "scoring", "update", "step"],
              mfu_rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        default=os.environ.get("PPO_BENCH_DRY", "") not in ("", "0"),
                        help="tiny model, few tokens, any backend (also PPO_BENCH_DRY=1)")
    parser.add_argument("--models", default=None, help="comma-separated: smollm2, random")
    parser.add_argument("--modes", default="shared,separate")
    parser.add_argument("--epochs", type=int, nargs="+", default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-prompt-length", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--remat", default="none")
    parser.add_argument("--random-dims", default=None,
                        help="hidden,layers,intermediate,heads,kv_heads,head_dim of the random "
                             f"Llama (default {','.join(map(str, RANDOM_DEFAULT.values()))})")
    parser.add_argument("--peak-tflops", type=float,
                        default=float(os.environ["PPO_BENCH_PEAK_TFLOPS"])
                        if os.environ.get("PPO_BENCH_PEAK_TFLOPS") else None,
                        help="peak dense bf16 TFLOP/s per chip (default: table by device_kind)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    dry = args.dry_run
    args.models = args.models or ("random" if dry else "smollm2,random")
    args.epochs = args.epochs or ([1] if dry else [4])
    args.batch = args.batch or (2 if dry else 64)
    args.new_tokens = args.new_tokens or (4 if dry else 128)
    args.steps = args.steps or (1 if dry else 3)
    if args.random_dims:
        dims = dict(zip(RANDOM_DEFAULT, map(int, args.random_dims.split(","))))
    else:
        dims = RANDOM_TINY if dry else RANDOM_DEFAULT

    import jax

    from ppo_jax.models.smollm2 import default_cache_dir, ensure_smollm2

    devices = jax.devices()
    kind = devices[0].device_kind
    peak, src = peak_tflops(kind, args.peak_tflops)
    if peak is None and dry:
        peak, src = 1.0, "nominal (dry run)"
    log(f"jax {jax.__version__}: {len(devices)} x {kind} ({devices[0].platform}); "
        f"peak bf16 {peak if peak else 'unknown'} TFLOP/s per chip ({src})"
        + ("; DRY RUN (tiny model)" if dry else ""))
    if devices[0].platform == "cpu" and not dry:
        log("warning: JAX sees only the CPU; figures are not accelerator figures")

    smollm2 = ensure_smollm2()
    model_dirs = {}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        if name == "smollm2":
            model_dirs[name] = smollm2
        elif name == "random":
            tag = "-".join(str(v) for v in dims.values())
            model_dirs[name] = write_random_llama(default_cache_dir() / f"random-llama-{tag}",
                                                  smollm2, dims)
        else:
            parser.error(f"unknown model {name!r} (smollm2, random)")

    results = []
    for name, model_dir in model_dirs.items():
        for epochs in args.epochs:
            for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
                r = run_worker(model_dir, mode, epochs, args)
                if r is None:
                    continue
                r["flops"] = phase_flops(r)
                n = r["n_params"]
                size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
                r["model"] = name if name != "random" else f"random-llama-{size}"
                results.append(r)
                log(f"    step {r['stats']['time/step']['median']:.3f} s, "
                    f"{r['stats']['tokens_per_s/step']['median']:.1f} tok/s")
    if not results:
        raise SystemExit("no configuration ran")
    text = markdown(results, peak, src, len(devices))
    print(f"\n{len(devices)} x {kind}; {args.dtype}; batch {args.batch}, {args.new_tokens} new "
          f"tokens, prompts up to {args.max_prompt_length} tokens; {args.warmup} warm-up + "
          f"{args.steps} measured steps (medians)\n")
    print(text)
    if args.json:
        data = {"bench": "gpu", "dry_run": dry,
                "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "device_kind": kind, "devices": len(devices), "peak_tflops": peak,
                "peak_source": src, "settings": {k: v for k, v in vars(args).items() if k != "json"},
                "random_dims": dims, "results": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1, default=str))
        log(f"wrote {args.json}")
    if len(results) < len(model_dirs) * len(args.epochs) * len(args.modes.split(",")):
        raise SystemExit("some configurations failed (see above)")


if __name__ == "__main__":
    main()
