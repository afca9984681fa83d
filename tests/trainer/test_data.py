"""Prompt files, chat template, left padding, truncation and the resumable order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ppo_jax.trainer.data.order import DataOrder
from ppo_jax.trainer.data.prompts import left_pad, read_prompts, tokenize_prompts


def test_read_prompts_from_every_format(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"prompt": "x y"}\n\n{"prompt": "z"}\n')
    (tmp_path / "a.json").write_text(json.dumps([{"q": "x y"}, {"q": "z"}]))
    (tmp_path / "a.txt").write_text("x y\n\nz\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["x y", "z"]}), tmp_path / "a.parquet")
    assert read_prompts(tmp_path / "a.jsonl") == ["x y", "z"]
    assert read_prompts(tmp_path / "a.json", field="q") == ["x y", "z"]
    assert read_prompts(tmp_path / "a.txt") == ["x y", "z"]
    assert read_prompts(tmp_path / "a.parquet") == ["x y", "z"]


def test_read_prompts_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="'prompt'"):
        read_prompts(tmp_path / "b.jsonl")
    (tmp_path / "c.csv").write_text("x\n")
    with pytest.raises(ValueError, match=".csv"):
        read_prompts(tmp_path / "c.csv")
    (tmp_path / "d.jsonl").write_text('{"prompt": "fine"}\n{"prompt": 42}\n')
    with pytest.raises(ValueError, match="record 1 of .*d.jsonl: 'prompt' is int 42, not a string"):
        read_prompts(tmp_path / "d.jsonl")
    (tmp_path / "e.json").write_text(json.dumps([{"prompt": "a"}, {"prompt": None}]))
    with pytest.raises(ValueError, match="record 1 .*NoneType None"):
        read_prompts(tmp_path / "e.json")
    (tmp_path / "f.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "  "}\n')
    with pytest.raises(ValueError, match="record 1 of .*f.jsonl: 'prompt' is empty"):
        read_prompts(tmp_path / "f.jsonl")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", None]}), tmp_path / "g.parquet")
    with pytest.raises(ValueError, match="record 1 of .*g.parquet"):
        read_prompts(tmp_path / "g.parquet")


def test_left_pad():
    ids, mask = left_pad([[5, 6], [7], []], 3, pad_token_id=0)
    np.testing.assert_array_equal(ids, [[0, 5, 6], [0, 0, 7], [0, 0, 0]])
    np.testing.assert_array_equal(mask, [[0, 1, 1], [0, 0, 1], [0, 0, 0]])


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from ppo_jax.models import load_tokenizer

    return load_tokenizer(tiny_checkpoint)


def test_chat_template_is_applied_and_prompts_are_left_padded(tokenizer):
    ps = tokenize_prompts(["the bus", "the long train trip was very slow"], tokenizer,
                          max_prompt_length=64, pad_token_id=0)
    text = tokenizer.decode(ps.ids[0][ps.mask[0] > 0].tolist())
    assert text.startswith("<bos> user : the bus <eos>") and text.endswith("assistant :")
    assert ps.mask[0, 0] == 0 and ps.mask[1].all() and ps.mask[:, -1].all()


def test_long_prompts_are_truncated_from_the_left_with_a_warning(tokenizer):
    with pytest.warns(UserWarning, match="1 prompt"):
        ps = tokenize_prompts(["good " * 20], tokenizer, max_prompt_length=8, pad_token_id=0,
                              use_chat_template=False)
    assert ps.ids.shape == (1, 8)


def test_long_prompts_are_rejected_when_configured(tokenizer):
    with pytest.raises(ValueError, match="prompt 0 has 20 tokens"):
        tokenize_prompts(["good " * 20], tokenizer, max_prompt_length=8, truncation="error",
                         pad_token_id=0, use_chat_template=False)


def test_sampler_order_is_deterministic_and_resumable():
    a = DataOrder(10, seed=3)
    first = [a.next_indices(4) for _ in range(5)]  # crosses two epoch boundaries
    b = DataOrder(10, seed=3, position=8)
    np.testing.assert_array_equal(b.next_indices(4), first[2])
    epoch0 = np.concatenate(first)[:10]
    assert sorted(epoch0.tolist()) == list(range(10))  # each epoch is a permutation


def test_sampler_splits_a_global_batch_between_processes():
    whole = DataOrder(16, seed=0).next_indices(8)
    parts = [DataOrder(16, seed=0).next_indices(8, process_index=i, process_count=2) for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
