"""Helpers shared by the benchmark scripts (standard library only: `ppo_step_trl.py` imports it
from the TRL-only environment too)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# generated output, not measured code: a tree whose only change is this file is not "dirty"
GENERATED = ("bench/results.md",)


def stats(values) -> dict:
    """`{median, min, max, n}` of a sequence of numbers (as floats)."""
    values = [float(v) for v in values]
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def machine_load() -> dict:
    """Logical CPU count and the 1-minute load average now (other load inflates timings)."""
    return {"cpus": os.cpu_count(), "load_average": os.getloadavg()[0]}


# SIMD / matrix instruction sets worth naming next to a CPU figure (x86 flags, Arm features)
ISA_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "asimd", "sve", "sve2")


def cpu_info(cpuinfo: str | None = None) -> dict:
    """`{model, cores, isa}` of this machine from /proc/cpuinfo (or the text `cpuinfo`): the
    "model name", the logical core count and which of `ISA_FLAGS` its "flags" / "Features" line
    lists (figures from CPUs with different vector units must never be mixed)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
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
    """One line for a log or a table: model, cores and instruction sets."""
    isa = " ".join(info["isa"]) or "no SIMD flags read"
    return f"{info['model']}, {info['cores']} logical cores; {isa}"


def git_state(root: Path = ROOT) -> dict:
    """`{commit, dirty}` of the code being measured: `git rev-parse --short HEAD` and whether
    `git status --porcelain` lists a changed tracked file (untracked files and `GENERATED` are
    ignored). `$PPO_BENCH_COMMIT` stands in for the commit where there is no git checkout (a
    tree copied to another machine); `dirty` is then None (unknown), as it is outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                     *(f":(exclude){p}" for p in GENERATED))
    except (OSError, subprocess.CalledProcessError):
        return {"commit": os.environ.get("PPO_BENCH_COMMIT") or None, "dirty": None}
    return {"commit": commit, "dirty": bool(status)}


def process_wall_s() -> float | None:
    """Wall seconds since this process started (Linux: /proc/self/stat and /proc/uptime), None
    where they cannot be read. A benchmark records it just before writing its JSON."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def malloc_settings_on() -> bool | None:
    """Whether this process started under the glibc malloc settings train.py runs with
    (ppo_jax.trainer.host_memory.MALLOC_SETTINGS); None where ppo_jax cannot be imported."""
    try:
        from ppo_jax.trainer.host_memory import malloc_settings_active
    except ImportError:
        return None
    return malloc_settings_active()


def under_malloc_settings() -> None:
    """Re-execute this benchmark under train.py's malloc settings (same pid and arguments), so
    that it measures XLA:CPU as train.py runs it and its in-process peers under the same
    allocator; no-op where they are on already, off (`PPO_JAX_MALLOC_TUNING=0`) or not glibc.
    Call it first in the `__main__` block."""
    from ppo_jax.trainer.host_memory import reexec_with_malloc_settings

    reexec_with_malloc_settings()


def run_record() -> dict:
    """What every benchmark JSON carries about its run: `commit`, `dirty` (git_state), `cpu`
    (cpu_info: model, cores, instruction sets), `wall_s` (process_wall_s) and `malloc_settings`
    (malloc_settings_on), taken at measure time, so a report never attributes figures to the
    machine it is rendered on."""
    return {**git_state(), "cpu": cpu_info(), "wall_s": process_wall_s(),
            "malloc_settings": malloc_settings_on()}


def write_json(path: Path, data: dict) -> None:
    """Write `data` as indented JSON to `path` (parents created) and say so on stdout."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")
