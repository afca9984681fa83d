"""Reward functions on text, and the metrics files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ppo_jax.trainer.tracking.metrics import MetricsWriter, read_metrics
from ppo_jax.trainer.rewards.functions import get_reward_function, register_reward_function


def test_vader_scores_sentiment_of_the_response():
    vader = get_reward_function("vader")
    s = vader(["p", "p", "p"], ["What a wonderful, lovely day!", "the bus", "This is terrible and awful."])
    assert s.dtype == np.float32 and s.shape == (3,)
    assert s[0] > 0.5 and s[1] == 0.0 and s[2] < -0.5


def test_unknown_reward_function_lists_the_known_ones():
    with pytest.raises(ValueError, match="vader"):
        get_reward_function("sentiment9")


def test_registering_a_name_twice_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_reward_function("vader")(lambda: None)


def test_metrics_are_appended_and_flushed(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=True)
    w.write(1, {"kl": np.float32(0.5), "reward": 1.0, "nan": float("nan")})
    # readable before close: nothing is lost if the run dies now
    rec = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert rec == {"step": 1, "kl": 0.5, "reward": 1.0, "nan": "nan"}
    w.write_samples(1, [{"prompt": "a", "response": "b", "score": 0.1}])
    w.close()
    w2 = MetricsWriter(tmp_path, tensorboard=False)
    w2.write(2, {"kl": 0.25})
    w2.close()
    steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_read_metrics_returns_what_was_written(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    w.write(1, {"kl": 0.5, "loss": float("nan"), "ratio": float("inf"), "low": float("-inf"),
                "tag": "text"})
    w.write(2, {"kl": 0.25})
    w.close()
    (tmp_path / "metrics.jsonl").write_text((tmp_path / "metrics.jsonl").read_text() + "\n")
    first, second = read_metrics(tmp_path / "metrics.jsonl")
    assert np.isnan(first.pop("loss")) and first == {"step": 1, "kl": 0.5, "ratio": float("inf"),
                                                    "low": float("-inf"), "tag": "text"}
    assert second == {"step": 2, "kl": 0.25}
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "missing.jsonl")
