"""scripts/make_preference_pairs.py on the tiny random model with a test reward (response length).

Pins: one row per prompt in every file, chosen = the highest-scored non-empty sample (scores
recomputed here), chosen_score > rejected_score, the SFT response is the chosen one, the same
seed gives identical files, and a missing prompt file is a clear error.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from ppo_jax.trainer.data.prompts import read_prompts
from ppo_jax.trainer.rewards.functions import get_reward_function, register_reward_function

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "configs/prompts/reviews.jsonl"
REWARD, K, FIRST = "test_response_chars", 3, 10


def _load_script():
    spec = importlib.util.spec_from_file_location("make_preference_pairs",
                                                  ROOT / "scripts/make_preference_pairs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


mpp = _load_script()


@register_reward_function(REWARD)
def _response_chars():
    """Characters of the response: a reward with few ties on random text."""
    return lambda prompts, responses: np.asarray([len(r) for r in responses], np.float32)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _argv(out: Path, prompts: Path = PROMPTS) -> list[str]:
    # 30 rows in batches of 8: the last batch is padded with 2 repeated rows
    return ["--actor", "tiny-random", "--prompts", str(prompts), "--k", str(K), "--out", str(out),
            "--reward", REWARD, "--first", str(FIRST), "--batch-size", "8",
            "--max-new-tokens", "12", "--seed", "3"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("PPO_JAX_CACHE", str(tmp_path_factory.mktemp("cache")))
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    try:
        assert mpp.main(_argv(a)) == 0
        assert mpp.main(_argv(b)) == 0
    finally:
        mp.undo()
    return a, b


def test_one_row_per_prompt_with_raw_prompts(two_runs):
    out, _ = two_runs
    samples = _read_jsonl(out / "samples.jsonl")
    assert [s["prompt"] for s in samples] == read_prompts(PROMPTS)[:FIRST]  # not templated
    assert all(len(s["responses"]) == len(s["scores"]) == K for s in samples)
    summary = json.loads((out / "summary.json").read_text())
    pairs, sft = _read_jsonl(out / "pairs.jsonl"), _read_jsonl(out / "sft.jsonl")
    assert summary["prompts"] == FIRST and summary["samples"] == FIRST * K
    assert summary["pairs"] == len(pairs) and summary["sft_rows"] == len(sft)
    assert len(pairs) + sum(summary["skipped"].values()) == FIRST
    assert len(sft) + summary["skipped"]["all_empty"] == FIRST
    assert len(pairs) >= FIRST // 2  # random text of varying length: most prompts give a pair
    assert summary["generated_tokens"] > 0 and summary["tokens_per_s"] > 0


def test_chosen_is_the_best_nonempty_sample_and_the_sft_response(two_runs):
    out, _ = two_runs
    reward = get_reward_function(REWARD)
    samples = {s["prompt"]: s for s in _read_jsonl(out / "samples.jsonl")}
    sft = {r["prompt"]: r for r in _read_jsonl(out / "sft.jsonl")}
    for pair in _read_jsonl(out / "pairs.jsonl"):
        responses = samples[pair["prompt"]]["responses"]
        scores = reward([pair["prompt"]] * K, responses)  # re-scored here
        np.testing.assert_allclose(samples[pair["prompt"]]["scores"], scores)
        best = max(s for s, r in zip(scores, responses) if r)
        assert pair["chosen_score"] == pytest.approx(best) and pair["chosen"]
        assert pair["rejected_score"] == pytest.approx(scores.min())
        assert pair["chosen_score"] > pair["rejected_score"]
        assert pair["chosen"] in responses and pair["rejected"] in responses
        assert sft[pair["prompt"]]["response"] == pair["chosen"]
        assert sft[pair["prompt"]]["score"] == pair["chosen_score"]


def test_same_seed_gives_identical_files(two_runs):
    a, b = two_runs
    for name in ("pairs.jsonl", "sft.jsonl", "samples.jsonl"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    for key in ("pairs", "skipped", "mean_score", "mean_best", "mean_worst", "generated_tokens"):
        assert sa[key] == sb[key], key


def test_missing_prompt_file_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "no_such_prompts.jsonl"
    assert mpp.main(_argv(tmp_path / "out", prompts=missing)) == 2
    assert str(missing) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_existing_outputs_are_not_overwritten(two_runs, capsys):
    out, _ = two_runs
    assert mpp.main(_argv(out)) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_select_never_chooses_an_empty_response_and_counts_skips():
    texts = ["p0", "p1", "p2", "p3", "p4"]
    responses = [["", "ok", "good"], ["a", "b", "c"], ["x", "x", "x"], ["", "", ""],
                 ["same", "same", "other"]]
    scores = np.array([[0.9, 0.1, 0.5], [0.2, 0.2, 0.2], [0.3, 0.3, 0.3], [0.0, 0.0, 0.0],
                       [0.7, 0.7, 0.7]])
    cut = [[False, True, False]] + [[False] * 3] * 4  # "ok" hit the length limit
    got = mpp.select(texts, responses, scores, truncated=cut)
    assert got["pairs"] == [{"prompt": "p0", "chosen": "good", "rejected": "ok",
                             "chosen_score": 0.5, "rejected_score": 0.1,
                             "chosen_truncated": False, "rejected_truncated": True}]
    assert got["skipped"] == {"equal_score": 3, "identical_text": 0, "all_empty": 1}
    assert [r["response"] for r in got["sft"]] == ["good", "a", "x", "same"]
    got = mpp.select(["q"], [["same", "same"]], np.array([[0.4, 0.2]]))  # a noisy reward
    assert got["skipped"]["identical_text"] == 1 and not got["pairs"]


def test_batch_rows_repeat_each_prompt_k_times_and_pad_whole_batches():
    rows, width = mpp.batch_rows(n_prompts=3, k=2, batch_size=4)
    assert width == 4 and rows.tolist() == [0, 0, 1, 1, 2, 2, 0, 0]
    rows, width = mpp.batch_rows(n_prompts=2, k=2, batch_size=32)  # fewer rows than a batch
    assert width == 4 and rows.tolist() == [0, 0, 1, 1]


def test_bad_settings_fail_before_loading_a_model(tmp_path):
    args = mpp.parse_args(_argv(tmp_path / "out") + ["--k", "1"])
    with pytest.raises(ValueError, match="--k=1"):
        mpp.check_args(args)


def test_all_pairs_gap_adds_every_pair_far_enough_apart():
    scores = np.array([[0.9, 0.1, 0.5, 0.8]])
    got = mpp.select(["p"], [["a", "b", "c", "d"]], scores, gap=0.35)
    pairs = [(r["chosen"], r["rejected"]) for r in got["pairs"]]
    # best vs worst first, then every other pair at least 0.35 apart (a-c 0.4, c-b 0.4, d-b 0.7;
    # not d-c 0.3 nor a-d 0.1)
    assert pairs[0] == ("a", "b") and sorted(pairs[1:]) == [("a", "c"), ("c", "b"), ("d", "b")]
    assert all(r["chosen_score"] - r["rejected_score"] >= 0.35 for r in got["pairs"])


def test_eval_fraction_holds_out_whole_prompts(tmp_path):
    texts = [f"p{i}" for i in range(10)]
    held = mpp.held_out_prompts(texts, 0.2, seed=0)
    assert len(held) == 2 and held == mpp.held_out_prompts(texts, 0.2, seed=0)
    chosen = {"pairs": [{"prompt": t, "chosen": "a", "rejected": "b"} for t in texts for _ in range(2)],
              "sft": [{"prompt": t, "response": "a"} for t in texts]}
    mpp.write_outputs(tmp_path, texts, [], [], chosen, {}, held)
    train_prompts = {r["prompt"] for r in _read_jsonl(tmp_path / "pairs.jsonl")}
    eval_prompts = {r["prompt"] for r in _read_jsonl(tmp_path / "pairs_eval.jsonl")}
    assert eval_prompts == held and not train_prompts & held and len(train_prompts) == 8
    assert {r["prompt"] for r in _read_jsonl(tmp_path / "sft_eval.jsonl")} == held
