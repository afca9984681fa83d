"""scripts/compare_accuracy.py: held-out accuracy of two actors from a run's config."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

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
    assert "held-out accuracy over 4 problems and 2 seeds" in capsys.readouterr().out
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


def test_a_base_other_than_the_configs_actor_is_refused_by_name(tiny_checkpoint, capsys):
    """configs/rlvr/tiny.yaml starts from tiny-random: SmolLM2 (the old default) or another
    directory as --base is refused before any model loads, naming both."""
    script = _script()
    for base in ("smollm2", str(tiny_checkpoint)):
        code = script.main(["--base", base, "--config", str(ROOT / "configs/rlvr/tiny.yaml"),
                            "--seeds", "0"])
        err = capsys.readouterr().err
        assert code == 2 and f"--base {base!r}" in err and "model.actor 'tiny-random'" in err
