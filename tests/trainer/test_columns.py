"""Column buckets (`trainer.stages.ppo.step_data`): bucket widths, cutting prompts and responses, and a tiny
PPO run whose responses stop early giving the same figures with buckets on as off."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.trainer.stages.ppo.step_data import PromptColumns, ResponseColumns, bucket_width, bucket_widths
from ppo_jax.trainer.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/tiny.yaml"


# --- widths ----------------------------------------------------------------------------------

def test_bucket_widths_are_evenly_spaced_and_end_at_the_full_width():
    assert bucket_widths(0, 40, 4) == (10, 20, 30, 40)
    assert bucket_widths(0, 8, 3) == (3, 6, 8)
    assert bucket_widths(16, 23, 4) == (18, 20, 22, 23)  # prompts: from the shortest prompt
    assert bucket_widths(0, 3, 8) == (1, 2, 3)  # more buckets than columns: each width once
    assert bucket_widths(5, 5, 4) == (5,)  # prompts all of one length
    assert bucket_widths(0, 40, 1) == (40,)  # off


@pytest.mark.parametrize("args", [(0, 8, 0), (0, 8, 2.5), (0, 0, 2), (9, 8, 2), (-1, 8, 2)])
def test_bad_bucket_ranges_are_rejected(args):
    with pytest.raises(ValueError):
        bucket_widths(*args)


@pytest.mark.parametrize("length, width", [(0, 2), (1, 2), (2, 2), (3, 4), (4, 4), (7, 8), (8, 8)])
def test_a_length_takes_the_narrowest_bucket_that_holds_it(length, width):
    """Exactly at a bucket edge stays in that bucket; an empty batch takes the first width."""
    assert bucket_width(length, (2, 4, 6, 8)) == width


def test_a_length_past_the_last_bucket_is_an_error():
    with pytest.raises(ValueError, match="outside"):
        bucket_width(9, (2, 4, 6, 8))


@pytest.mark.parametrize("key", ["generation.response_buckets", "data.prompt_buckets"])
def test_bucket_counts_below_one_are_refused_at_load(key):
    with pytest.raises(ConfigError, match=key):
        load_config(TINY, [f"{key}=0"])


# --- cutting ---------------------------------------------------------------------------------

def test_prompt_columns_keep_every_real_token_of_the_whole_batch():
    mask = np.array([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    ids = np.where(mask > 0, np.arange(20).reshape(4, 5), 0)
    cols = PromptColumns(mask, buckets=4)
    assert cols.widths == (2, 3, 4, 5)  # between the shortest prompt (1) and the widest (5)
    assert cols.width([0, 3]) == 2 and cols.width([0, 2]) == 3 and cols.width([3, 1]) == 5
    cut = cols.cut(ids, 3)
    assert cut.shape == (4, 3) and cut.flags.c_contiguous
    np.testing.assert_array_equal(cut[[0, 2, 3]], ids[[0, 2, 3], 2:])
    assert PromptColumns(mask, buckets=1).widths == (5,)  # off: the set's padded width


def _mask(lengths, n=8):
    return jnp.asarray((np.arange(n)[None] < np.asarray(lengths)[:, None]).astype(np.int32))


@pytest.mark.parametrize("lengths, width", [([1, 3, 2, 1], 4),  # between bucket edges
                                            ([4, 2, 4, 1], 4),  # exactly at a bucket edge
                                            ([8, 8, 8, 8], 8),  # every row at max_new_tokens
                                            ([0, 0, 0, 0], 2)])  # empty responses
def test_response_columns_cut_to_the_bucket_of_the_longest_response(lengths, width):
    cols = ResponseColumns(8, 4)
    mask = _mask(lengths)
    ids = jnp.where(mask > 0, jnp.arange(32).reshape(4, 8) + 5, 0)
    got_ids, got_mask, got_width = cols(ids, mask)
    assert got_width == width and got_ids.shape == got_mask.shape == (4, width)
    np.testing.assert_array_equal(got_ids, ids[:, :width])
    np.testing.assert_array_equal(got_mask, mask[:, :width])
    if width == 8:
        assert got_ids is ids and got_mask is mask  # nothing to cut: the arrays themselves
    off = ResponseColumns(8, 1)
    assert off(ids, mask)[2] == 8 and off(ids, mask)[0] is ids


# --- a PPO run -------------------------------------------------------------------------------

# about half of the tiny vocabulary stops a response: most rows end after a few tokens
STOPS = "generation.stop_token_ids=[" + ",".join(map(str, range(2, 106))) + "]"
VOLATILE = ("time/", "tokens_per_s/", "prompt_width", "response_width")


def _run(tmp_path, name, *sets, steps=3):
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    cfg = load_config(TINY, [f"train.output_dir={tmp_path / name}", "train.progress=false",
                             f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}",
                             f"train.steps={steps}", "eval.every=0", "train.export_hf=false",
                             "train.save_every=0", *sets])
    trainer = PPOTrainer(cfg)
    history = trainer.train(progress=False)
    return trainer, history


@pytest.mark.slow  # default-run budget (15 min on 2 cores)
def test_early_stopping_responses_give_the_same_run_with_buckets_on_and_off(cache, tmp_path):
    """Responses that stop early: experience making and the update run on fewer columns (the logged
    widths, the arrays kept for the samples, one compiled update per width pair), and every
    metric and param equals the full-width run (seq-mean-token-sum with its constant
    max_new_tokens, the missing-EOS penalty and reward whitening on)."""
    common = (STOPS, "ppo.loss_aggregation=seq-mean-token-sum", "ppo.missing_eos_penalty=1.0",
              "ppo.whiten_rewards=true")
    off, h_off = _run(tmp_path, "off", *common, "generation.response_buckets=1", "data.prompt_buckets=1")
    on, h_on = _run(tmp_path, "on", *common, "generation.response_buckets=4", "data.prompt_buckets=4")
    assert [h["response_width"] for h in h_off] == [8.0] * 3
    assert [h["prompt_width"] for h in h_off] == [float(off.prompts.ids.shape[1])] * 3
    widths = [(int(h["prompt_width"]), int(h["response_width"])) for h in h_on]
    assert all(w in on.response_columns.widths for _, w in widths)
    assert all(p in on.prompt_columns.widths for p, _ in widths)
    assert min(w for _, w in widths) < 8, widths  # a narrower shape ran (the draws say when)
    assert on._last_rollout.rollout.response_ids.shape[1] == widths[-1][1]
    assert on.jit.update._cache_size() == len(set(widths))  # one executable per width pair
    for step, (a, b) in enumerate(zip(h_off, h_on)):
        assert a.keys() == b.keys()
        for key in a:
            if not key.startswith(VOLATILE):
                assert math.isclose(b[key], a[key], rel_tol=1e-5, abs_tol=1e-5), (step, key, a[key], b[key])
    assert 0 < h_on[0]["ended_fraction"] and h_on[0]["response_length"] < 8
    for name in ("actor", "critic"):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5),
                     on.state[name].params, off.state[name].params)
    assert [s["response"] for s in on.last_samples] == [s["response"] for s in off.last_samples]
