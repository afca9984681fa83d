"""scripts/rlvr_recipes_report.py: the recipe table of results/rlvr/log.md re-read from kept metrics."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("rlvr_recipes_report",
                                                  ROOT / "scripts/rlvr_recipes_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _accuracy(free_base, free, plain_base, plain):
    def fig(b, t):
        return {"mean_base": b, "mean_trained": t}
    return {"figures": {"accuracy": fig(0.0, free), "accuracy_format_free": fig(free_base, free),
                        "accuracy_plain": fig(plain_base, plain)}}


def _write(folder: Path, name: str, seed: int, rows: list[dict], accuracy: dict) -> None:
    (folder / f"{name}_seed{seed}.metrics.jsonl").write_text(
        "\n".join(json.dumps(r) for r in rows) + "\n")
    (folder / f"{name}_seed{seed}.accuracy.json").write_text(json.dumps(accuracy))


def _rows(step_times, lengths, ev=None):
    rows = [{"step": 0, "eval/accuracy_format_free": 0.1, "time/eval": 60.0}]
    for i, (t, n) in enumerate(zip(step_times, lengths), start=1):
        rows.append({"step": i, "time/step": t, "kl": float(i), "entropy_per_token": 0.5,
                     "response_length": n, "ended_fraction": 1.0,
                     **({} if ev is None else {"values_explained_variance": ev[i - 1],
                                                "group_baseline_explained_variance": -0.1})})
    rows[-1].update({"eval/accuracy_format_free": 0.5, "time/eval": 60.0})
    return rows


def test_table_means_and_plot_from_kept_files(tmp_path, capsys):
    """Two seeds of one recipe, one of another, one pair missing (skipped, named). Hand figures:
    median step of steps 2-6 (step 1 compiles) [30, 50, 40, 60, 45] is 45; KL over the last
    5 steps 2..6 is 4.0; the critic's EV median over [0.1, 0.3, 0.2, 0.4, 0.0, 0.5] is 0.25;
    the recipe means over seeds 0.4 / 0.6 -> 0.5, rise 0.5 - 0.05."""
    script = _script()
    steps, lengths = [100, 30, 50, 40, 60, 45], [9, 8, 7, 6, 5, 4]
    _write(tmp_path, "ppo", 0, _rows(steps, lengths, ev=[0.1, 0.3, 0.2, 0.4, 0.0, 0.5]),
           _accuracy(0.05, 0.4, 0.08, 0.2))
    _write(tmp_path, "ppo", 1, _rows(steps, lengths, ev=[0.1, 0.3, 0.2, 0.4, 0.0, 0.5]),
           _accuracy(0.05, 0.6, 0.08, 0.3))
    _write(tmp_path, "dapo", 0, _rows(steps, lengths), _accuracy(0.05, 0.7, 0.08, 0.4))
    out = tmp_path / "plot.png"
    assert script.main(["--names", "ppo", "dapo", "--seeds", "0", "1", "--dir", str(tmp_path),
                        "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "no dapo_seed1" in printed.err
    lines = printed.out.splitlines()
    ppo0 = next(line for line in lines if line.startswith("| ppo | 0 |"))
    cells = [c.strip() for c in ppo0.strip("|").split("|")]
    assert cells[2:6] == ["6", "45.0", "0.100 -> 0.500", "0.400"]
    assert cells[8] == "4.0" and cells[10] == "6.0"  # KL, length: means of steps 2-6
    assert cells[-1] == "0.25 (-0.10)"
    assert next(line for line in lines if line.startswith("| dapo | 0 |")).endswith("| - |")
    assert "| ppo | 0, 1 | 0.500 (+0.450) | 0.250 (+0.170) |" in lines
    assert out.stat().st_size > 10_000
    assert script.minutes(_rows(steps, lengths)) == [(1.0, 0.1), (sum(steps) / 60 + 2.0, 0.5)]


def test_no_run_found_is_an_error(tmp_path, capsys):
    assert _script().main(["--dir", str(tmp_path)]) == 2
    assert "no run found" in capsys.readouterr().err
