"""`generation.share_prompt_prefill`: a tiny GRPO trainer (4 samples per prompt) with one prefill
per group samples the rollout, and gives the metrics, of the trainer with one prefill per row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ppo_jax.trainer.config import load_config

ROOT = Path(__file__).resolve().parents[2]
VOLATILE = ("time/", "tokens_per_s/")  # wall-clock metrics: not compared


def grpo_trainer(tmp_path: Path, share: bool):
    """configs/tiny.yaml with GRPO, 2 prompts x 4 samples a step; one minibatch, one epoch, one
    prompt and one response width: each program compiles once."""
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    trainer = PPOTrainer(load_config(ROOT / "configs/tiny.yaml", [
        f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}", "ppo.advantage_estimator=grpo",
        "generation.samples_per_prompt=4", "ppo.batch_size=8", "ppo.mini_batch_size=8",
        "ppo.micro_batch_size=8", "ppo.ppo_epochs=1", "data.prompt_buckets=1",
        "generation.response_buckets=1", f"generation.share_prompt_prefill={str(share).lower()}",
        f"train.output_dir={tmp_path / str(share)}", "train.progress=false"]))
    assert trainer.settings.sampling.samples_per_prompt == (4 if share else 1)
    return trainer


def test_a_grpo_rollout_with_shared_prefills_equals_one_prefill_per_row(tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    shared, repeated = (grpo_trainer(tmp_path, s).sample_rollout() for s in (True, False))
    assert shared.prompts == repeated.prompts and len(set(shared.prompts)) == 2
    for name in ("query_ids", "query_mask", "response_ids", "response_mask"):
        got, want = (np.asarray(getattr(x.rollout, name)) for x in (shared, repeated))
        np.testing.assert_array_equal(got, want, err_msg=name)
    responses = np.asarray(shared.rollout.response_ids)
    assert len({tuple(r) for r in responses[:4]}) > 1  # a group's samples are not copies


@pytest.mark.slow
def test_a_grpo_run_with_shared_prefills_gives_the_same_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    runs = []
    for share in (True, False):
        trainer = grpo_trainer(tmp_path, share)
        runs.append([{k: v for k, v in trainer.step().items() if not k.startswith(VOLATILE)}
                     for _ in range(2)])
    shared, repeated = runs
    assert [m.keys() for m in shared] == [m.keys() for m in repeated]
    for step, (got, want) in enumerate(zip(shared, repeated)):
        for k in want:
            assert got[k] == pytest.approx(want[k], abs=1e-6, rel=1e-6), f"step {step}: {k}"
    assert shared[1]["data_position"] == 4  # 2 steps x 2 prompts x 4 samples
    assert any(m["pg_loss"] != 0 for m in shared)
