"""The README and docs/ stay true to the repository: every relative link and every repository path
they name exists, docs/config.md is what scripts/config_reference.py writes from the typed
config, nothing names a path of one machine, and the README stays a five-minute read that starts
with its two commands."""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# What runs, benchmarks and set-up write; named by the docs, absent from a fresh checkout.
GENERATED = ("runs/", "bench/results_raw/", ".venv/", ".venv-bench/", ".cache/")
# Files a run writes into its output directory, named by the docs without a directory.
RUN_OUTPUTS = {"metrics.jsonl", "metrics.superseded.jsonl", "samples.jsonl", "report.json",
               "gpu.json", "config.json", "adapter_config.json", "config.resume-<step>.json",
               "samples.superseded.jsonl", "config.superseded.json", "config.resume-<k>.json",
               "config.resume-<step>.superseded.json"}
EXTENSIONS = (".py", ".md", ".yaml", ".yml", ".sh", ".jsonl", ".json", ".png", ".toml",
              ".txt", ".parquet", ".jinja", ".gguf")
SKIP_DIRS = {".git", ".venv", ".venv-bench", ".cache", "runs", "__pycache__", ".ruff_cache",
             ".pytest_cache"}

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
TOKEN_SPLIT = re.compile(r"[\s=,;()\[\]{}'\"|]+")


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _top_level() -> set[str]:
    return {p.name for p in ROOT.iterdir() if p.name not in SKIP_DIRS and
            (not p.name.startswith(".") or p.name == ".ci")}


@functools.lru_cache(maxsize=1)
def _basenames() -> frozenset[str]:
    """Names of every file and folder in the repository (outside what runs and set-up write)."""
    names = set()
    for _, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        names.update(dirs, files)
    return frozenset(names)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            anchors.add(slug if n == 0 else f"{slug}-{n}")
            seen[slug] = n + 1
    return anchors


def _code_tokens(text: str) -> list[str]:
    """Words of fenced blocks and code spans, split at spaces, `=`, quotes and brackets."""
    pieces = [block for block in FENCE.findall(text)]
    pieces += CODE_SPAN.findall(FENCE.sub("", text))
    tokens = []
    for piece in pieces:
        for token in TOKEN_SPLIT.split(piece):
            token = token.strip(".:`*").rstrip("\\")
            if token:
                tokens.append(token)
    return tokens


def _repo_path(token: str, top: set[str]) -> str | None:
    """The repository path a code token names, or None when it is not one."""
    if token.startswith(("/", "~", "$", "<", "http", "-")) or "://" in token:
        return None
    if "/" in token:
        return token if token.split("/", 1)[0] in top else None
    return token if token.endswith(EXTENSIONS) else None


def _placeholder(name: str) -> bool:
    """A name to fill in, such as `IN.gguf` or `YOUR_FILE.jsonl`."""
    return re.fullmatch(r"[A-Z][A-Z0-9_]*", name.split(".", 1)[0]) is not None


def _exists(path: str) -> bool:
    if path.startswith(GENERATED) or path.rstrip("/") + "/" in GENERATED:
        return True
    if any(ch in path for ch in "*?"):
        return bool(glob.glob(str(ROOT / path)))
    return (ROOT / path.rstrip("/")).exists()


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_resolves(page):
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{_name(page)}: broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_repository_path_named_exists(page):
    top, basenames = _top_level(), _basenames()
    missing = []
    for token in _code_tokens(page.read_text(encoding="utf-8")):
        path = _repo_path(token, top)
        if path is None:
            continue
        if "/" in path:
            ok = _exists(path)
        else:  # a bare file name: a file somewhere in the repository, one a run writes, or a
            ok = path in RUN_OUTPUTS or path in basenames or _placeholder(path)  # IN.gguf
        if not ok:
            missing.append(path)
    assert not missing, f"{_name(page)} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_machine_paths(page):
    machine_path = r"(?<![\w.~-])/(?:work|root|tmp)(?![\w-])(?:/[^\s`)]*)?"
    found = re.findall(machine_path, page.read_text(encoding="utf-8"))
    assert not found, f"{_name(page)} names paths of one machine: {found}"


def test_config_reference_is_current():
    spec = importlib.util.spec_from_file_location("config_reference",
                                                  ROOT / "scripts/config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    want = module.render()
    have = (ROOT / "docs/config.md").read_text(encoding="utf-8")
    assert have == want, ("docs/config.md is stale (the typed config or configs/default.yaml "
                          "changed): run `.venv/bin/python scripts/config_reference.py`")


def test_readme_is_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 160, "README.md: a five-minute read; move detail to docs/"
    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    assert sections[1].startswith("Quickstart"), "README.md: the first section is the Quickstart"
    quickstart = FENCE.findall(sections[1])
    assert quickstart and "make train" in quickstart[0] and "make test" in quickstart[0]


def test_path_finder_sees_paths_and_ignores_other_code():
    top = {"ppo_jax", "configs", "bench", "docs"}
    tokens = _code_tokens(
        "run `ppo_jax/rollout/sampler.py` with `--set data.prompts=configs/tiny.yaml` and "
        "`bench/results.md`; `ppo.kl_coef`, `/mnt/x.jsonl`, `[B, T]`, `IN.gguf`\n"
        "```bash\n.venv/bin/python train.py --config configs/x.yaml\n```\n")
    paths = {p for p in (_repo_path(t, top) for t in tokens) if p}
    assert paths == {"ppo_jax/rollout/sampler.py", "configs/tiny.yaml", "bench/results.md",
                     "train.py", "configs/x.yaml", "IN.gguf"}
    assert _placeholder("IN.gguf") and not _placeholder("metrics.jsonl")
    assert not _exists("configs/x.yaml") and _exists("runs/default/actor_hf")
    assert _slug("Log-probs without the `[B, N, V]` logits") == "log-probs-without-the-b-n-v-logits"
