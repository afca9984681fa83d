"""Which code the benchmark figures came from: the commit and dirty flag each raw JSON records
(bench/common.py `run_record`; bench/gpu.py's `commit` string), and the lines bench/report.py
puts under results.md's title: the commit(s), and a warning when the raw files come from
commits with different measured code (a note naming the commits when `git diff` shows the same
ppo_jax code in all), from a dirty tree, or record no commit; and the CPU the raw files record,
with a warning when they record different CPUs or none (standard library and git only)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from common import ROOT, cpu_line

# the code whose speed the benchmarks measure (the benchmark scripts measure it; the report's
# own modules only render): two commits that hold the same of these measured the same code.
# Of configs/, the CPU benchmarks run the default run's config and the prompt sets only (the
# others override the schema defaults in ppo_jax; logprob_memory.py reads two sizes of
# llama_8b_gpu_tpu.yaml for its arithmetic, and a change there shows in its figures).
MEASURED_CODE = ("ppo_jax", "train.py", "configs/default.yaml", "configs/prompts",
                 "pyproject.toml", "scripts/setup_venv.sh")
BENCH_SCRIPTS = ("bench/*.py", "bench/*.sh")
RENDERING = ("bench/report.py", "bench/sections.py", "bench/provenance.py",
             "bench/gpu_figures.py", "bench/train_figures.py")


def commit_of(data: dict) -> tuple[str | None, bool | None]:
    """(commit, dirty) a raw JSON records: `commit` and `dirty` (bench/common.py `run_record`),
    or gpu.json's `commit` string (bench/gpu.py), "-dirty" appended when its tree had changes.
    None where not recorded."""
    commit = data.get("commit")
    if commit is None:
        return None, None
    if "dirty" in data:
        return commit, data["dirty"]
    if commit.endswith("-dirty"):
        return commit[: -len("-dirty")], True
    return commit, None


def same_commit(a: str, b: str) -> bool:
    """One hash is a prefix of the other (a short hash against a full one)."""
    return a.startswith(b) or b.startswith(a)


def code_changes(a: str, b: str, root: Path = ROOT) -> tuple[list[str], list[str]] | None:
    """(measured-code files, benchmark-script files) that differ between commits `a` and `b`
    (`git diff --name-only a b`: MEASURED_CODE, and BENCH_SCRIPTS less the RENDERING modules), or
    None where git cannot tell (no checkout, an unknown commit)."""
    def names(*paths: str) -> list[str]:
        out = subprocess.run(["git", "diff", "--name-only", a, b, "--", *paths], cwd=root,
                             capture_output=True, text=True, check=True).stdout
        return out.split()

    try:
        return (names(*MEASURED_CODE),
                names(*BENCH_SCRIPTS, *(f":(exclude){p}" for p in RENDERING)))
    except (OSError, subprocess.CalledProcessError):
        return None


def mixed_commit_lines(distinct: list[str], root: Path = ROOT) -> list[str]:
    """For raw files from several commits: a note when every commit holds the same measured code
    as the first (MEASURED_CODE unchanged; the benchmark scripts that differ are named), else
    the warning that the figures were not all measured on the same code."""
    changes = [code_changes(distinct[0], c, root) for c in distinct[1:]]
    commits = ", ".join(f"`{c}`" for c in distinct)
    if all(ch is not None and not ch[0] for ch in changes):
        scripts = sorted({f for ch in changes for f in ch[1]})
        return [f"> **Note:** the raw files come from {len(distinct)} commits ({commits}) that "
                f"hold the same measured code: `git diff` between them is empty for "
                f"{', '.join(MEASURED_CODE)}"
                + (f"; the benchmark scripts that differ: {', '.join(scripts)}." if scripts
                   else "; the benchmark scripts are the same too.")]
    return [f"> **Warning:** the raw files come from {len(distinct)} different commits "
            f"({commits}): these figures were not all measured on the same code."]


def provenance_lines(raws: dict[str, dict | None], root: Path = ROOT) -> list[str]:
    """The commit(s) the raw files came from; a warning each when they come from different
    commits holding different measured code (a note when the code is the same: see
    `mixed_commit_lines`), from a dirty tree, or record no commit."""
    recs = {name: commit_of(d) for name, d in raws.items() if d}
    if not recs:
        return []
    distinct: list[str] = []
    for commit, _ in recs.values():
        if commit and not any(same_commit(commit, c) for c in distinct):
            distinct.append(commit)
    missing = [n for n, (c, _) in recs.items() if c is None]
    dirty = [n for n, (_, d) in recs.items() if d]
    if len(distinct) == 1 and not missing:
        lines = [f"Code: commit `{distinct[0]}` (every raw file)."]
    else:
        lines = ["Code: " + ", ".join(f"{n} `{c}`" if c else f"{n} not recorded"
                                      for n, (c, _) in recs.items()) + "."]
    if len(distinct) > 1:
        lines += mixed_commit_lines(distinct, root)
    if dirty:
        lines.append("> **Warning:** measured on a dirty tree (uncommitted changes to tracked "
                     f"files): {', '.join(dirty)}; the commit does not hold the code measured.")
    if missing:
        lines.append(f"> **Warning:** no commit recorded for {', '.join(missing)} (a file from "
                     "before the benchmarks recorded it, or from a tree outside git without "
                     "$PPO_BENCH_COMMIT): which code these figures came from is unknown.")
    return lines


def cpu_lines(raws: dict[str, dict | None], here: dict) -> list[str]:
    """The CPU the figures were measured on, as the raw files record it (`cpu`, bench/common.py
    `run_record`), and a warning each when they record different CPUs (figures from machines
    with different vector units must not be compared as one run) or none, in which case the
    CPU of the machine rendering the report (`here`, a `cpu_info` dict) is given and said to be
    that."""
    recs = {name: d.get("cpu") for name, d in raws.items() if d}
    distinct: list[str] = []
    for cpu in recs.values():
        if cpu and cpu_line(cpu) not in distinct:
            distinct.append(cpu_line(cpu))
    missing = [n for n, c in recs.items() if not c]
    if len(distinct) == 1:
        lines = [f"- CPU (recorded by the benchmarks): {distinct[0]}"]
    elif distinct:
        lines = ["- CPU (recorded by the benchmarks): " + "; ".join(
            f"{n}: {cpu_line(c)}" for n, c in recs.items() if c)]
    else:
        lines = [f"- CPU: not recorded by the raw files; this report was rendered on "
                 f"{cpu_line(here)}"]
    if len(distinct) > 1:
        lines.append(f"> **Warning:** the raw files come from {len(distinct)} different CPUs: "
                     "their figures are not from one machine and must not be compared as one run.")
    if missing and distinct:
        lines.append(f"> **Warning:** no CPU recorded for {', '.join(missing)} (a file from before "
                     "the benchmarks recorded it): which machine measured those is unknown.")
    return lines
