"""Held-out evaluation during PPO (`eval.*`): logged at step 0 and every `eval.every` steps,
reproducible with its fixed key, off when unset, not repeated on resume; the figures by hand."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402
from ppo_jax.trainer.config import ConfigError, load_config  # noqa: E402
from ppo_jax.trainer.data.prompts import PromptSet  # noqa: E402
from ppo_jax.trainer.stages.ppo.evaluation import eval_batch, eval_rows_multiple, eval_summary  # noqa: E402

TINY = ROOT / "configs/tiny.yaml"
EVAL_KEYS = {"eval/reward_mean", "eval/reward_std", "eval/kl", "eval/response_length",
             "eval/ended_fraction", "time/eval"}


def sets(out: Path, *extra: str) -> list[str]:
    return [f"train.output_dir={out}", f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}",
            f"eval.prompts={ROOT / 'configs/prompts/quotes_eval.jsonl'}", "train.progress=false",
            "train.export_hf=false", "train.tensorboard=false", "train.save_every=2",
            "eval.every=2", "eval.num_samples=2", *extra]


def cli(out: Path, *extra: str) -> list[str]:
    """train.py arguments for the tiny config with `sets(out, *extra)`."""
    return ["--config", str(TINY), *sum((["--set", s] for s in sets(out, *extra)), [])]


def rows(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def eval_part(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith("eval/")}


@pytest.fixture(scope="module")
def four_steps(cache, tmp_path_factory):
    """4 steps, eval.every=2: evaluations at steps 0, 2 and 4."""
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    out = tmp_path_factory.mktemp("run") / "a"
    trainer = PPOTrainer(load_config(TINY, sets(out, "train.steps=4")))
    history = trainer.train(progress=False)
    return out, trainer, history


# --- the figures ----------------------------------------------------------------------------

@pytest.mark.parametrize("jit", [False, True])
def test_eval_summary_by_hand_leaves_out_padding_rows(jit):
    scores = jnp.array([1.0, 3.0, jnp.nan])  # row 2 is a padding copy: NaN must not leak
    logprobs = jnp.array([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0], [jnp.nan, 0.0, 0.0]])
    ref = jnp.array([[-1.5, -1.0, 9.0], [-2.0, -2.0, -2.0], [0.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    ended = jnp.array([True, False, True])
    valid = jnp.array([True, True, False])
    fn = jax.jit(eval_summary) if jit else eval_summary
    got = {k: float(v) for k, v in fn(scores, logprobs, ref, mask, ended, valid).items()}
    # kl rows: (0.5 - 1.0) = -0.5 (token 2 is padding), (1 + 1 + 1) = 3 -> mean 1.25
    assert got == pytest.approx({"reward_mean": 2.0, "reward_std": 1.0, "kl": 1.25,
                                 "response_length": 2.5, "ended_fraction": 0.5})


def test_eval_batch_pads_with_copies_of_prompt_0_marked_invalid():
    ids = np.arange(10, dtype=np.int32).reshape(5, 2)
    prompts = PromptSet([f"p{i}" for i in range(5)], ids, np.ones_like(ids))
    batch = eval_batch(prompts, 3, eval_rows_multiple(2, 4))  # lcm 4 -> 4 rows
    assert batch.ids.shape == (4, 2) and batch.texts == ["p0", "p1", "p2"]
    np.testing.assert_array_equal(batch.ids[3], ids[0])
    assert batch.valid.tolist() == [True, True, True, False]
    assert eval_batch(prompts, 64, 1).ids.shape == (5, 2)  # fewer prompts than asked: all


# --- during a run ---------------------------------------------------------------------------

def test_eval_metrics_at_step_0_and_every_n_steps_only(four_steps):
    out, _, history = four_steps
    records = rows(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    for r in records:
        has = EVAL_KEYS <= set(r)
        assert has == (r["step"] % 2 == 0), r["step"]
        assert not any(k.startswith("eval/") for k in r) or has
        if has:
            assert all(math.isfinite(r[k]) for k in EVAL_KEYS)
    assert set(records[0]) == EVAL_KEYS | {"step"}  # step 0: the starting policy only
    assert records[0]["eval/kl"] == pytest.approx(0.0, abs=1e-6)  # actor == reference
    assert len(history) == 4 and "eval/kl" not in history[0]  # step 0 is not a training step


def test_eval_samples_are_marked_and_logged_with_their_step(four_steps):
    out, _, _ = four_steps
    samples = rows(out, "samples.jsonl")
    evals = [s for s in samples if s.get("eval")]
    assert [s["step"] for s in evals] == [0, 0, 2, 2, 4, 4]
    prompts = [json.loads(x)["prompt"] for x in
               (ROOT / "configs/prompts/quotes_eval.jsonl").read_text().splitlines()[:2]]
    assert [s["prompt"] for s in evals[:2]] == prompts
    assert all(isinstance(s["response"], str) and math.isfinite(s["score"]) for s in evals)
    assert any(not s.get("eval") for s in samples)  # the training samples are still there


def test_evaluating_the_same_params_twice_gives_identical_figures(four_steps):
    _, trainer, _ = four_steps
    first, second = trainer.evaluate(), trainer.evaluate()
    first.pop("time/eval"), second.pop("time/eval")
    assert first == second and len(first) == 5


@pytest.mark.slow  # default-run budget (15 min on 2 cores)
def test_a_second_run_and_a_resumed_run_give_identical_eval_rows(four_steps, tmp_path):
    """The same config in another directory, stopped at step 2 and resumed to 4: the same eval
    figures at steps 0, 2, 4, and the resume does not evaluate step 0 again."""
    out, _, _ = four_steps
    other = tmp_path / "b"
    assert train.main(cli(other, "train.steps=2")) == 0
    assert train.main(cli(other, "train.steps=4") + ["--resume"]) == 0
    want, got = rows(out), rows(other)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]
    for w, g in zip(want, got):
        assert eval_part(g) == eval_part(w), w["step"]
    assert sum(s["step"] == 0 for s in rows(other, "samples.jsonl")) == 2


def test_a_run_stopped_before_its_first_checkpoint_with_only_step_0_starts_over(cache, tmp_path):
    """Interrupted during step 1: only the step-0 eval is logged. A new run there is refused (as
    for any logged run), and so is `--resume` (no checkpoint: nothing to resume); `--resume auto`
    starts over and moves the old step-0 row aside."""
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0, "eval/kl": 0.0}\n')
    with pytest.raises(ConfigError, match="--resume"):
        PPOTrainer(load_config(TINY, sets(out, "train.steps=1")))
    with pytest.raises(ConfigError, match="holds no run to resume"):
        PPOTrainer(load_config(TINY, sets(out, "train.steps=1")), resume=True)
    trainer = PPOTrainer(load_config(TINY, sets(out, "train.steps=1")), resume="auto")
    assert trainer.step_count == 0 and (out / "metrics.jsonl").read_text() == ""
    assert rows(out, "metrics.superseded.jsonl") == [{"step": 0, "eval/kl": 0.0}]
    trainer._release()


def test_eval_off_when_prompts_unset_or_every_is_0(cache, tmp_path):
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    off = PPOTrainer(load_config(TINY, sets(tmp_path / "a", "eval.every=0", "train.steps=1")))
    assert off.evaluator is None and off.start_metrics() == {} and off.periodic_metrics(1) == {}
    off._release()
    out = tmp_path / "b"
    unset = PPOTrainer(load_config(TINY, sets(out, "eval.prompts=null", "eval.every=1",
                                              "train.steps=1")))
    assert unset.evaluator is None
    unset.train(progress=False)
    (record,) = rows(out)
    assert record["step"] == 1 and not any(k.startswith("eval/") or k == "time/eval" for k in record)
    samples = rows(out, "samples.jsonl") if (out / "samples.jsonl").exists() else []
    assert not any(s.get("eval") for s in samples)


def test_a_missing_eval_prompt_file_is_named_before_anything_is_written(cache, tmp_path, capsys):
    out = tmp_path / "run"
    assert train.main(cli(out, f"eval.prompts={tmp_path / 'nope.jsonl'}")) == 2
    err = capsys.readouterr().err
    assert "eval.prompts" in err and "nope.jsonl" in err
    assert not out.exists()


@pytest.mark.parametrize("override, key", [("eval.num_prompts=0", "eval.num_prompts"),
                                           ("eval.every=-1", "eval.every"),
                                           ("eval.temperature=0", "eval.temperature"),
                                           ("eval.max_new_tokens=0", "eval.max_new_tokens")])
def test_bad_eval_settings_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(TINY, [override])


def test_summarize_run_reports_first_and_last_eval(four_steps):
    out, _, _ = four_steps
    text = subprocess.run([sys.executable, str(ROOT / "scripts/summarize_run.py"), str(out)],
                          capture_output=True, text=True, check=True).stdout
    assert "4 steps" in text and "score_mean" in text and "time/step" in text  # as before
    assert "3 held-out evaluations (steps 0..4)" in text
    assert "eval/reward_mean" in text and "eval/kl" in text
