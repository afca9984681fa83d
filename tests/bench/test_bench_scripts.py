"""The benchmark scripts' own logic: config overrides, timing in rounds, run records and
provenance, report tables.

Models run here only in the slow tests: `test_gpu_sh_dry_run` (`bench/gpu.sh --dry-run`: the PPO
step's two tiny workers and the engine bench on the CPU, about two minutes), one tiny ppo_jax
worker step (the code path of `bench/ppo_step.py`), `bench/core.py` and `bench/engine.py` at tiny
sizes, the shipped tokenizer against the converted SmolLM2's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # the benchmark scripts import each other by name


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ppo_step, report, core_bench = _load("ppo_step"), _load("report"), _load("core")
generate, harness = _load("generate"), _load("harness")


@pytest.mark.parametrize("mode", ["shared", "separate"])
def test_worker_overrides_are_a_valid_config(mode, tmp_path):
    from ppo_jax.trainer.config import load_config

    args = Namespace(batch=8, dtype="float32", remat="none", max_prompt_length=64, new_tokens=48,
                     epochs=4, warmup=1, steps=3, seed=0)
    cfg = load_config(None, ppo_step.jax_overrides(tmp_path, mode, args, str(tmp_path / "out")))
    assert cfg.model.shared_critic == (mode == "shared")
    assert cfg.generation.ignore_eos and cfg.generation.max_new_tokens == 48
    assert cfg.ppo.batch_size == cfg.ppo.mini_batch_size == cfg.ppo.micro_batch_size == 8
    assert cfg.ppo.kl_controller == "fixed" and cfg.ppo.kl_coef == 0.05 and cfg.ppo.vf_coef == 0.1
    assert cfg.optim.max_grad_norm == 1.0 and not cfg.data.shuffle
    assert cfg.data.prompt_buckets == 1  # no new width (a compile) inside a timed step
    assert not cfg.train.tensorboard and not cfg.train.export_hf and not cfg.train.progress


def test_shipped_tokenizer_unpacks(tmp_path):
    from ppo_jax.models import load_tokenizer

    tok = load_tokenizer(harness.unpack_tokenizer(tmp_path / "tok"))
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>" and tok.pad_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_shipped_tokenizer_is_the_converted_smollm2s():
    import hashlib

    from ppo_jax.models.packaged import ensure_packaged

    data = (ensure_packaged("smollm2") / "tokenizer.json").read_bytes()
    assert hashlib.sha256(data).hexdigest() == harness.TOKENIZER_SHA256


def test_random_model_has_the_shape_and_the_shipped_tokenizer(tmp_path, monkeypatch):
    """harness.random_model (bench/gpu.sh's weights): the named shape in bfloat16, SmolLM2's
    tokenizer and ids, tied embeddings; written once. The others come from configs/model_shapes/."""
    from ppo_jax.models import load_tokenizer
    from ppo_jax.models.hf_io import load_model_config as load_config

    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path))
    path = harness.random_model("tiny")
    cfg = load_config(path)
    assert path.parent == tmp_path and harness.random_model("tiny") == path
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads) == (64, 2, 2)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_tokenizer(path).eos_token_id == cfg.eos_token_ids[0]
    for shape in ("smollm2", "llama1b"):
        assert (ROOT / "configs/model_shapes" / harness.SHAPES[shape] / "config.json").is_file()


@pytest.mark.slow  # about 2 minutes: bench/gpu.sh end to end on the CPU
def test_gpu_sh_dry_run(tmp_path):
    """bench/gpu.sh --dry-run end to end on the CPU: bench/ppo_step.py (ppo_jax only, both
    critic layouts) and bench/engine.py on random bfloat16 weights of the tiny shape, then
    bench/report.py over their JSON."""
    out = tmp_path / "gpu"
    env = {**os.environ, "PPO_BENCH_PYTHON": sys.executable, "JAX_PLATFORMS": "cpu",
           "PPO_JAX_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(["bash", str(ROOT / "bench/gpu.sh"), "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    step = json.loads((out / "ppo_step.json").read_text())
    assert [r["config"] for r in step["results"]] == ["jax-shared", "jax-separate"]
    for r in step["results"]:
        assert r["model"] == "random-tiny" and r["dtype"] == "bfloat16" and r["gen_tokens"] == 8
    engine = json.loads((out / "engine.json").read_text())
    assert engine["workloads"]["heavy"]["random_stops"] == 8
    text = (out / "results.md").read_text()
    assert "## PPO step: ppo_jax vs TRL" in text and "paged / static" in text
    assert "_not run (no core.json)_" in text


def _result(config, t_gen, t_score, t_upd, tokens=400):
    st = lambda x: {"median": x, "min": x, "max": x, "n": 3}  # noqa: E731
    t_step = t_gen + t_score + t_upd
    return {"config": config, "label": config, "epochs": 1, "peak_rss_mib": 1000.0,
            "compile_s": None if config == "trl" else 1.0,
            "load_s": 1.0, "first_step_s": 2.0,
            "stats": {"time/generation": st(t_gen), "time/experience": st(t_score),
                      "time/update": st(t_upd), "time/step": st(t_step),
                      "tokens_per_s/generation": st(384 / t_gen),
                      "tokens_per_s/experience": st(tokens / t_score),
                      "tokens_per_s/update": st(tokens / t_upd),
                      "tokens_per_s/step": st(tokens / t_step)}}


def test_ppo_step_markdown_ratios():
    data = {"settings": {"model": "m", "dtype": "float32", "batch": 8, "new_tokens": 48,
                         "kl_coef": 0.05, "max_grad_norm": 1.0, "warmup": 1, "steps": 3},
            "results": [_result("jax-shared", 1.0, 1.0, 2.0), _result("trl", 2.0, 3.0, 8.0)]}
    text = ppo_step.markdown(data)
    ratios = text.split("TRL time / ours time")[1]
    # generation x2, experience x3, update x4, step 13/4
    assert "| jax-shared | ×2.00 | ×3.00 | ×4.00 | ×3.25 |" in ratios
    assert "tok/s" not in text and "tokens/s" not in text  # the time ratios say it
    assert text.index("| trl |") < text.index("| jax-shared |")  # TRL row first


def _spread_result(config, rnd, times, rss=1000.0):
    """A round's result whose measured step times (generation only varies) are `times`."""
    r = _result(config, sorted(times)[len(times) // 2], 1.0, 2.0)
    r["stats"]["time/generation"] = {"median": sorted(times)[len(times) // 2], "min": min(times),
                                     "max": max(times), "n": len(times)}
    return {**r, "round": rnd, "peak_rss_mib": rss, "load_s": 1.0 + rnd, "wall_s": 10.0}


def test_merge_rounds_takes_median_of_round_medians_and_extremes_of_steps():
    rounds = [_spread_result("jax-shared", 0, [1.0, 2.0, 9.0], rss=900.0),
              _spread_result("trl", 0, [4.0, 4.5, 5.0]),
              _spread_result("jax-shared", 1, [3.0, 3.0, 3.5], rss=950.0),
              _spread_result("jax-shared", 2, [0.5, 2.5, 2.6], rss=920.0)]
    merged = {r["config"]: r for r in ppo_step.merge_rounds(rounds)}
    ours = merged["jax-shared"]
    # round medians 2.0, 3.0, 2.5 -> 2.5; extremes over all 9 steps
    assert ours["stats"]["time/generation"] == {"median": 2.5, "min": 0.5, "max": 9.0, "n": 9}
    assert ours["rounds"] == 3 and "round" not in ours
    assert ours["peak_rss_mib"] == 950.0 and ours["load_s"] == 2.0 and ours["wall_s"] == 30.0
    assert ours["compile_s"] == 1.0 and "trl_ratio" not in ours  # TRL ran in one round only
    assert merged["trl"]["rounds"] == 1 and merged["trl"]["compile_s"] is None
    assert merged["trl"]["stats"]["time/generation"]["median"] == 4.5


def test_ppo_step_markdown_reports_per_round_ratio_spread():
    settings = {"model": "m", "dtype": "float32", "batch": 8, "new_tokens": 48, "kl_coef": 0.05,
                "max_grad_norm": 1.0, "warmup": 1, "steps": 3, "rounds": 3}
    rounds = []
    for rnd, (ours, trl) in enumerate([(2.0, 4.0), (4.0, 4.0), (1.0, 3.0)]):  # x2, x1, x3
        rounds += [_spread_result("trl", rnd, [trl]), _spread_result("jax-shared", rnd, [ours])]
    rounds.append(_spread_result("jax-separate", 0, [1.0]))  # one round only: no spread row
    merged = {r["config"]: r for r in ppo_step.merge_rounds(rounds)}
    assert merged["jax-shared"]["trl_ratio"]["time/generation"] == {
        "median": 2.0, "min": 1.0, "max": 3.0, "n": 3}  # x2, x1, x3
    assert "trl_ratio" not in merged["jax-separate"]
    data = {"settings": settings, "results": list(merged.values()), "rounds": rounds}
    text = ppo_step.markdown(data)
    assert "in each of 3 interleaved rounds" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| jax-shared, per round (3 rounds) |"))
    # generation: x2.00 (x1.00-x3.00); experience and update equal every round
    assert row.split(" | ")[1:4] == ["×2.00 (×1.00–×3.00)", "×1.00 (×1.00–×1.00)", "×1.00 (×1.00–×1.00)"]
    assert "| jax-separate, per round" not in text
    one = ppo_step.markdown({**data, "settings": {**settings, "rounds": 1},
                             "results": ppo_step.merge_rounds([r for r in rounds if r["round"] == 0])})
    assert "per round" not in one and "median (min–max)." in one


def test_report_renders_missing_sections(tmp_path):
    (tmp_path / "core.json").write_text(json.dumps({  # a file without a commit
        "batch": 4, "load_average": 0.5, "command": ".venv/bin/python bench/core.py", "markdown": "| x |"}))
    text = report.render(tmp_path)
    assert "## PPO math: ppo_jax.core vs TRL 0.11-style torch (bench/core.py)\n\n| x |" in text
    assert "_not run (no ppo_step.json)_" in text and "_not run (no generate.json)_" in text
    assert "_not run (no engine.json)_" in text and "no commit recorded for core" in text


@pytest.mark.slow
def test_jax_worker_runs_a_tiny_step(tiny_checkpoint):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/ppo_step.py"), "--worker", "jax", "--mode", "shared",
         "--model-dir", str(tiny_checkpoint), "--epochs", "1", "--batch", "2", "--new-tokens", "3",
         "--steps", "1", "--warmup", "1", "--max-prompt-length", "16"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith(harness.JSON_TAG))
    r = json.loads(line[len(harness.JSON_TAG):])
    assert r["gen_tokens"] == 6 and r["measured_steps"] == 1 and r["peak_rss_mib"] > 0
    assert r["compile_s"] == r["first_step_s"] - r["stats"]["time/step"]["median"]


def test_cpu_info_reads_model_and_instruction_sets():
    x86 = "processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu sse avx avx2 fma avx512f\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd sve\n"
    assert harness.cpu_info(x86)["model"] == "Intel Xeon"
    assert harness.cpu_info(x86)["isa"] == ["avx", "avx2", "fma", "avx512f"]
    assert harness.cpu_info(arm)["isa"] == ["asimd", "sve"]
    assert "avx512f" in harness.cpu_line(harness.cpu_info(x86))


# --------------------------------------------------------------------------- report sections


# --------------------------------------------------------------------------- bench/core.py timing
class FakeClock:
    """A clock that advances by `step` seconds per reading; `log` records the calls made."""

    def __init__(self, step: float = 1.0):
        self.t, self.step, self.log = 0.0, step, []

    def __call__(self) -> float:
        self.t += self.step
        return self.t

    def fn(self, name: str):
        return lambda: self.log.append(name)


def test_warm_runs_until_both_the_calls_and_the_seconds_are_reached():
    clock = FakeClock(step=1.0)  # every reading 1 s later: the k-th check sees k seconds passed
    assert harness.warm(clock.fn("f"), min_calls=2, min_s=0.0, clock=clock) == 2
    clock = FakeClock(step=1.0)
    assert harness.warm(clock.fn("f"), min_calls=1, min_s=3.5, clock=clock) == 4
    assert clock.log == ["f"] * 4


def test_interleaved_warms_each_block_right_before_it_and_alternates_sides():
    clock = FakeClock(step=0.5)
    fns = {"ours": clock.fn("ours"), "torch": clock.fn("torch")}
    blocks = harness.interleaved(fns, rounds=2, block={"ours": 3, "torch": 1}, warmup_calls=2,
                                    warmup_s=0.0, clock=clock)
    ours, torch_ = ["ours"] * (2 + 3), ["torch"] * (2 + 1)  # warm-up calls, then the timed block
    assert clock.log == ours + torch_ + torch_ + ours  # the order reversed in the second round
    assert [len(b) for b in blocks["ours"]] == [3, 3] and [len(b) for b in blocks["torch"]] == [1, 1]
    assert all(t == 0.5 for b in blocks["ours"] for t in b)  # one clock step, in seconds


def test_compare_quotes_ratio_of_minima_and_per_round_ratios():
    torch_blocks = [[10.0, 12.0, 30.0], [20.0, 8.0, 40.0]]  # block medians 12, 20; min 8
    ours_blocks = [[1.0, 2.0, 3.0], [4.0, 5.0, 2.0]]        # block medians 2, 4; min 1
    c = harness.compare(torch_blocks, ours_blocks)
    assert c["ratio_of_minima"] == pytest.approx(8.0)
    assert c["ratio_of_medians"] == pytest.approx(16.0 / 2.5)  # medians of all six calls
    assert c["paired_ratio"] == {"median": 5.5, "min": 5.0, "max": 6.0, "n": 2}  # 12/2, 20/4
    assert core_bench.side_figures(ours_blocks) == {"median": 2500.0, "min": 1000.0, "max": 5000.0,
                                                    "n": 6}  # seconds in, ms out


CORE = {
    "bench": "core", "batch": 4, "length": 8, "rounds": 2, "torch_block": 3, "jax_block": 3,
    "warmup_calls": 1, "warmup_s": 0.1, "gae": "scan",
    "torch": {"median": 16.0, "min": 8.0},
    "jax": {"median": 2.5, "min": 1.0, "compile_s": 0.3, "ratio_of_medians": 6.4, "ratio_of_minima": 8.0,
            "paired_ratio": {"median": 5.5, "min": 5.0, "max": 6.0, "n": 2}},
    "commit": "abc1234", "dirty": False,
    "wall_s": 90.0, "load_average": 0.5, "command": ".venv/bin/python bench/core.py",
}


def test_core_section_shows_minima_and_per_round_ratios_with_their_spread():
    text = core_bench.markdown(CORE)
    assert ("| ppo_jax.core, jax jit (GAE: scan, the default) | 2.500 (1.000) | ×6.4 | ×8.0 | "
            "×5.5 (×5.0–×6.0, 2 rounds) | 0.30 |") in text
    assert "| torch, TRL 0.11 style | 16.000 (8.000) | ×1.0 | ×1.0 | — | — |" in text
    assert "2 interleaved rounds" in text and "blocks of 3 (JAX) and 3 (torch)" in text


# --------------------------------------------------------------------------- commits
def _git(repo, *args):
    subprocess.run(["git", "-c", "user.email=b@x", "-c", "user.name=b", *args], cwd=repo,
                   check=True, capture_output=True)


def test_git_state_reads_the_commit_and_whether_tracked_files_changed(tmp_path, monkeypatch):
    _git(tmp_path, "init", "-q")
    (tmp_path / "bench").mkdir()
    for name in ("a.py", "bench/results.md"):
        (tmp_path / name).write_text("x\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "c")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, text=True,
                          capture_output=True, check=True).stdout.strip()
    assert harness.git_state(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "new.py").write_text("untracked\n")  # untracked: not dirty
    (tmp_path / "bench/results.md").write_text("regenerated\n")  # generated: not dirty
    assert harness.git_state(tmp_path)["dirty"] is False
    (tmp_path / "a.py").write_text("changed\n")
    assert harness.git_state(tmp_path) == {"commit": head, "dirty": True}
    monkeypatch.setenv("PPO_BENCH_COMMIT", "feed123")  # a copied tree without .git
    assert harness.git_state(tmp_path / "bench")["commit"] == head  # still inside the checkout
    outside = tmp_path.parent / f"{tmp_path.name}-nogit"
    outside.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert harness.git_state(outside) == {"commit": "feed123", "dirty": None}


def test_run_record_carries_commit_dirty_and_wall_time():
    r = harness.run_record()
    assert set(r) == {"date", "commit", "dirty", "cpu", "load_average", "wall_s", "malloc_settings"}
    assert r["cpu"] == harness.cpu_info()
    assert r["wall_s"] is None or r["wall_s"] > 0
    from ppo_jax.trainer.host.memory import MALLOC_SETTINGS

    assert r["malloc_settings"] == all(k in os.environ for k in MALLOC_SETTINGS)


def test_report_says_which_benchmarks_ran_under_the_malloc_settings():
    raws = {"core": {"malloc_settings": True}, "generate": {"malloc_settings": False},
            "engine": {"commit": "abc"}, "train_run": None,
            "ppo_step": {"malloc_settings": False,  # the parent; its workers' flags decide
                         "results": [{"malloc_settings": True}, {"malloc_settings": True}]},
            "train_ab": {"results": [{"malloc_settings": True}, {}]}}
    line = report.malloc_line(raws)
    assert line.endswith("in each benchmark's processes: on: core, ppo_step; off: generate; "
                         "not recorded: engine, train_ab")


def test_provenance_one_commit_no_warning():
    lines = report.provenance_lines({"core": CORE, "generate": {**CORE, "commit": "abc1234"},
                                     "ppo_step": None})
    assert lines == ["Code: commit `abc1234` (every raw file)."]


def test_provenance_warns_on_dirty_trees_and_missing_commits_and_refuses_unknown_mixes():
    engine_json = {"commit": "abc1234" + "0" * 33, "dirty": True}  # a full hash is the same commit
    lines = report.provenance_lines({"core": CORE, "ppo_step": {"results": []}, "engine": engine_json})
    text = "\n".join(lines)
    assert lines[0].startswith("Code: core `abc1234`, ppo_step not recorded, engine `abc1234")
    assert "dirty tree" in text and "): engine;" in text
    assert "no commit recorded for ppo_step" in text
    clean = report.provenance_lines({"core": CORE, "engine": {"commit": "abc1234"}})
    assert clean == ["Code: commit `abc1234` (every raw file)."]
    mixed = report.provenance_lines({"core": CORE, "generate": {**CORE, "commit": "def5678"}})
    assert mixed == ["Code: core `abc1234`, generate `def5678`.",
                     "> **Warning:** the raw files come from 2 commits (the code measured may differ): "
                     "do not compare their figures as one run."]


XEON = {"model": "Intel Xeon", "cores": 2, "isa": ["avx2", "avx512f"]}
EPYC = {"model": "AMD EPYC", "cores": 2, "isa": ["avx2"]}


def test_report_names_the_recorded_cpu_not_the_report_machine():
    raws = {"core": {"cpu": XEON}, "generate": {"cpu": XEON}, "engine": None}
    assert report.recorded_cpus(raws) == ["Intel Xeon, 2 logical cores; avx2 avx512f"]
    assert report.machine_lines(raws)[0] == ("- CPU (recorded by the benchmarks): Intel Xeon, 2 logical "
                                             "cores; avx2 avx512f")
    assert report.provenance_lines(raws) == [
        "Code: core not recorded, generate not recorded.",
        "> **Warning:** no commit recorded for core, generate (a tree outside git without "
        "$PPO_BENCH_COMMIT): which code these figures came from is unknown."]


def test_report_warns_on_several_cpus():
    raws = {"core": {"cpu": XEON, "commit": "abc"}, "generate": {"cpu": EPYC, "commit": "abc"}}
    assert report.provenance_lines(raws) == [
        "Code: commit `abc` (every raw file).",
        "> **Warning:** the raw files come from 2 CPUs (not one machine): do not compare their figures as one run."]
    assert "Intel Xeon, 2 logical cores; avx2 avx512f; AMD EPYC" in report.machine_lines(raws)[0]


def test_report_header_names_the_commit_and_the_wall_times(tmp_path):
    (tmp_path / "core.json").write_text(json.dumps({**CORE, "dirty": True}))
    text = report.render(tmp_path)
    assert "Code: commit `abc1234` (every raw file)." in text
    assert "**Warning:** measured on a dirty tree" in text and "): core;" in text
    assert "wall time of each benchmark (its whole process): core 1.5 min; 1.5 min in all" in text


def test_report_reproduce_line_names_a_non_default_out(tmp_path):
    (tmp_path / "core.json").write_text(json.dumps(CORE))
    assert f"bench/report.py {tmp_path}\n" in report.render(tmp_path)
    assert f"bench/report.py {tmp_path}\n" in report.render(tmp_path, ROOT / "bench/results.md")
    text = report.render(tmp_path, ROOT / "bench/results_other.md")
    assert f"bench/report.py {tmp_path} --out bench/results_other.md\n" in text


# --------------------------------------------------------------------------- generate / ppo_step
def test_generate_section_gives_both_samplers_and_the_ratio():
    st = lambda x: {"median": x, "min": x, "max": x, "n": 3}  # noqa: E731
    data = {"model": "m", "batch": 8, "prompt_width": 47, "new_tokens": 64, "runs": 3,
            "ppo_jax": {"tokens_per_s": st(140.0), "seconds": st(3.7), "first_call_s": 4.4},
            "transformers": {"tokens_per_s": st(85.0), "seconds": st(6.0), "first_call_s": 6.1,
                             "torch_threads": 2},
            "ratio": 140 / 85, "paired_ratio": st(1.6), "compile_s": 3.2, "identical_rows": 8}
    text = generate.markdown(data)
    assert "| ppo_jax jitted KV-cache sampler | 140 | 3.700 | 4.40 | — |" in text
    assert ("| transformers `generate` (PyTorch CPU, 2 threads) | 85.0 | 6.000 | 6.10 | "
            "×1.65 (paired runs ×1.60–×1.60) |") in text
    assert "compile (first call minus the median): 3.2 s; greedy rows identical token for token: 8/8." in text


def test_ppo_step_section_puts_first_step_beside_the_steady_median_and_counts_columns():
    data = {"settings": {"model": "m", "dtype": "float32", "batch": 8, "new_tokens": 48,
                         "kl_coef": 0.05, "max_grad_norm": 1.0, "warmup": 1, "steps": 3},
            "results": [_result("jax-shared", 1.0, 1.0, 2.0), _result("trl", 2.0, 3.0, 8.0)]}
    ours, trl = data["results"]
    ours.update(seq_tokens_mean=400.0, padded_seq_len_mean=55.0)
    trl.update(seq_tokens_mean=400.0, padded_seq_len_mean=50.0, first_step_s=17.9)
    text = ppo_step.markdown(data)
    # phases, then load, first step, compile, peak RSS
    assert "| trl | 2.00 | 3.00 | 8.00 | 13.0 | 1.00 | 17.9 | none (eager) | 1,000 |" in text
    assert "| jax-shared | 1.00 | 1.00 | 2.00 | 4.00 | 1.00 | 2.00 | 1.00 | 1,000 |" in text
    assert "| jax-shared | 400 | 55.0 | 440 | 10.0% |" in text  # 8 x 55 columns vs 400 tokens
    assert "| trl | 400 | 50.0 | 400 | 0.0% |" in text


def test_ppo_step_record_counts_real_tokens_alike_on_both_sides():
    """bench/harness.py `ppo_step_record`, shared by ppo_step.py and ppo_step_trl.py: 8 rows x 4
    new tokens, 100 real prompt tokens, 2 epochs; tokens/s of each phase by hand."""
    times = {"time/generation": 2.0, "time/experience": 3.3, "time/update": 6.6, "time/step": 11.0}
    r = harness.ppo_step_record(times, 32, 100, 2, padded_seq_len=20)
    assert (r["seq_tokens"], r["prompt_tokens"], r["padded_seq_len"]) == (132, 100, 20)
    assert r["tokens_per_s/generation"] == 16.0 and r["tokens_per_s/step"] == 12.0
    assert r["tokens_per_s/experience"] == pytest.approx(40.0)
    assert r["tokens_per_s/update"] == pytest.approx(40.0)  # 2 epochs x 132 tokens / 6.6 s
    s = harness.ppo_step_summary([{**r, "time/step": 20.0}, r, {**r, "time/step": 13.0, "seq_tokens": 134}], 1)
    assert s["seq_tokens_mean"] == 133 and s["stats"]["time/step"]["median"] == 12.0
    assert (s["warmup_steps"], s["measured_steps"], s["first_step_s"], s["compile_s"]) == (1, 2, 20.0, 8.0)
    assert s["peak_rss_mib"] > 0


def test_finish_prints_the_table_under_the_cpu_and_commit_and_writes_it(tmp_path, capsys):
    data = harness.finish({"x": 2.0}, lambda d: f"| x | {d['x']} |", tmp_path / "b.json")
    written = json.loads((tmp_path / "b.json").read_text())
    assert written["markdown"] == data["markdown"] == capsys.readouterr().out.strip()
    first, table_ = data["markdown"].split("\n\n")
    assert first.startswith(f"Measured {data['date']} on {harness.cpu_line(harness.cpu_info())}")
    assert f"commit `{data['commit']}`" in first and table_ == "| x | 2.0 |"


@pytest.mark.slow
def test_core_writes_json_report_reads(tmp_path):
    """bench/core.py (tiny sizes) end to end: its JSON carries the commit and the figures, and
    bench/report.py turns it into its section."""
    cmd = [sys.executable, str(ROOT / "bench/core.py"), "--batch", "4", "--length", "16",
           "--rounds", "2", "--torch-block", "1", "--jax-block", "2", "--warmup-s", "0", "--json",
           str(tmp_path / "core.json")]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    core = json.loads((tmp_path / "core.json").read_text())
    assert core["commit"] and core["jax"]["paired_ratio"]["n"] == 2
    text = report.render(tmp_path)
    assert f"`{core['commit']}`" in text and "per-round ratios" in text


@pytest.mark.slow
def test_engine_bench_runs_on_the_tiny_model(tmp_path):
    """bench/engine.py --tiny (random weights of the tiny shape): both sides draw the same tokens
    (the script checks it) and the table holds each workload's ratio."""
    out = tmp_path / "engine.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench/engine.py"), "--tiny", "--rounds", "1",
                           "--responses", "16", "--rows", "4", "--slots", "4", "8", "--new-tokens", "24",
                           "--workload", "heavy", "default", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PPO_JAX_MALLOC_TUNING": "0", "PPO_JAX_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    heavy = data["workloads"]["heavy"]
    assert heavy["batch"] == 16 and heavy["useful_tokens"] > 0
    assert {e["slots"] for e in heavy["engines"].values()} == {4, 8}
    assert heavy["engines"]["paged 4"]["steps"] >= heavy["useful_tokens"] // 4 / 2
    assert "paged / static" in data["markdown"]
