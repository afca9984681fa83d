"""The config a run's actor trained under, as `python -m ppo_jax.generate` and
`python -m ppo_jax.evaluate` read it (`saved_actor.run_config_at`): a `config.resume-<k>.json`
(a resume from checkpoint k with changed settings) applies from step k + 1, so steps 0..k read
`config.json`; an exported actor (`actor_hf`) reads the config of the run's last step. The
run directories here are made by hand (config files and empty checkpoint folders): nothing
trains and no model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def write_run(out: Path, resumed_at: int = 4, steps=(1, 2, 3, 4, 5, 6)) -> Path:
    """A run started under tiny.yaml (generation.top_k 0) and resumed from checkpoint
    `resumed_at` with generation.top_k=1 and train.steps=7; its finished checkpoints `steps`;
    an actor_hf beside them."""
    from ppo_jax.trainer.lifecycle.checkpoint import JSON_FILES
    from ppo_jax.trainer.config import load_config, to_dict

    first = to_dict(load_config(ROOT / "configs/tiny.yaml", [f"train.output_dir={out}"]))
    assert first["generation"]["top_k"] == 0
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(first))
    changed = json.loads(json.dumps(first))
    changed["train"]["steps"], changed["generation"]["top_k"] = 7, 1
    (out / f"config.resume-{resumed_at}.json").write_text(json.dumps(changed))
    for step in steps:  # the metadata files generate / evaluate check before loading
        for name in JSON_FILES:
            (out / "checkpoints" / str(step) / name).parent.mkdir(parents=True, exist_ok=True)
            (out / "checkpoints" / str(step) / name).write_text("{}")
    actor = out / "actor_hf"
    actor.mkdir()
    (actor / "config.json").write_text("{}")
    (actor / "model.safetensors").write_bytes(b"")
    return out


def test_a_resume_config_applies_from_the_step_after_its_checkpoint(tmp_path):
    from ppo_jax.saved_actor import read_run_config, run_config_at

    run = write_run(tmp_path / "run")
    for step in (0, 1, 4):  # step 4 trained under config.json; the resume began at step 5
        assert run_config_at(run, step) == run / "config.json", step
        assert read_run_config(run, step=step).generation.top_k == 0
    for step in (5, 6):
        assert run_config_at(run, step) == run / "config.resume-4.json", step
    assert read_run_config(run, step=5).train.steps == 7
    assert read_run_config(run).generation.top_k == 1  # no step: the last (checkpoint 6)
    assert read_run_config(run, ["train.steps=9"]).train.steps == 9


def test_an_exported_actor_reads_the_config_of_the_runs_last_step(tmp_path):
    """Resumed from 4 with changes but stopped before step 5 was saved: actor_hf is still the
    export of step 4, trained under config.json."""
    from ppo_jax.saved_actor import run_config_at

    run = write_run(tmp_path / "run", steps=(3, 4))
    assert run_config_at(run) == run / "config.json"
    bare = tmp_path / "bare"  # no checkpoint at all: the newest config
    write_run(bare, steps=())
    assert run_config_at(bare) == bare / "config.resume-4.json"


def test_a_fresh_starts_config_resume_0_of_older_runs_applies_from_step_0(tmp_path):
    from ppo_jax.trainer.lifecycle.run_dir import config_in_effect, config_of_step

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "config.resume-0.json").write_text("{}")
    (tmp_path / "config.resume-3.json").write_text("{}")
    assert [config_of_step(tmp_path, s).name for s in (0, 1, 3, 4)] == \
        ["config.resume-0.json", "config.resume-0.json", "config.resume-0.json",
         "config.resume-3.json"]
    assert config_in_effect(tmp_path, 3).name == "config.resume-3.json"  # a resume's base


@pytest.fixture
def stop_before_loading(monkeypatch):
    """generate's and evaluate's model loads replaced by a ConfigError that names the step and
    the top_k of the config they were given (so main exits 2 and says them)."""
    from ppo_jax import evaluate, generate

    def gen(args, cfg):
        raise generate.ConfigError(f"would load step {args.step} top_k {cfg.generation.top_k}")

    def ev(cfg, run, *, step=None, actor=None):
        raise evaluate.ConfigError(f"would load step {step} top_k {cfg.generation.top_k}")

    monkeypatch.setattr(generate, "load_session", gen)
    monkeypatch.setattr(evaluate, "evaluate", ev)


@pytest.mark.parametrize("command, argv, step, top_k", [
    ("generate", ["{run}/actor_hf"], None, 1),
    ("generate", ["--run", "{run}", "--step", "5"], 5, 1),
    ("generate", ["--run", "{run}", "--step", "4"], 4, 0),
    ("generate", ["--run", "{run}", "--step", "0"], 0, 0),
    ("generate", ["--run", "{run}"], 6, 1),  # no --step: the latest checkpoint
    ("evaluate", ["--run", "{run}", "--step", "0"], 0, 0),
    ("evaluate", ["--run", "{run}", "--step", "4"], 4, 0),
    ("evaluate", ["--run", "{run}", "--step", "5"], 5, 1),
    ("evaluate", ["--run", "{run}"], 6, 1),
    ("evaluate", ["--run", "{run}", "--actor", "{run}/actor_hf"], None, 1),
])
def test_generate_and_evaluate_use_the_config_of_the_step(tmp_path, capsys, stop_before_loading,
                                                          command, argv, step, top_k):
    module = __import__(f"ppo_jax.{command}", fromlist=["main"])
    run = write_run(tmp_path / "run")
    argv = [a.format(run=run) for a in argv] + (["--prompt", "x"] if command == "generate" else [])
    assert module.main(argv) == 2
    assert f"would load step {step} top_k {top_k}" in capsys.readouterr().err


def test_evaluate_refuses_other_keys_than_eval_ones(tmp_path, capsys, stop_before_loading):
    from ppo_jax import evaluate

    run = write_run(tmp_path / "run")
    assert evaluate.main(["--run", str(run), "--set", "eval.num_prompts=2", "--set",
                          "generation.top_k=5", "--set", "optim.actor_lr=1"]) == 2
    err = capsys.readouterr().err
    assert "--set generation.top_k, optim.actor_lr: evaluate changes eval.* keys only" in err
    assert "eval.num_prompts" not in err.split(":")[0]
    assert evaluate.main(["--run", str(run), "--set", "eval.num_prompts=2"]) == 2
    assert "would load step 6" in capsys.readouterr().err  # an eval key is taken


def test_generate_without_a_checkpoint_names_the_run(tmp_path, capsys, stop_before_loading):
    from ppo_jax import generate

    run = write_run(tmp_path / "run", steps=())
    assert generate.main(["--run", str(run), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert f"--run {str(run)!r}: no checkpoint under {run / 'checkpoints'}" in err
    assert "--step 0" in err


def test_a_prompt_file_without_the_field_names_the_flag_and_the_file(tmp_path, capsys,
                                                                     stop_before_loading):
    from ppo_jax import generate

    run = write_run(tmp_path / "run")
    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    assert generate.main(["--run", str(run), "--prompts", str(file)]) == 2
    err = capsys.readouterr().err
    assert f"--prompts: record 1 of {file} has no field data.prompt_field='prompt'" in err
