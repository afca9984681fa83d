"""The jitted KV-cache sampler: parity with transformers' greedy generate, left-padding
invariance, stop tokens and the response mask, and the top-k / top-p filters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax.models import load_model, split_model
from ppo_jax.core import ended_rows
from ppo_jax.rollout.draws import filter_logits
from ppo_jax.rollout.static_batch import generate
from ppo_jax.rollout.forward import policy_logprobs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 128


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random HF Llama with peaked logits (weights ~ N(0, 0.1)), saved locally."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.1)
    path = tmp_path_factory.mktemp("hf") / "llama"
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def split(hf_dir):
    model, _ = load_model(hf_dir[0], "causal_lm")
    return split_model(model)


def prompts():
    rng = np.random.default_rng(0)
    ids = rng.integers(3, VOCAB, (4, 7)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :2] = 0
    mask[3, :5] = 0
    ids[mask == 0] = 0
    return ids, mask


def test_greedy_generation_equals_transformers_generate(hf_dir, split):
    ids, mask = prompts()
    ours, ours_mask = generate(*split, ids, mask, jax.random.PRNGKey(0), max_new_tokens=32,
                               greedy=True, pad_token_id=0)
    with torch.no_grad():
        hf = hf_dir[1].generate(torch.tensor(ids, dtype=torch.long),
                                attention_mask=torch.tensor(mask, dtype=torch.long),
                                max_new_tokens=32, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(ours), hf[:, ids.shape[1]:].numpy())
    assert np.asarray(ours_mask).all()  # no stop tokens: every token is an action


def test_left_padding_in_a_batch_does_not_change_response_logprobs(split):
    ids, mask = prompts()
    row = ids[0:1, :]  # 7 real tokens
    alone, alone_mask = generate(*split, row, np.ones_like(row), jax.random.PRNGKey(0),
                                 max_new_tokens=12, greedy=True, pad_token_id=0)
    padded_ids = np.concatenate([np.zeros((4, 2), np.int32), np.repeat(row, 4, 0)], 1)
    padded_ids[1:] = np.concatenate([np.zeros((3, 2), np.int32), ids[1:]], 1)
    padded_mask = (padded_ids != 0).astype(np.int32)
    padded_mask[0, 2:] = 1
    batch, batch_mask = generate(*split, padded_ids, padded_mask, jax.random.PRNGKey(0),
                                 max_new_tokens=12, greedy=True, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(batch)[0], np.asarray(alone)[0])
    lp_alone = policy_logprobs(*split, row, np.ones_like(row), alone, alone_mask)
    lp_batch = policy_logprobs(*split, padded_ids, padded_mask, batch, batch_mask)
    np.testing.assert_allclose(np.asarray(lp_batch)[0], np.asarray(lp_alone)[0], atol=1e-5)


def test_response_mask_covers_tokens_through_the_first_stop_token(split):
    ids, mask = prompts()
    free, _ = generate(*split, ids, mask, jax.random.PRNGKey(0), max_new_tokens=10, greedy=True,
                       pad_token_id=0)
    free = np.asarray(free)
    stop = int(free[0, 3])  # make row 0 stop at step 3 (and others wherever it appears)
    out, out_mask = generate(*split, ids, mask, jax.random.PRNGKey(0), max_new_tokens=10,
                             greedy=True, stop_token_ids=[stop], pad_token_id=0)
    out, out_mask = np.asarray(out), np.asarray(out_mask)
    for b in range(4):
        hits = np.flatnonzero(free[b] == stop)
        end = hits[0] + 1 if len(hits) else 10
        np.testing.assert_array_equal(out_mask[b], np.arange(10) < end)
        np.testing.assert_array_equal(out[b, :end], free[b, :end])  # same tokens up to the stop
        assert (out[b, end:] == 0).all()  # padding after it
    assert out_mask[0].sum() <= 4


def test_sampling_is_reproducible_and_respects_top_k(split):
    ids, mask = prompts()
    a, _ = generate(*split, ids, mask, jax.random.PRNGKey(1), max_new_tokens=6, top_k=1, pad_token_id=0)
    g, _ = generate(*split, ids, mask, jax.random.PRNGKey(2), max_new_tokens=6, greedy=True, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(g))  # top-1 sampling is greedy
    s1, _ = generate(*split, ids, mask, jax.random.PRNGKey(3), max_new_tokens=6, temperature=2.0, pad_token_id=0)
    s2, _ = generate(*split, ids, mask, jax.random.PRNGKey(3), max_new_tokens=6, temperature=2.0, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))


def test_filter_logits_matches_a_numpy_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 50)).astype(np.float32) * 3
    for top_k, top_p, temp in [(0, 0.9, 0.7), (10, 1.0, 1.0), (10, 0.5, 1.3), (0, 1.0, 1.0)]:
        out = np.asarray(filter_logits(jnp.asarray(logits), temperature=temp, top_k=top_k, top_p=top_p))
        for row, got in zip(logits / temp, out):
            keep = np.ones(50, bool)
            if top_k:
                keep &= row >= np.sort(row)[-top_k]
            masked = np.where(keep, row, -np.inf)
            order = np.argsort(-masked)
            probs = np.exp(masked[order] - masked[order][0])
            probs /= probs.sum()
            before = np.cumsum(probs) - probs
            kept = order[before < top_p] if top_p < 1.0 else order
            want = np.zeros(50, bool)
            want[kept] = True
            want &= keep
            np.testing.assert_array_equal(got > -1e29, want, err_msg=f"{top_k} {top_p}")
            np.testing.assert_allclose(got[want], row[want], rtol=1e-6)


def test_bad_arguments_raise_before_compiling(split):
    ids, mask = prompts()
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(*split, ids, mask, jax.random.PRNGKey(0), max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        generate(*split, ids, mask, jax.random.PRNGKey(0), max_new_tokens=2, temperature=0.0)
    with pytest.raises(ValueError, match="prompt_mask"):
        generate(*split, ids, mask[:, :3], jax.random.PRNGKey(0), max_new_tokens=2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=2.5), "max_new_tokens=2.5 must be an int"),
    (dict(max_new_tokens="4"), "max_new_tokens='4' must be an int"),
    (dict(top_k=2.7), "top_k=2.7 must be an int"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(temperature=float("inf")), "temperature=inf must be a finite number"),
    (dict(stop_token_ids=2), "stop_token_ids=2 must be a sequence"),
    (dict(stop_token_ids=(1.9,)), "stop_token_ids: 1.9 is not an int"),
    (dict(stop_token_ids=(VOCAB,)), rf"stop_token_ids: {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids: -1 is outside"),
    (dict(pad_token_id=None), "pad_token_id: None is not an int"),
    (dict(pad_token_id=999), "pad_token_id: 999 is outside"),
    (dict(cache_dtype="int8"), "cache_dtype='int8' must be a float dtype"),
    (dict(cache_dtype="int4x"), "cache_dtype='int4x' is not a dtype"),
    (dict(rng=0), "rng must be a PRNG key"),
    (dict(rng=None), "rng is required for sampling"),
])
def test_bad_settings_name_the_field_before_compiling(split, kwargs, match):
    from ppo_jax.rollout import static_batch

    ids, mask = prompts()
    args = {"rng": jax.random.PRNGKey(0), "max_new_tokens": 2, "pad_token_id": 0, **kwargs}
    compiled = static_batch._generate._cache_size()
    with pytest.raises(ValueError, match=match):
        generate(*split, ids, mask, args.pop("rng"), **args)
    assert static_batch._generate._cache_size() == compiled


def test_bad_prompts_name_the_problem(split):
    ids, mask = prompts()
    rng = jax.random.PRNGKey(0)

    def call(i, m):
        return generate(*split, i, m, rng, max_new_tokens=2, greedy=True, pad_token_id=0)

    oov = ids.copy()
    oov[1, 0] = VOCAB  # even a padding position: it is embedded and would turn the row to NaN
    with pytest.raises(ValueError, match=rf"prompt_ids\[1, 0\] = {VOCAB} is outside the vocabulary"):
        call(oov, mask)
    neg = ids.copy()
    neg[0, 3] = -1
    with pytest.raises(ValueError, match=r"prompt_ids\[0, 3\] = -1"):
        call(neg, mask)
    with pytest.raises(ValueError, match="0 and 1 only"):
        call(ids, mask * 2)
    with pytest.raises(ValueError, match="prompt_mask must be integer or bool"):
        call(ids, mask.astype(np.float32))
    with pytest.raises(ValueError, match="left-padded.*row 1"):
        call(ids, mask[:, ::-1].copy())  # right padding
    empty = mask.copy()
    empty[2] = 0
    with pytest.raises(ValueError, match="row 2 of prompt_mask is all 0"):
        call(ids, empty)
    with pytest.raises(ValueError, match="at least one column"):
        call(ids[:, :0], mask[:, :0])
    out, _ = call(ids.tolist(), mask.tolist())  # nested lists are fine
    assert np.asarray(out).shape == (4, 2)
    out, _ = generate(*split, ids, mask.astype(bool), None, max_new_tokens=2, greedy=True,
                      temperature=0.0)  # greedy needs no key and ignores the temperature
    assert np.asarray(out).shape == (4, 2)


def test_n_tokens_take_the_prefill_and_n_minus_1_passes(split, monkeypatch):
    """The last sampled token is not run through the model; a batch that stops at its first
    token runs the prefill only."""
    from ppo_jax.models.llama import LlamaBackbone

    calls = []
    original = LlamaBackbone.run  # `__call__` (the prefill) runs it too

    def counted(self, input_ids, *a, **kw):
        jax.debug.callback(lambda: calls.append(1))
        return original(self, input_ids, *a, **kw)

    monkeypatch.setattr(LlamaBackbone, "run", counted)
    ids, mask = prompts()
    free, _ = generate(*split, ids, mask, None, max_new_tokens=5, greedy=True, pad_token_id=0)
    jax.effects_barrier()
    assert len(calls) == 1 + 4
    calls.clear()
    first = np.asarray(free)[:, 0]
    out, out_mask = generate(*split, ids, mask, None, max_new_tokens=5, greedy=True,
                             stop_token_ids=sorted({int(t) for t in first}), pad_token_id=0)
    jax.effects_barrier()
    assert len(calls) == 1
    np.testing.assert_array_equal(np.asarray(out)[:, 0], first)
    np.testing.assert_array_equal(np.asarray(out_mask), np.arange(5)[None].repeat(4, 0) < 1)
    one, _ = generate(*split, ids, mask, None, max_new_tokens=1, greedy=True, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(one)[:, 0], first)


def test_ended_rows_needs_a_stop_token_and_a_real_token():
    ids = jnp.asarray([[5, 2, 0], [5, 6, 7], [2, 0, 0], [2, 2, 2]], jnp.int32)
    mask = jnp.asarray([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 1, 1]], jnp.int32)
    np.testing.assert_array_equal(ended_rows(ids, mask, (2,)), [True, False, False, True])
    np.testing.assert_array_equal(ended_rows(ids, mask, (7, 9)), [False, True, False, False])
    np.testing.assert_array_equal(ended_rows(ids, mask, ()), [False] * 4)
