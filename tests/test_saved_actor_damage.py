"""`python -m ppo_jax.generate` and `python -m ppo_jax.evaluate` on a damaged checkpoint (issue 54):
a missing, truncated or damaged file is named as damage, as `train.py --resume` names it (the
step, the file, the cause), with the config the step trained under and the earlier checkpoints,
in one `error:` line, exit 2; a checkpoint that reads but does not fit its config still says it
does not fit, naming that config.

One tiny run is made once: steps 1-2 under config.json, then resumed with `--set
train.steps=3`, so step 3 trains under config.resume-2.json; each test damages a copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.test_generate_cli import TINY, no_loading, train_tiny  # noqa: F401  (the shared fixture)


@pytest.fixture(scope="module")
def run(cache, tmp_path_factory) -> Path:
    """Checkpoints 1 and 2 (config.json) and 3 (config.resume-2.json), resumed as train.py
    `--resume --set train.steps=3` resumes."""
    from ppo_jax.trainer.lifecycle.checkpoint import finished_steps
    from ppo_jax.trainer.lifecycle.resume import resume_config
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    out = train_tiny(tmp_path_factory.mktemp("damage") / "run", "train.save_every=1",
                     "train.max_to_keep=3", "eval.every=0")
    cfg, plan = resume_config(str(TINY), [f"train.output_dir={out}", "train.steps=3"], True,
                              explicit=False)
    PPOTrainer(cfg, resume=plan).train(progress=False)
    assert finished_steps(out / "checkpoints") == [1, 2, 3]
    assert sorted(p.name for p in out.glob("config*.json")) == ["config.json",
                                                                "config.resume-2.json"]
    return out


@pytest.fixture
def copy(run, tmp_path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(run, out)
    return out


def data_file(run: Path, step: int) -> Path:
    """The largest array data file of checkpoint `step`."""
    return max((run / f"checkpoints/{step}/state").rglob("d/*"), key=lambda p: p.stat().st_size)


def error_line(capsys, command: str, *argv: str) -> str:
    """The one `error:` line of `python -m ppo_jax.<command> argv` (which must exit 2)."""
    module = __import__(f"ppo_jax.{command}", fromlist=["main"])
    capsys.readouterr()
    extra = ["--prompt", "hi"] if command == "generate" else []
    assert module.main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("command", ["generate", "evaluate"])
def test_a_truncated_array_file_is_named_as_damage_not_as_a_mismatch(copy, capsys, command):
    data = data_file(copy, 2)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    line = error_line(capsys, command, "--run", str(copy), "--step", "2")
    assert line.startswith(f"error: checkpoint of step 2 cannot be read: {data}: OUT_OF_RANGE: ")
    assert "the file is shorter than its index says: truncated" in line
    assert line.endswith(f"; the step trained under {copy / 'config.json'}; earlier checkpoints: "
                         "steps [1] (give one with --step 1)")
    assert "does not fit" not in line


@pytest.mark.parametrize("command", ["generate", "evaluate"])
def test_damage_of_a_resumed_step_names_the_config_it_trained_under(copy, capsys, command):
    """A deleted data file of step 3 (the latest; no --step): tensorstore names no file, so the
    checkpoint's `state` folder is named, as `train.py --resume` names it."""
    data_file(copy, 3).unlink()
    line = error_line(capsys, command, "--run", str(copy))
    assert line.startswith(f"error: checkpoint of step 3 cannot be read: "
                           f"{copy / 'checkpoints/3/state'}: ")
    assert line.endswith(f"; the step trained under {copy / 'config.resume-2.json'}; earlier "
                         "checkpoints: steps [2, 1] (give one with --step 2)")
    assert "does not fit" not in line


@pytest.mark.parametrize("command", ["generate", "evaluate"])
def test_a_missing_metadata_file_is_named_before_any_model_loads(copy, capsys, no_loading,
                                                                  command):
    (copy / "checkpoints/3/meta/metadata").unlink()
    assert error_line(capsys, command, "--run", str(copy)) == (
        f"error: checkpoint of step 3 cannot be read: {copy / 'checkpoints/3/meta/metadata'}: "
        f"missing; the step trained under {copy / 'config.resume-2.json'}; earlier checkpoints: "
        "steps [2, 1] (give one with --step 2)")


def test_a_checkpoint_that_reads_but_does_not_fit_its_config_still_says_so(run, copy, capsys):
    """generate: `--set model.lora.rank=4` on a run without LoRA; evaluate (which takes eval.*
    keys only): a resumed config that differs from the checkpoint's train state."""
    line = error_line(capsys, "generate", "--run", str(run), "--step", "2", "--set",
                      "model.lora.rank=4")
    assert line.startswith(f"error: checkpoint {run / 'checkpoints/2'} does not fit the train "
                           f"state of {run / 'config.json'} (the config step 2 trained under")
    assert "cannot be read" not in line
    resumed = copy / "config.resume-2.json"
    changed = json.loads(resumed.read_text())
    changed["model"]["lora"]["rank"] = 4
    resumed.write_text(json.dumps(changed))
    line = error_line(capsys, "evaluate", "--run", str(copy))
    assert line.startswith(f"error: checkpoint {copy / 'checkpoints/3'} does not fit the train "
                           f"state of {resumed} (the config step 3 trained under")
    assert "cannot be read" not in line
