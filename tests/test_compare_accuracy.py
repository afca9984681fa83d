"""scripts/compare_accuracy.py: held-out accuracy of two actors from a run's config."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ppo_jax.trainer.config import load_config
from ppo_jax.trainer.data.tasks import PLAIN_INSTRUCTION

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("compare_accuracy", ROOT / "scripts/compare_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_same_actor_twice_has_zero_rise_on_every_seed(tiny_checkpoint, tmp_path, capsys):
    script = _script()
    out = tmp_path / "acc.json"
    assert script.main([str(tiny_checkpoint), "--set", f"model.actor={tiny_checkpoint}", "--config",
                        str(ROOT / "configs/rlvr/tiny.yaml"), "--seeds", "0", "1",
                        "--num-prompts", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["seed"] for r in result["per_seed"]] == [0, 1] and result["num_prompts"] == 4
    assert result["base"] == str(tiny_checkpoint)  # the config's model.actor
    assert all(r["before"] == r["after"] and r["rise"] == 0 for r in result["per_seed"])
    printed = capsys.readouterr().out
    assert "held-out accuracy over 4 problems and 2 seeds" in printed
    # the figures format cannot inflate, per seed for both actors, and a table of their means
    assert result["plain_instruction"] == PLAIN_INSTRUCTION
    for name in ("accuracy", "format", "accuracy_format_free", "accuracy_plain"):
        fig = result["figures"][name]
        assert len(fig["base"]) == 2 and fig["base"] == fig["trained"] and fig["mean_rise"] == 0
        assert all(0.0 <= x <= 1.0 for x in fig["base"])
    assert result["figures"]["accuracy"]["base"] == [r["before"] for r in result["per_seed"]]
    for title in script.FIGURES.values():
        assert title in printed
    assert f"(plain instruction: {PLAIN_INSTRUCTION!r}" in printed
    shown = [line for line in printed.splitlines() if line.startswith("  plain instruction, ")]
    assert len(shown) == 4  # --show 2: base and trained, here the same actor twice
    assert shown[0].split(":", 1)[1].strip() == shown[1].split(":", 1)[1].strip()
    fig = script.figures([0, 1], [0.1, 0.3], [0.5, 0.4])
    assert [r["rise"] for r in fig["per_seed"]] == pytest.approx([0.4, 0.1])
    assert (fig["mean_before"], fig["mean_after"], fig["mean_rise"]) == pytest.approx((0.2, 0.45, 0.25))
    assert (fig["min_rise"], fig["max_rise"]) == pytest.approx((0.1, 0.4))


def test_a_reward_without_accuracy_is_an_error(tiny_checkpoint, capsys):
    script = _script()
    code = script.main([str(tiny_checkpoint), "--set", f"model.actor={tiny_checkpoint}", "--config",
                        str(ROOT / "configs/tiny.yaml"), "--seeds", "0"])
    assert code == 2 and "reports no accuracy" in capsys.readouterr().err


def test_without_a_trained_actor_the_base_alone_is_measured_with_overrides(tiny_checkpoint, tmp_path):
    script = _script()
    out = tmp_path / "base.json"
    sets = ["--set", f"model.actor={tiny_checkpoint}", "--set", "eval.num_prompts=2"]
    assert script.main(["--base", str(tiny_checkpoint), "--config",
                        str(ROOT / "configs/rlvr/tiny.yaml"), "--seeds", "3", *sets,
                        "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 2 and result["seeds"] == [3] and len(result["accuracy"]) == 1
    assert result["overrides"] == sets[1::2] and result["base"] == str(tiny_checkpoint)
    figures = result["figures"]
    assert set(figures) == {"accuracy", "format", "accuracy_format_free", "accuracy_plain"}
    assert figures["accuracy"]["base"] == result["accuracy"] and "mean_rise" not in figures["format"]
    assert len(figures["accuracy_plain"]["base"]) == 1


def test_the_figure_table_holds_every_figure_and_marks_the_missing_ones():
    script = _script()
    base = [{"accuracy": 0.0, "format": 0.8, "accuracy_format_free": 0.5, "accuracy_plain": None},
            {"accuracy": 0.1, "format": 0.9, "accuracy_format_free": 0.3, "accuracy_plain": None}]
    trained = [{"accuracy": 0.8, "format": 1.0, "accuracy_format_free": 0.7, "accuracy_plain": 0.4},
               {"accuracy": 0.9, "format": 1.0, "accuracy_format_free": 0.9, "accuracy_plain": 0.6}]
    table = script.figure_means({"base": base, "trained": trained})
    assert table["format"]["base"] == [0.8, 0.9]
    assert (table["format"]["mean_base"], table["format"]["mean_trained"],
            table["format"]["mean_rise"]) == pytest.approx((0.85, 1.0, 0.15))
    assert table["accuracy_format_free"]["mean_rise"] == pytest.approx(0.4)
    assert table["accuracy_plain"]["mean_base"] is None and table["accuracy_plain"]["mean_rise"] is None
    assert table["accuracy_plain"]["mean_trained"] == pytest.approx(0.5)
    lines = script.figure_table(table, ["base", "trained"]).splitlines()
    assert lines[0].split()[-3:] == ["base", "trained", "rise"]
    row = dict(zip(script.FIGURES, lines[1:]))
    assert row["format"].split()[-3:] == ["0.850", "1.000", "+0.150"]
    assert row["accuracy_plain"].split()[-3:] == ["n/a", "0.500", "n/a"]


def test_the_plain_pass_re_asks_task_problems_only():
    """A prompt file's instruction is part of its text: no plain pass (its figure null)."""
    script = _script()
    cfg = load_config(ROOT / "configs/rlvr/tiny.yaml")
    plain = script.plain_config(cfg)
    assert plain.data.task.instruction == PLAIN_INSTRUCTION and plain.data.response_prefix is None
    custom = load_config(ROOT / "configs/rlvr/tiny.yaml", ["eval.plain_instruction=Say a number."])
    assert script.plain_config(custom).data.task.instruction == "Say a number."
    assert script.plain_config(load_config(ROOT / "configs/tiny.yaml")) is None


def test_a_base_other_than_the_configs_actor_is_refused_by_name(tiny_checkpoint, capsys):
    """configs/rlvr/tiny.yaml starts from tiny-random: SmolLM2 (the old default) or another
    directory as --base is refused before any model loads, naming both."""
    script = _script()
    for base in ("smollm2", str(tiny_checkpoint)):
        code = script.main(["--base", base, "--config", str(ROOT / "configs/rlvr/tiny.yaml"),
                            "--seeds", "0"])
        err = capsys.readouterr().err
        assert code == 2 and f"--base {base!r}" in err and "model.actor 'tiny-random'" in err


def test_the_json_names_a_model_under_the_working_directory_by_its_relative_path(tmp_path,
                                                                               monkeypatch):
    shown_path = _script().shown_path
    (tmp_path / ".cache/model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert shown_path(tmp_path / ".cache/model") == ".cache/model"
    assert shown_path("/elsewhere/model") == "/elsewhere/model"  # outside: as given
