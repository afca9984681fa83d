"""Bad input refused at load time: exit 2, the key, file or value named, nothing written, and no
model loaded (the model loaders are replaced by ones that fail the test)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402

TINY = ROOT / "configs/tiny.yaml"
PROMPTS = f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}"


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: a refusal must come before loading."""
    import ppo_jax.trainer.loading.models as setup

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    for name in ("build_models", "abstract_models", "load_split"):
        monkeypatch.setattr(setup, name, loaded)
    import ppo_jax.trainer.stages.ppo.trainer as ppo

    monkeypatch.setattr(ppo, "build_models", loaded)


def refused(tmp_path, capsys, *args, config=TINY) -> str:
    """Run train.py's main with `args`; assert exit 2 and no output directory; the stderr."""
    out = tmp_path / "run"
    argv = ["--set", f"train.output_dir={out}", "--set", "train.progress=false", *args]
    if config is not None:
        argv = ["--config", str(config), *argv]
    assert train.main(argv) == 2
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    return capsys.readouterr().err


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_a_group_estimator_with_one_sample_per_prompt_is_refused(estimator, no_model_loads, tmp_path, capsys):
    err = refused(tmp_path, capsys, "--set", PROMPTS, "--set", f"ppo.advantage_estimator={estimator}",
                  "--set", "generation.samples_per_prompt=1")
    assert f"ppo.advantage_estimator='{estimator}'" in err
    assert "generation.samples_per_prompt=1" in err and "nothing would train" in err


def test_a_group_estimator_with_groups_is_accepted():
    from ppo_jax.trainer.config import load_config
    from ppo_jax.trainer.stages.ppo.load_checks import check_names

    check_names(load_config(TINY, ["ppo.advantage_estimator=grpo", "generation.samples_per_prompt=2"]))


def test_math_verify_on_prompts_without_an_answer_is_refused(no_model_loads, tmp_path, capsys):
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text('{"prompt": "What is 2+2?", "answer": "4"}\n{"prompt": "And 3+3?"}\n')
    err = refused(tmp_path, capsys, "--set", f"data.prompts={prompts}",
                  "--set", "reward.kind=function", "--set", "reward.function=math_verify")
    assert "reward.function=math_verify" in err and "'answer'" in err
    assert f"record 1 of {prompts}" in err


def test_reasoning_gym_on_a_prompt_file_is_refused(no_model_loads, tmp_path, capsys):
    err = refused(tmp_path, capsys, "--set", PROMPTS, "--set", "reward.kind=function",
                  "--set", "reward.function=reasoning_gym")
    assert "reward.function=reasoning_gym" in err and "'task'" in err and "data.prompts: task" in err


@pytest.mark.parametrize("data", [b'{"prompt": "caf\xe9 au lait"}\n', b"\x89PNG\r\n\x1a\n\x00\x00"])
def test_a_prompt_file_that_is_not_utf8_is_named(data, no_model_loads, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(data)
    err = refused(tmp_path, capsys, "--set", f"data.prompts={prompts}")
    assert f"data.prompts: {prompts} is not UTF-8 text" in err and "offset" in err


@pytest.mark.parametrize("text, match", [
    ("ppo:\n  batch_size: [\n", r"line 3, column 1: not valid YAML"),
    ("- ppo\n- data\n", r"the top level is a list, not a mapping"),
    ("ppo: {batch_size: 4\n", r"line 2, column 1: not valid YAML"),
])
def test_a_broken_yaml_file_is_named_with_its_line(text, match, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    err = refused(tmp_path, capsys, config=bad)
    assert __import__("re").search(f"config {bad}.*{match}", err), err


def test_a_yaml_file_that_is_not_utf8_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"ppo:\n  kl_coef: 0.1 \xaf\n")
    err = refused(tmp_path, capsys, config=bad)
    assert f"config {bad}: not UTF-8 text (byte 0xaf at offset 20)" in err


def test_a_list_key_without_brackets_shows_the_bracket_form(tmp_path, capsys):
    err = refused(tmp_path, capsys, "--set", "model.lora.target_modules=q_proj")
    assert "'model.lora.target_modules' takes a list, got 'q_proj'" in err
    assert "--set model.lora.target_modules=[q_proj]" in err


def test_compile_for_says_which_batch_fits_the_slice(tmp_path, capsys):
    pytest.importorskip("libtpu")
    err = refused(tmp_path, capsys, "--compile-for", "v5e-8")
    assert "ppo.batch_size=4 is not a multiple of the mesh's batch shards, data x fsdp = 8" in err
    assert "--set ppo.batch_size=8" in err


PROBE = "import jax; print(jax.devices())"


def _probe_stderr(quiet: bool) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_PLATFORMS", "TPU_"))}
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # libtpu starts even while another test holds it
    code = ("from ppo_jax.trainer.host.env import quiet_tpu_probe; quiet_tpu_probe(); "
            if quiet else "") + PROBE
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True).stderr


def test_a_cpu_run_prints_no_libtpu_start_up_errors():
    pytest.importorskip("libtpu")
    from ppo_jax.trainer.host.env import tpu_chips_attached

    if tpu_chips_attached():
        pytest.skip("a TPU host: libtpu starts for real")
    assert "TPU_WORKER_HOSTNAMES" in _probe_stderr(quiet=False)  # what a newcomer saw
    assert _probe_stderr(quiet=True).strip() == ""


@pytest.mark.parametrize("sets, named", [
    (["generation.placement=split"], "generation.rollout_devices=0"),
    # the test process has one device: a rollout group of 1 leaves the trainer none
    (["generation.placement=split", "generation.rollout_devices=1"],
     "generation.rollout_devices=1 must leave the trainer"),
    (["generation.rollout_devices=2"], "generation.rollout_devices=2 has no effect"),
])
def test_a_split_placement_that_cannot_run_is_refused_naming_the_key(sets, named, no_model_loads,
                                                                    tmp_path, capsys):
    err = refused(tmp_path, capsys, "--set", PROMPTS, *sum((["--set", s] for s in sets), []))
    assert named in err, err
