"""Issue 36, "Resume you can trust": `--resume` refuses a directory with no run (exit 2, the path
named, nothing written, no model loaded); `--resume auto` starts one there and says so first;
a resume runs under the run's saved config, lists what `--set` changes and writes it beside the
first config (kept), and refuses by name the keys a checkpoint cannot take; a damaged checkpoint
is named (step, file, cause) in a few lines, and `--resume-fallback` continues from the previous
step, bit-exact with the uninterrupted run.

One tiny 4-step run (checkpoints 1-4) is made once; each test works on a copy of it."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402
from ppo_jax.trainer.lifecycle.checkpoint import Checkpointer, CheckpointReadError, finished_steps  # noqa: E402
from ppo_jax.trainer.config import ConfigError, load_config, to_dict  # noqa: E402
from ppo_jax.trainer.lifecycle.resume import (  # noqa: E402
    UNSAFE, config_changes, flat, resume_mode, unsafe_reason,
)
from ppo_jax.trainer.lifecycle.run_dir import config_in_effect, write_run_config  # noqa: E402

TINY = ROOT / "configs/tiny.yaml"
VOLATILE = ("time/", "tokens_per_s/")  # wall-clock figures


def sets(out: Path, *more: str) -> list[str]:
    args = ["--set", f"train.output_dir={out}"]
    for s in more:
        args += ["--set", s]
    return args


def tiny(out: Path, *more: str) -> list[str]:
    """train.py arguments of the tiny run: 4 steps, every one saved, no held-out evaluation."""
    return ["--config", str(TINY), *sets(out, f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}",
                                         "train.steps=4", "train.save_every=1", "train.max_to_keep=4",
                                         "train.progress=false", "eval.every=0", *more)]


def rows(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE)}
            for line in (out / name).read_text().splitlines()]


def actor_weights(out: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(out / "actor_hf" / "model.safetensors")


def listing(path: Path) -> dict:
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in sorted(path.rglob("*"))}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run: 4 steps, checkpoints 1-4, actor_hf of step 4."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PPO_JAX_CACHE", str(tmp_path_factory.mktemp("cache")))
    out = tmp_path_factory.mktemp("straight") / "run"
    assert train.main(tiny(out)) == 0
    assert finished_steps(out / "checkpoints") == [1, 2, 3, 4]
    yield out
    mp.undo()


@pytest.fixture
def copy(straight, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(straight, out)
    (out / ".lock").unlink(missing_ok=True)
    return out


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if train.py gets as far as building a trainer (loading a model)."""
    import ppo_jax.trainer.stages as stages

    def refuse(stage):
        raise AssertionError(f"a {stage} trainer was built: the refusal came after loading")

    monkeypatch.setattr(stages, "trainer_class", refuse)


# --- a directory with no run ---------------------------------------------------------------------

@pytest.mark.parametrize("kind,why", [("missing", "no such directory"), ("empty", "an empty directory")])
def test_resume_refuses_a_directory_with_no_run_naming_it_and_writes_nothing(
        kind, why, tmp_path, capsys, no_model):
    out = tmp_path / "runs" / "misspeled"
    if kind == "empty":
        out.mkdir(parents=True)
    assert train.main(["--config", str(TINY), *sets(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"train.output_dir={str(out)!r} holds no run to resume ({why})" in err
    assert "--resume auto" in err  # the explicit way to start there
    assert (not out.exists()) if kind == "missing" else list(out.iterdir()) == []


def test_resume_of_a_step_that_is_not_there_lists_the_steps(copy, capsys, no_model):
    assert train.main(sets(copy) + ["--resume", "7"]) == 2
    assert "has no checkpoint of step 7; its checkpoints are steps [1, 2, 3, 4]" in capsys.readouterr().err
    assert train.main(sets(copy) + ["--resume", "seven"]) == 2
    assert "--resume 'seven': give nothing (the latest checkpoint), 'auto' or a step" in capsys.readouterr().err
    assert train.main(sets(copy) + ["--resume-fallback"]) == 2
    assert "--resume-fallback goes with --resume" in capsys.readouterr().err


def test_resume_modes_read_from_the_command_line():
    assert [resume_mode(v) for v in (None, False, True, "latest", "auto", "12", 3)] == \
        [None, None, "latest", "latest", "auto", 12, 3]
    assert train.parse_args(["--resume"]).resume == "latest"
    assert train.parse_args(["--resume", "auto"]).resume == "auto"
    assert train.parse_args(["--resume", "--set", "a=1"]).overrides == ["a=1"]


# --- the config of a resume ----------------------------------------------------------------------

def test_changed_safe_keys_are_applied_and_listed_and_the_first_config_is_kept(straight, copy, capsys):
    """Without --config the run's own config is the base: only what --set names changes. With
    critic warm-up now past step 5, step 5 leaves the actor exactly as step 4 left it."""
    first = (copy / "config.json").read_bytes()
    shutil.rmtree(copy / "actor_hf")  # so the comparison below sees the new export
    assert train.main(sets(copy, "train.steps=5", "ppo.critic_warmup_steps=10", "optim.critic_lr=5e-4")
                      + ["--resume"]) == 0
    out = capsys.readouterr().out
    listed = [line.strip() for line in out.splitlines() if line.startswith("  ")]
    assert listed == ["optim.critic_lr: 0.0001 -> 0.0005", "ppo.critic_warmup_steps: 0 -> 10",
                      f"train.output_dir: {str(straight)!r} -> {str(copy)!r}", "train.steps: 4 -> 5"]
    assert "4 setting(s) differ from the run's config" in out and "apply from step 5" in out
    assert (copy / "config.json").read_bytes() == first  # never overwritten
    written = json.loads((copy / "config.resume-4.json").read_text())
    assert written["optim"]["critic_lr"] == 5e-4 and written["ppo"]["critic_warmup_steps"] == 10
    assert set(config_changes(json.loads(first), written)) == \
        {"optim.critic_lr", "ppo.critic_warmup_steps", "train.output_dir", "train.steps"}
    assert [(r["step"], r["critic_warmup"]) for r in rows(copy)] == \
        [(1, 0.0), (2, 0.0), (3, 0.0), (4, 0.0), (5, 1.0)]
    before, after = actor_weights(straight), actor_weights(copy)
    assert before.keys() == after.keys()
    for name in before:  # critic warm-up: the actor did not move at step 5
        np.testing.assert_array_equal(before[name], after[name])
    assert config_in_effect(copy, 4) == copy / "config.resume-4.json"  # a later resume's base
    assert config_in_effect(copy, 3) == copy / "config.json"


def test_changed_unsafe_keys_are_refused_by_name_before_loading(copy, capsys, no_model):
    before = listing(copy)
    assert train.main(sets(copy, "ppo.batch_size=8", "model.lora.rank=4", "optim.max_grad_norm=0",
                           "optim.actor_lr=1e-4") + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert "3 setting(s) cannot change when a run resumes" in err
    assert "ppo.batch_size=8 but the run was started with 4 (a batch size" in err
    assert "model.lora.rank=4 but the run was started with 0 (the checkpoint's adapters" in err
    assert "optim.max_grad_norm=0.0 but the run was started with 1.0" in err
    assert "actor_lr" not in err  # a safe change is not refused
    # another --config: its differences from the run's config are changes too
    assert train.main(["--config", str(ROOT / "configs/default.yaml"), *sets(copy), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "model.actor='smollm2' but the run was started with 'tiny-random'" in err
    assert "generation.max_new_tokens=40 but the run was started with 8" in err
    assert listing(copy) == before  # nothing written


def test_the_unsafe_list_names_keys_of_the_schema():
    keys = set(flat(to_dict(load_config(None))))
    for name, *_ in UNSAFE:
        assert any(k == name or (name.endswith(".") and k.startswith(name)) for k in keys), name
    assert unsafe_reason("optim.max_grad_norm", 1.0, 0.5, "ppo") is None  # same structure
    assert unsafe_reason("data.prompt_buckets", 1, 4, "ppo") is None
    assert unsafe_reason("ppo.batch_size", 4, 8, "sft") is None  # not read by an sft run
    assert unsafe_reason("sft.batch_size", 4, 8, "sft") is not None
    assert unsafe_reason("reward_model.backbone_lr_scale", 1.0, 0.0, "reward_model") is not None
    assert unsafe_reason("reward_model.backbone_lr_scale", 0.5, 0.1, "reward_model") is None


def test_run_configs_are_never_overwritten(tmp_path):
    a, b = {"x": 1}, {"x": 2}
    assert write_run_config(tmp_path, a, 0) == tmp_path / "config.json"
    assert write_run_config(tmp_path, a, 3) is None  # the same config: nothing new
    assert write_run_config(tmp_path, b, 3) == tmp_path / "config.resume-3.json"
    assert write_run_config(tmp_path, a, 3) == tmp_path / "config.resume-3-2.json"
    assert json.loads((tmp_path / "config.json").read_text()) == a
    assert json.loads((tmp_path / "config.resume-3.json").read_text()) == b
    assert config_in_effect(tmp_path, 2) == tmp_path / "config.json"
    assert config_in_effect(tmp_path, 5) == tmp_path / "config.resume-3-2.json"


# --- damaged checkpoints -------------------------------------------------------------------------

def test_a_truncated_newest_checkpoint_is_named_and_falls_back_on_request_bit_exact(straight, copy, capsys):
    data = max((copy / "checkpoints/4/state").rglob("d/*"), key=lambda p: p.stat().st_size)
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    shutil.rmtree(copy / "actor_hf")  # so the comparison below sees a new export
    before = listing(copy)
    assert train.main(tiny(copy) + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint of step 4 cannot be read: {data}: OUT_OF_RANGE" in err
    assert f"value of size {size // 2}" in err and "truncated" in err
    assert "earlier checkpoints: steps [3, 2, 1]. Add --resume-fallback" in err
    assert "other stage" not in err and "Traceback" not in err and len(err.splitlines()) <= 4
    assert listing(copy) == before  # nothing written, nothing moved

    assert train.main(tiny(copy) + ["--resume", "--resume-fallback"]) == 0
    captured = capsys.readouterr()
    assert "falling back to step 3" in captured.err and "resumed from step 3" in captured.out
    assert finished_steps(copy / "checkpoints") == [1, 2, 3, 4]
    assert (copy / "checkpoints.superseded/4/state").is_dir()  # the damaged one, kept aside
    assert rows(copy) == rows(straight)  # step 4 run again, the same figures bit for bit
    assert rows(copy, "metrics.superseded.jsonl") == rows(straight)[3:]
    assert rows(copy, "samples.jsonl") == rows(straight, "samples.jsonl")  # step 4's once
    assert {r["step"] for r in rows(copy, "samples.superseded.jsonl")} == {4}
    assert "1 row of metrics.jsonl not covered by the restored state (step 3)" in captured.out
    want, got = actor_weights(straight), actor_weights(copy)
    for name in want:
        np.testing.assert_array_equal(want[name], got[name])


def test_resume_from_an_earlier_step_keeps_the_later_checkpoints_aside(straight, copy, capsys):
    """The checkpoints, metrics, samples and configs of the steps after it are moved aside,
    kept: a config.resume-3.json (an earlier resume from step 3 that changed settings) no
    longer applies to the steps this run trains again."""
    later = json.loads((copy / "config.json").read_text())
    later["generation"]["top_k"] = 1
    (copy / "config.resume-3.json").write_text(json.dumps(later))
    assert train.main(tiny(copy) + ["--resume", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0] == (f"--resume 2: resuming the run in {copy} from step 2 "
                                            "(later checkpoints: steps [3, 4])")
    assert "resumed from step 2" in captured.out
    assert sorted(p.name for p in (copy / "checkpoints.superseded").iterdir()) == ["3", "4"]
    assert finished_steps(copy / "checkpoints") == [1, 2, 3, 4]  # written again
    assert rows(copy) == rows(straight)
    assert rows(copy, "metrics.superseded.jsonl") == rows(straight)[2:]
    assert rows(copy, "samples.jsonl") == rows(straight, "samples.jsonl")
    assert {r["step"] for r in rows(copy, "samples.superseded.jsonl")} == {3, 4}
    assert sorted(p.name for p in copy.glob("config*.json")) == \
        ["config.json", "config.resume-2.json", "config.resume-3.superseded.json"]  # output_dir
    assert f"{copy / 'config.resume-3.json'} (a resume from a later checkpoint" in captured.out
    assert json.loads((copy / "config.resume-2.json").read_text())["generation"]["top_k"] == 0
    assert config_in_effect(copy, 4) == copy / "config.resume-2.json"


def test_a_damaged_metadata_file_is_named_before_loading_not_taken_for_other_settings(
        copy, capsys, no_model):
    metadata = copy / "checkpoints/4/state/_METADATA"
    metadata.write_bytes(metadata.read_bytes()[:100])  # cut short
    before = listing(copy)
    assert train.main(sets(copy) + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert (f"error: checkpoint of step 4 cannot be read: {metadata}: not valid JSON, damaged or "
            "truncated (100 bytes; ") in err
    assert "Add --resume-fallback" in err and "other stage" not in err
    assert listing(copy) == before
    (copy / "checkpoints/3/meta/metadata").unlink()
    with pytest.raises(CheckpointReadError) as e:
        Checkpointer(copy / "checkpoints").restore(3, like=None)
    assert (e.value.step, e.value.file, e.value.cause) == (3, copy / "checkpoints/3/meta/metadata", "missing")


# --- --resume auto -------------------------------------------------------------------------------

def test_resume_auto_starts_on_an_empty_directory_and_resumes_a_run(copy, tmp_path, capsys):
    new = tmp_path / "new"
    new.mkdir()
    assert train.main(tiny(new, "train.steps=1") + ["--resume", "auto"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0] == \
        f"--resume auto: no run to resume in {new} (an empty directory); starting a new run"
    assert finished_steps(new / "checkpoints") == [1] and (new / "config.json").is_file()
    assert train.main(tiny(copy) + ["--resume", "auto"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0] == f"--resume auto: resuming the run in {copy} from step 4"
    assert "nothing to do: the run is at step 4" in captured.out


@pytest.mark.parametrize("resume", [[], ["--resume", "auto"]])
def test_a_new_start_writes_its_config_json_and_moves_a_leftover_one_aside(tmp_path, capsys,
                                                                            resume):
    """A directory holding only the config.json of an attempt that crashed before its first
    checkpoint: the new run's config is config.json, the leftover one is kept beside it, and
    one line says so (without a word of --resume when none was given)."""
    new = tmp_path / "new"
    new.mkdir()
    stale = {"left": "over"}
    (new / "config.json").write_text(json.dumps(stale))
    (new / "config.superseded.json").write_text("{}")  # taken: the next number
    assert train.main(tiny(new, "train.steps=1") + resume) == 0
    captured = capsys.readouterr()
    assert sorted(p.name for p in new.glob("config*.json")) == \
        ["config.json", "config.superseded-2.json", "config.superseded.json"]
    assert json.loads((new / "config.superseded-2.json").read_text()) == stale
    assert json.loads((new / "config.json").read_text())["train"]["steps"] == 1
    said = [line for line in captured.out.splitlines() if "config.superseded-2.json" in line]
    assert said == [f"{new / 'config.json'} (left by an earlier start that wrote no checkpoint) "
                    "moved to config.superseded-2.json (kept); this run does not train under it"]
    if not resume:
        assert "--resume" not in captured.out + captured.err


def test_a_new_start_keeps_a_leftover_config_json_that_says_the_same(tmp_path):
    from ppo_jax.trainer.lifecycle.run_dir import supersede_configs

    (tmp_path / "config.json").write_text(json.dumps({"x": 1}))
    (tmp_path / "config.resume-2.json").write_text(json.dumps({"x": 2}))
    assert supersede_configs(tmp_path, -1, same={"x": 1}) == \
        [(tmp_path / "config.resume-2.json", tmp_path / "config.resume-2.superseded.json")]
    assert (tmp_path / "config.json").is_file()
    assert supersede_configs(tmp_path, 0) == []  # a resume from step 0 on: config.json applies


def test_plain_resume_of_a_run_stopped_before_its_first_checkpoint_is_refused(tmp_path):
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0, "eval/kl": 0.0}\n')
    cfg = load_config(TINY, [f"train.output_dir={out}"])
    with pytest.raises(ConfigError, match=r"holds no run to resume \(no finished checkpoint"):
        PPOTrainer(cfg, resume=True)
    assert (out / "metrics.jsonl").read_text() == '{"step": 0, "eval/kl": 0.0}\n'
