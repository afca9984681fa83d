"""bench/train_run.py and its results.md section: runs measured from outside through a stub
interpreter (environment, resident memory, a failing run, temporary directories) and, slow, a
real tiny `train.py` run; the variant spec, the summary of a metrics file and the merge over
rounds against hand-computed figures; the rendered tables; the bad inputs."""

from __future__ import annotations

import ast
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # the benchmark scripts import each other by name
import report  # noqa: E402
import train_run  # noqa: E402


def test_parse_spec_splits_environment_from_arguments():
    env, args = train_run.parse_spec("PPO_JAX_MALLOC_TUNING=0 A_B=x=y --config c.yaml "
                                     "--set 'data.prompts=a b.jsonl' --set ppo.kl_coef=0.1")
    assert env == {"PPO_JAX_MALLOC_TUNING": "0", "A_B": "x=y"}
    assert args == ["--config", "c.yaml", "--set", "data.prompts=a b.jsonl",
                    "--set", "ppo.kl_coef=0.1"]
    # a `VAR=VALUE` word after the first argument belongs to train.py
    assert train_run.parse_spec("--set X=1") == ({}, ["--set", "X=1"])
    assert train_run.parse_spec("") == ({}, [])
    with pytest.raises(ValueError, match="train.output_dir"):
        train_run.parse_spec("--set train.output_dir=runs/x")


def test_summarize_metrics_by_hand():
    rows = [{"step": 0, "eval/reward_mean": 0.2, "time/eval": 10.0}]
    times = [(9.0, 8.0, 30.0, 47.0), (2.0, 3.0, 10.0, 15.0), (4.0, 1.0, 12.0, 17.0),
             (3.0, 2.0, 11.0, 16.0)]
    for i, (g, s, u, t) in enumerate(times, start=1):
        rows.append({"step": i, "score_mean": 0.1 * i, "kl": [0.0, 2.0, 1.0, 4.0][i - 1],
                     "time/generation": g, "time/experience": s, "time/update": u, "time/step": t})
    rows.append({"step": 4, "eval/reward_mean": 0.5, "time/eval": 4.0})
    out = train_run.summarize_metrics(rows, window=2)
    assert out["steps"] == 4
    assert out["evals"] == [[0, 0.2], [4, 0.5]] and out["eval_s"] == 14.0
    assert out["first_step"] == {"time/generation": 9.0, "time/experience": 8.0,
                                 "time/update": 30.0, "time/step": 47.0}
    # steps 2..4: medians of (2, 4, 3), (3, 1, 2), (10, 12, 11), (15, 17, 16)
    assert out["median"] == {"time/generation": 3.0, "time/experience": 2.0, "time/update": 11.0,
                             "time/step": 16.0}
    assert out["score_start"] == pytest.approx(0.15) and out["score_end"] == pytest.approx(0.35)
    assert out["kl_start"] == 1.0 and out["kl_end"] == 2.5 and out["kl_max"] == 4.0
    assert train_run.summarize_metrics([{"step": 0, "eval/reward_mean": 0.3}])["steps"] == 0


def test_merge_runs_medians_and_ranges():
    def run(wall, rss, step):
        return {"wall_s": wall, "max_rss_kib": rss, "minor_faults": 10 * rss,
                "major_faults": 0, "user_s": wall * 1.5, "system_s": 1.0,
                "median": {"time/step": step, "time/update": step / 2}}

    merged = train_run.merge_runs([run(100.0, 5, 10.0), run(130.0, 7, 12.0), run(90.0, 6, 20.0)])
    assert merged["wall_s"] == {"median": 100.0, "min": 90.0, "max": 130.0, "n": 3}
    assert merged["max_rss_kib"] == {"median": 6, "min": 5, "max": 7, "n": 3}
    assert merged["minor_faults"]["median"] == 60 and merged["user_s"]["median"] == 150.0
    assert {k: v["median"] for k, v in merged["median"].items()} == {"time/update": 6.0, "time/step": 12.0}
    assert merged["median"]["time/step"] == {"median": 12.0, "min": 10.0, "max": 20.0, "n": 3}


@pytest.mark.slow
def test_a_tiny_run_is_measured(tmp_path):
    """One real train.py run of the tiny config (two steps, no evaluation), kept: the JSON's
    figures are its metrics file's and the kernel's, not made up (about 30 s; the default tests
    check the same mechanics with a stub interpreter below)."""
    out = tmp_path / "train_run.json"
    spec = ("--config configs/tiny.yaml --set train.steps=2 --set eval.every=0 "
            "--set train.export_hf=false --set train.tensorboard=false")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/train_run.py"), "--variant", "tiny", spec,
         "--work-dir", str(tmp_path / "runs"), "--keep", "--title", "tiny", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Measured " in proc.stdout and " logical cores; " in proc.stdout and "[tiny]" in proc.stdout
    data = json.loads(out.read_text())
    assert data["bench"] == "train_run" and data["title"] == "tiny" and data["rounds"] == 1
    assert data["cpu"]["model"] and "commit" in data and "bench/train_run.py" in data["command"]
    (variant,) = data["variants"]
    assert variant["name"] == "tiny" and variant["env"] == {}
    # train.py re-executes itself under its malloc settings on Linux with glibc
    expected = (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
                and os.environ.get("PPO_JAX_MALLOC_TUNING", "1") != "0")
    assert variant["malloc_settings"] is expected
    assert variant["args"][:2] == ["--config", "configs/tiny.yaml"]
    (run,) = variant["runs"]
    rows = [json.loads(line) for line in
            (tmp_path / "runs/tiny_round1/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step" in r]
    assert run["steps"] == len(steps) == 2
    assert run["first_step"]["time/step"] == steps[0]["time/step"]
    assert run["median"]["time/update"] == statistics.median([steps[1]["time/update"]])
    assert run["evals"] == [] and run["eval_s"] == 0
    # the whole process: longer than its steps, a real resident set (jax alone is > 100 MB)
    assert run["wall_s"] > sum(r["time/step"] for r in steps)
    assert run["max_rss_kib"] > 100 * 1024 and run["minor_faults"] > 1000
    assert run["user_s"] > 1.0 and run["system_s"] >= 0
    assert variant["merged"]["wall_s"]["median"] == run["wall_s"]
    assert (tmp_path / "runs/tiny_round1.log").is_file()


def test_bad_variants_fail_with_their_name(tmp_path):
    script = str(ROOT / "bench/train_run.py")
    proc = subprocess.run([sys.executable, script, "--variant", "mine",
                           "--set train.output_dir=x", "--work-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "variant 'mine'" in proc.stderr
    assert "train.output_dir" in proc.stderr
    proc = subprocess.run([sys.executable, script, "--variant", "a", "", "--variant", "a", ""],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "must differ" in proc.stderr
    proc = subprocess.run([sys.executable, script, "--variant", "a b", "", "--variant", "a_b", ""],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "must differ" in proc.stderr  # the same directory name


# --------------------------------------------------------------------------- results.md section
def _run(rnd, wall, rss, minflt, sys_s, step, update, evals=()):
    return {"round": rnd, "wall_s": wall, "max_rss_kib": rss, "minor_faults": minflt,
            "major_faults": 0, "user_s": 2 * wall, "system_s": sys_s, "steps": 5,
            "first_step": {"time/step": 60.0},
            "median": {"time/generation": 5.0, "time/experience": 6.0, "time/update": update,
                       "time/step": step},
            "evals": list(evals), "eval_s": 20.0 if evals else 0.0,
            "score_start": 0.3, "score_end": 0.7, "kl_start": 0.5, "kl_end": 5.0, "kl_max": 7.0}


def _ab_data():
    on = [_run(1, 600.0, 8 * 2**20, 3e6, 30.0, 45.0, 33.0), _run(2, 660.0, 8 * 2**20, 3e6, 34.0, 50.0, 36.0)]
    off = [_run(1, 720.0, 7.5 * 2**20, 9e6, 70.0, 54.0, 40.0), _run(2, 700.0, 7.5 * 2**20, 12e6, 68.0, 50.0, 37.0)]
    variants = []
    for name, spec, runs, flag in (("on", "--set train.steps=5", on, True),
                                   ("off", "PPO_JAX_MALLOC_TUNING=0 --set train.steps=5", off, False)):
        variants.append({"name": name, "spec": spec, "malloc_settings": flag, "runs": runs,
                         "merged": train_run.merge_runs(runs)})
    return {"benchmark": "train_run", "title": "A/B", "rounds": 2, "window": 5,
            "command": ".venv/bin/python bench/train_run.py --rounds 2", "variants": variants}


def test_section_gives_medians_ranges_and_per_round_ratios_by_hand():
    text = train_run.markdown(_ab_data())
    # merged: wall median of 600 / 660 s = 10.5 min (10.0-11.0), RSS 8.00 GiB, faults 3.00M
    assert ("| on | `--set train.steps=5` | 5 | 10.5 (10.0–11.0) | 60.0 | "
            "5.00 / 6.00 / 34.5 / 47.5 | 8.00 | 3.00 | 0 | 1,260 (1,200–1,320) | 32.0 (30.0–34.0) "
            "| on |") in text
    assert "| off | `PPO_JAX_MALLOC_TUNING=0 --set train.steps=5` |" in text and "| off |\n" in text
    # per round: step 45/54 and 50/50 -> x0.92 (x0.83-x1.00); faults 9/3 and 12/3 -> x3.50 (3-4)
    assert ("| off | ×0.92 (×0.83–×1.00) | ×0.90 (×0.82–×0.97) | ×0.89 (×0.83–×0.94) | "
            "×0.94 (×0.94–×0.94) | ×3.50 (×3.00–×4.00) | ×2.17 (×2.00–×2.33) |") in text
    assert "Every run" not in text  # the per-round ratios and the ranges say it
    # no evaluation in these runs: the training figures alone
    assert "| off, round 2 | 0.300 → 0.700 | 5.00 / 7.00 | none | — |" in text
    assert "Incomplete" not in text
    partial = {**_ab_data(), "complete": False}
    partial["variants"][1]["runs"] = partial["variants"][1]["runs"][:1]
    text = train_run.markdown(partial)
    assert "**Incomplete: the measurement stopped before its last run.**" in text
    assert "| off | ×0.83 | ×0.82 | ×0.83 | ×0.94 | ×3.00 | ×2.33 |" in text  # round 1 alone


def test_ratio_table_without_update_times():
    """Runs of a stage without an update phase (or without steps) still render: n/a."""
    data = _ab_data()
    for v in data["variants"]:
        for r in v["runs"]:
            del r["median"]["time/update"]
        v["merged"] = train_run.merge_runs(v["runs"])
    text = train_run.markdown(data)
    assert "| off | ×0.92 (×0.83–×1.00) | n/a |" in text


def test_section_of_one_run_with_evaluations():
    run = _run(1, 2070.0, 8786120, 2.98e6, 29.0, 45.5, 33.5, evals=[[0, 0.203], [40, 0.729]])
    data = {"rounds": 1, "window": 5, "command": "c", "variants": [
        {"name": "make train", "spec": "", "malloc_settings": True, "runs": [run],
         "merged": train_run.merge_runs([run])}]}
    text = train_run.markdown(data)
    assert ("| make train | none (configs/default.yaml) | 5 | 34.5 | 60.0 | 5.00 / 6.00 / 33.5 / 45.5 "
            "| 8.38 | 2.98 | 0 |") in text
    assert "| make train | 0.300 → 0.700 | 5.00 / 7.00 | 0.203 (step 0) → 0.729 (step 40) | 20 |" in text
    assert "Against" not in text and "Every run" not in text


def test_report_renders_the_train_runs_and_their_malloc_settings(tmp_path):
    data = _ab_data()
    (tmp_path / "train_ab_malloc.json").write_text(json.dumps({**data, "markdown": train_run.markdown(data)}))
    text = report.render(tmp_path)
    assert "## Whole training runs (bench/train_run.py, `make bench-train`)" in text
    assert "### A/B" in text and ".venv/bin/python bench/train_run.py --rounds 2" in text
    assert "on and off (an A/B): train_ab_malloc" in text
    assert "_not run (no ppo_step.json)_" in text  # the other sections still say so


STUB = """#!{python}
# stands in for the interpreter running train.py: writes a metrics file into the output
# directory, the environment it was given, and touches {mib} MiB (a resident set to measure)
import json, os, sys
out = [a.split("=", 1)[1] for a in sys.argv if a.startswith("train.output_dir=")][0]
os.makedirs(out)
if os.environ.get("STUB_FAIL"):
    sys.exit("stub: failing as asked")
block = bytearray({mib} * 2**20)
for i in range(0, len(block), 4096):
    block[i] = 1
with open(os.path.join(out, "env.json"), "w") as f:
    json.dump({{"STUB_VALUE": os.environ.get("STUB_VALUE"), "argv": sys.argv[1:]}}, f)
with open(os.path.join(out, "metrics.jsonl"), "w") as f:
    for step, t in ((1, 9.0), (2, 3.0), (3, 5.0)):
        f.write(json.dumps({{"step": step, "time/step": t, "kl": 0.1 * step}}) + "\\n")
"""


def _stub(tmp_path, mib=200):
    stub = tmp_path / "stub_python"
    stub.write_text(STUB.format(python=sys.executable, mib=mib))
    stub.chmod(0o755)
    return str(stub)


def test_environment_reaches_the_child_and_its_memory_is_measured(tmp_path):
    out, work = tmp_path / "r.json", tmp_path / "w"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/train_run.py"), "--python", _stub(tmp_path),
         "--variant", "a", "STUB_VALUE=x=1 --set a.b=2", "--work-dir", str(work),
         "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads((work / "a_round1/env.json").read_text())
    assert seen["STUB_VALUE"] == "x=1"
    assert seen["argv"][1:] == ["--set", "a.b=2", "--set", f"train.output_dir={work}/a_round1"]
    data = json.loads(out.read_text())
    (run,) = data["variants"][0]["runs"]
    assert data["complete"] is True and data["variants"][0]["env"] == {"STUB_VALUE": "x=1"}
    assert run["steps"] == 3 and run["first_step"] == {"time/step": 9.0}
    assert run["median"] == {"time/step": 4.0}  # steps 2 and 3
    assert run["max_rss_kib"] >= 200 * 1024  # the 200 MiB the stub touched, from the kernel
    assert run["minor_faults"] >= 200 * 256  # one fault per 4 KiB page at least


def test_a_failing_run_keeps_what_was_measured_before_it(tmp_path):
    """The child's own error is shown under the variant's name, and the JSON keeps the runs
    before it (marked incomplete)."""
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/train_run.py"), "--python", _stub(tmp_path, 10),
         "--variant", "good", "", "--variant", "bad", "STUB_FAIL=1",
         "--work-dir", str(tmp_path / "w"), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "variant 'bad'" in proc.stderr
    assert "stub: failing as asked" in proc.stderr
    data = json.loads(out.read_text())
    assert data["complete"] is False
    assert [v["name"] for v in data["variants"]] == ["good"]
    assert data["variants"][0]["runs"][0]["steps"] == 3


def test_train_run_does_not_reexecute_under_the_malloc_settings():
    """Its children must start from its own environment: a variant with the settings off would
    otherwise inherit them (train.py re-executes itself; this script must not)."""
    tree = ast.parse((ROOT / "bench/train_run.py").read_text())
    called = {n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", None)
              for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert not called & {"under_malloc_settings", "reexec_with_malloc_settings"}


def test_temporary_run_directories_are_removed(tmp_path):
    """Without --work-dir the runs write under a temporary directory, and each run's directory
    (a default run's checkpoints take GBs) is gone once measured; --keep keeps them."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cmd = [sys.executable, str(ROOT / "bench/train_run.py"), "--python", _stub(tmp_path, 10),
           "--variant", "a", "", "--variant", "b", "", "--json", str(tmp_path / "r.json")]
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(tmp.iterdir()) == []
    proc = subprocess.run(cmd + ["--keep"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (kept,) = tmp.iterdir()
    assert sorted(p.name for p in kept.iterdir() if p.is_dir()) == ["a_round1", "b_round1"]
