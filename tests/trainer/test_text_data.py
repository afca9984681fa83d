"""SFT and preference data: row formats, errors, prompt tokens shared with PPO, truncation and
padding, masks."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from ppo_jax.trainer.data.prompts import apply_template, read_prompts
from ppo_jax.trainer.data.text import (
    PairBatch, PreferencePair, SequenceBatch, SFTExample, encode_prompt, encode_response,
    padded_rows, preference_pairs, read_records, sft_examples, split_holdout, take, tokenize_pairs,
    tokenize_sft,
)

# Tiny word-level vocabulary (ppo_jax.models.tiny_random): pad 0, eos 1, bos 2.
EOS, BOS, USER, ASSISTANT, SYSTEM, COLON = 1, 2, 200, 201, 202, 207
THE, BUS, WAS, LATE, A, TRAIN, GOOD = 4, 143, 23, 114, 5, 142, 76
# "<bos> user : the bus <eos> <bos> assistant :" (the chat template with a generation prompt)
PROMPT_THE_BUS = [BOS, USER, COLON, THE, BUS, EOS, BOS, ASSISTANT, COLON]
PROMPT_A_TRAIN = [BOS, USER, COLON, A, TRAIN, EOS, BOS, ASSISTANT, COLON]
LIMITS = dict(max_prompt_length=32, max_length=64, eos_id=EOS, pad_id=0)


def user(text):
    return [{"role": "user", "content": text}]


def assistant(text):
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from ppo_jax.models import load_tokenizer

    return load_tokenizer(tiny_checkpoint)


# --- tokens -----------------------------------------------------------------------------------

def test_loss_mask_covers_exactly_the_response_and_eos(tokenizer):
    examples = [SFTExample(user("the bus"), "was late"), SFTExample(user("a train"), "good")]
    batch, counts = tokenize_sft(examples, tokenizer, **LIMITS)
    np.testing.assert_array_equal(batch.ids, [PROMPT_THE_BUS + [WAS, LATE, EOS],
                                              PROMPT_A_TRAIN + [GOOD, EOS, 0]])
    np.testing.assert_array_equal(batch.attention_mask, [[1] * 12, [1] * 11 + [0]])
    np.testing.assert_array_equal(batch.loss_mask, [[0] * 9 + [1, 1, 1], [0] * 9 + [1, 1, 0]])
    assert batch.ids.dtype == batch.attention_mask.dtype == batch.loss_mask.dtype == np.int32
    assert counts == {"prompts_truncated": 0, "responses_truncated": 0} and len(batch) == 2


def test_response_tokens_end_with_the_stop_token_and_no_bos(tokenizer):
    assert encode_response(tokenizer, "was late", EOS) == [WAS, LATE, EOS]


@pytest.mark.parametrize("use_chat_template", [True, False])
@pytest.mark.parametrize("system_prompt", [None, "be calm"])
def test_prompt_ids_equal_ppo_prompt_ids(tokenizer, use_chat_template, system_prompt):
    ours = encode_prompt(tokenizer, user("the bus"), use_chat_template=use_chat_template,
                         system_prompt=system_prompt)
    assert ours == apply_template(tokenizer, "the bus", use_chat_template, system_prompt)
    if use_chat_template and system_prompt is None:
        assert ours == PROMPT_THE_BUS
    if not use_chat_template:
        assert ours == [THE, BUS]


def test_system_prompt_is_not_added_when_the_messages_have_a_system_turn(tokenizer):
    messages = [{"role": "system", "content": "the"}] + user("bus")
    ids = encode_prompt(tokenizer, messages, use_chat_template=True, system_prompt="be calm")
    assert ids[:5] == [BOS, SYSTEM, COLON, THE, EOS] and ids.count(SYSTEM) == 1


def test_messages_and_prompt_response_rows_give_identical_batches(tokenizer):
    flat = [{"prompt": "the bus", "response": "was late"},
            {"prompt": user("a train"), "response": "good"}]
    chat = [{"messages": user("the bus") + [assistant("was late")]},
            {"messages": user("a train") + [assistant("good")]}]
    a = sft_examples(flat, "f.jsonl", "sft.data")
    b = sft_examples(chat, "c.jsonl", "sft.data")
    assert a == b == [SFTExample(user("the bus"), "was late", record=0),
                      SFTExample(user("a train"), "good", record=1)]
    ba, _ = tokenize_sft(a, tokenizer, **LIMITS)
    bb, _ = tokenize_sft(b, tokenizer, **LIMITS)
    for name in ("ids", "attention_mask", "loss_mask"):
        np.testing.assert_array_equal(getattr(ba, name), getattr(bb, name))


# --- padded rows ------------------------------------------------------------------------------

def test_truncation_keeps_the_last_prompt_tokens_then_the_first_response_tokens():
    rows = [([10, 11, 12, 13, 14, 15], [20, 21, 22]), ([30, 31], [40])]
    with pytest.warns(UserWarning) as record:
        batch, counts = padded_rows(rows, max_prompt_length=4, max_length=6, pad_id=0)
    messages = [str(w.message) for w in record]
    assert any("1 example(s) had a prompt longer than max_prompt_length=4" in m for m in messages)
    assert any("1 example(s) longer than max_length=6 lost response tokens" in m for m in messages)
    assert counts == {"prompts_truncated": 1, "responses_truncated": 1}
    np.testing.assert_array_equal(batch.ids, [[12, 13, 14, 15, 20, 21], [30, 31, 40, 0, 0, 0]])
    np.testing.assert_array_equal(batch.loss_mask, [[0, 0, 0, 0, 1, 1], [0, 0, 1, 0, 0, 0]])
    np.testing.assert_array_equal(batch.attention_mask, [[1] * 6, [1, 1, 1, 0, 0, 0]])


def test_pack_width_is_the_longest_row_or_the_width_asked_for():
    rows = [([5, 6], [7])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing truncated, nothing warned
        assert padded_rows(rows, max_prompt_length=4, max_length=8, pad_id=0)[0].ids.shape == (1, 3)
        wide, _ = padded_rows(rows, max_prompt_length=4, max_length=8, pad_id=9, width=8)
    np.testing.assert_array_equal(wide.ids, [[5, 6, 7, 9, 9, 9, 9, 9]])
    with pytest.raises(ValueError, match="row 0 has 3 tokens, more than the width 2"):
        padded_rows(rows, max_prompt_length=4, max_length=8, pad_id=0, width=2)


def test_pack_rejects_no_room_for_a_response_and_empty_rows():
    with pytest.raises(ValueError, match="max_prompt_length=8 must be in"):
        padded_rows([([1], [2])], max_prompt_length=8, max_length=8, pad_id=0)
    with pytest.raises(ValueError, match="example of record 1 has an empty response"):
        padded_rows([([1], [2]), ([1], [])], max_prompt_length=4, max_length=8, pad_id=0)
    with pytest.raises(ValueError, match="chosen of record 7 has an empty prompt"):
        padded_rows([([], [2])], max_prompt_length=4, max_length=8, pad_id=0, what="chosen",
                    records=[7])


def test_truncation_error_refuses_a_longer_prompt_naming_its_record():
    rows = [([1, 2], [3]), ([1, 2, 3, 4, 5], [6])]
    with pytest.raises(ValueError, match=r"example of record 4: its prompt of 5 tokens is longer "
                                         r"than data.max_prompt_length=4 \(data.truncation='error'\)"):
        padded_rows(rows, max_prompt_length=4, max_length=8, pad_id=0, truncation="error",
                    records=[3, 4])
    with pytest.warns(UserWarning, match="1 example"):  # the default cuts it from the left
        batch, _ = padded_rows(rows, max_prompt_length=4, max_length=8, pad_id=0, records=[3, 4])
    np.testing.assert_array_equal(batch.ids[1, :5], [2, 3, 4, 5, 6])


# --- preference pairs -------------------------------------------------------------------------

def test_chosen_and_rejected_share_the_prompt_and_the_width(tokenizer):
    pairs = [PreferencePair(user("the bus"), "good", "was late", 0.0),
             PreferencePair(user("a train"), "was late", "good", 1.5)]
    batch, counts = tokenize_pairs(pairs, tokenizer, **LIMITS)
    assert batch.chosen.ids.shape == batch.rejected.ids.shape == (2, 12) and len(batch) == 2
    np.testing.assert_array_equal(batch.chosen.ids[0], PROMPT_THE_BUS + [GOOD, EOS, 0])
    np.testing.assert_array_equal(batch.rejected.ids[0], PROMPT_THE_BUS + [WAS, LATE, EOS])
    np.testing.assert_array_equal(batch.chosen.loss_mask[1], [0] * 9 + [1, 1, 1])
    np.testing.assert_array_equal(batch.rejected.attention_mask[1], [1] * 11 + [0])
    np.testing.assert_array_equal(batch.margin, np.array([0.0, 1.5], np.float32))
    assert batch.margin.dtype == np.float32
    assert counts == {"prompts_truncated": 0, "chosen_truncated": 0, "rejected_truncated": 0,
                      "identical_after_truncation": 0}


def test_pairs_identical_after_truncation_are_dropped_counted_and_warned(tokenizer):
    pairs = [PreferencePair(user("the bus"), "was late", "was good", 0.0),
             PreferencePair(user("the bus"), "good", "late", 2.0)]
    with pytest.warns(UserWarning) as record:
        batch, counts = tokenize_pairs(pairs, tokenizer, max_prompt_length=8, max_length=9,
                                       eos_id=EOS, pad_id=0)
    assert sorted(str(w.message) for w in record) == [
        "2 pair(s) had a prompt longer than max_prompt_length=8, truncated from the left",
        "2 pair(s) longer than max_length=9 lost chosen tokens from the right",
        "2 pair(s) longer than max_length=9 lost rejected tokens from the right",
        "skipped 1 pair(s) whose chosen and rejected are identical tokens after tokenisation "
        "and truncation to max_length=9"]
    assert counts == {"prompts_truncated": 2, "chosen_truncated": 2, "rejected_truncated": 2,
                      "identical_after_truncation": 1}
    assert len(batch) == 1 and batch.margin.tolist() == [2.0]  # the second pair is what is left
    np.testing.assert_array_equal(batch.chosen.ids, [PROMPT_THE_BUS[1:] + [GOOD]])
    with warnings.catch_warnings(), pytest.raises(ValueError, match="every pair has identical"):
        warnings.simplefilter("ignore")  # the truncation warnings, seen above
        tokenize_pairs(pairs[:1], tokenizer, max_prompt_length=8, max_length=9, eos_id=EOS, pad_id=0)


def test_strings_that_tokenise_alike_are_an_identical_pair(tokenizer):
    pairs = [PreferencePair(user("the bus"), "was good", "was  good ", 0.0),
             PreferencePair(user("the bus"), "good", "late", 0.0)]
    with pytest.warns(UserWarning, match="skipped 1 pair"):
        batch, counts = tokenize_pairs(pairs, tokenizer, **LIMITS)
    assert counts["identical_after_truncation"] == 1 and len(batch) == 1


def test_implicit_prompt_rows_equal_explicit_prompt_rows():
    explicit = [{"prompt": "the bus", "chosen": "good", "rejected": "was late", "margin": 2},
                {"prompt": user("a train"), "chosen": [assistant("good")], "rejected": "late"}]
    implicit = [{"chosen": user("the bus") + [assistant("good")],
                 "rejected": user("the bus") + [assistant("was late")], "margin": 2},
                {"chosen": user("a train") + [assistant("good")],
                 "rejected": user("a train") + [assistant("late")]}]
    a, skipped_a = preference_pairs(explicit, "e.jsonl", "reward.data")
    b, skipped_b = preference_pairs(implicit, "i.jsonl", "reward.data")
    assert a == b == [PreferencePair(user("the bus"), "good", "was late", 2.0, record=0),
                      PreferencePair(user("a train"), "good", "late", 0.0, record=1)]
    assert skipped_a == skipped_b == 0


def test_identical_pairs_are_skipped_counted_and_warned():
    rows = [{"prompt": "p", "chosen": "same", "rejected": "same"},
            {"prompt": "q", "chosen": "good", "rejected": "bad"},
            {"prompt": "r", "chosen": "x", "rejected": "x"}]
    with pytest.warns(UserWarning, match="reward.data: skipped 2 pair\\(s\\) of prefs.jsonl"):
        pairs, skipped = preference_pairs(rows, "prefs.jsonl", "reward.data")
    assert skipped == 2 and pairs == [PreferencePair(user("q"), "good", "bad", 0.0, record=1)]


# --- errors name the file, the record and the field -------------------------------------------

SFT_ERRORS = [
    ({"prompt": "p"}, "record 1 of sft.jsonl: 'response' is missing"),
    ({"response": "r"}, "record 1 of sft.jsonl: 'prompt' is missing"),
    ({"prompt": "p", "response": "  "}, "record 1 of sft.jsonl: 'response' is empty"),
    ({"prompt": 3, "response": "r"}, "record 1 of sft.jsonl: 'prompt' is int 3"),
    ({"messages": user("p")}, "record 1 of sft.jsonl: 'messages' ends with a 'user' message"),
    ({"messages": [{"content": "p"}, assistant("r")]},
     "record 1 of sft.jsonl: 'messages\\[0\\]' is .* not a message with 'role' and 'content'"),
    ({"messages": [assistant("r")]}, "record 1 of sft.jsonl: 'messages' has no turn before"),
    ({"messages": user("p") + [assistant("")]}, "record 1 of sft.jsonl: 'messages\\[1\\].content' is empty"),
    ({"messages": [{"role": "human", "content": "p"}, assistant("r")]},
     "record 1 of sft.jsonl: 'messages\\[0\\]' has role 'human'"),
]


@pytest.mark.parametrize("bad,match", SFT_ERRORS)
def test_bad_sft_rows_name_the_file_record_and_field(bad, match):
    with pytest.raises(ValueError, match="sft.data: " + match):
        sft_examples([{"prompt": "fine", "response": "fine"}, bad], "sft.jsonl", "sft.data")


PAIR_ERRORS = [
    ({"prompt": "p", "rejected": "r"}, "'chosen' is missing"),
    ({"prompt": "p", "chosen": 5, "rejected": "r"}, "'chosen' is int 5, not a string or"),
    ({"prompt": "p", "chosen": "c", "rejected": ""}, "'rejected' is empty"),
    ({"prompt": "p", "chosen": "c", "rejected": "r", "margin": "big"}, "'margin' is str 'big'"),
    ({"prompt": "p", "chosen": "c", "rejected": "r", "margin": True}, "'margin' is bool"),
    ({"chosen": "c", "rejected": "r"}, "'chosen' is a string but the row has no 'prompt'"),
    ({"chosen": user("p") + [assistant("c")], "rejected": user("q") + [assistant("r")]},
     "'rejected' turns before the response differ"),
    ({"chosen": user("p") + [assistant("c")], "rejected": user("p")},
     "'rejected' ends with a 'user' message"),
    ({"prompt": "p", "chosen": user("p") + [assistant("c")], "rejected": "r"},
     "'chosen' holds earlier turns next to a 'prompt'"),
]


@pytest.mark.parametrize("bad,match", PAIR_ERRORS)
def test_bad_preference_rows_name_the_file_record_and_field(bad, match):
    good = {"prompt": "fine", "chosen": "yes", "rejected": "no"}
    with pytest.raises(ValueError, match="reward.data: record 1 of prefs.jsonl: " + match):
        preference_pairs([good, bad], "prefs.jsonl", "reward.data")


def test_read_records_errors_name_the_key_file_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="sft.data: data file not found: .*none.jsonl"):
        read_records(tmp_path / "none.jsonl", "sft.data")
    (tmp_path / "a.jsonl").write_text('{"prompt": "p"}\n\n{"prompt": \n')
    with pytest.raises(ValueError, match="sft.data: .*a.jsonl is not valid JSONL \\(line 3"):
        read_records(tmp_path / "a.jsonl", "sft.data")
    (tmp_path / "b.jsonl").write_text('{"prompt": "p"}\n"just text"\n')
    with pytest.raises(ValueError, match="record 1 of .*b.jsonl is str 'just text', not an object"):
        read_records(tmp_path / "b.jsonl", "sft.data")
    (tmp_path / "c.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="sft.data: no records in .*c.jsonl"):
        read_records(tmp_path / "c.jsonl", "sft.data")
    (tmp_path / "d.json").write_text('{"prompt": "p"}')
    with pytest.raises(ValueError, match="d.json holds a JSON dict; expected a list of objects"):
        read_records(tmp_path / "d.json", "sft.data")
    (tmp_path / "e.txt").write_text("p\n")
    with pytest.raises(ValueError, match="unsupported data file type '.txt' "
                                         "\\(use .jsonl, .json or .parquet\\)"):
        read_records(tmp_path / "e.txt", "sft.data")


def test_read_prompts_reads_through_the_shared_reader_with_its_own_messages(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"prompt": "p"}\n{oops\n')
    with pytest.raises(ValueError, match="data.prompts: .*a.jsonl is not valid JSONL \\(line 2"):
        read_prompts(tmp_path / "a.jsonl")
    (tmp_path / "b.json").write_text('{"prompt": "p"}')
    with pytest.raises(ValueError, match="expected a list of prompt strings or records"):
        read_prompts(tmp_path / "b.json")
    (tmp_path / "c.csv").write_text("p\n")
    with pytest.raises(ValueError, match="unsupported prompt file type '.csv' "
                                         "\\(use .jsonl, .json, .txt or .parquet\\)"):
        read_prompts(tmp_path / "c.csv")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["p"]}), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match="data.prompt_field='prompt': no such column .*\\['text'\\]"):
        read_prompts(tmp_path / "d.parquet")


def test_parquet_and_json_rows_read_the_same(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"chosen": user("the bus") + [assistant("good")],
             "rejected": user("the bus") + [assistant("late")], "margin": 1.0},
            {"chosen": user("a train") + [assistant("slow")],
             "rejected": user("a train") + [assistant("fine")], "margin": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    (tmp_path / "p.json").write_text(json.dumps(rows))
    from_parquet = read_records(tmp_path / "p.parquet", "reward.data")
    assert from_parquet == read_records(tmp_path / "p.json", "reward.data") == rows
    pairs, _ = preference_pairs(from_parquet, tmp_path / "p.parquet", "reward.data")
    assert [p.margin for p in pairs] == [1.0, 0.0] and pairs[1].prompt == user("a train")


# --- splits and row selection -----------------------------------------------------------------

def test_split_holdout_is_deterministic_disjoint_and_complete():
    train, held = split_holdout(20, 0.25, seed=3)
    again = split_holdout(20, 0.25, seed=3)
    np.testing.assert_array_equal(train, again[0])
    np.testing.assert_array_equal(held, again[1])
    assert len(held) == 5 and not set(train) & set(held)
    assert sorted(np.concatenate([train, held]).tolist()) == list(range(20))
    assert not np.array_equal(held, split_holdout(20, 0.25, seed=4)[1])


def test_split_holdout_sizes_and_errors():
    assert len(split_holdout(2, 0.01, seed=0)[1]) == 1  # at least one eval row
    train, held = split_holdout(5, 0.0, seed=0)
    assert train.tolist() == [0, 1, 2, 3, 4] and held.size == 0
    for fraction in (-0.1, 1.0):
        with pytest.raises(ValueError, match="must be in \\[0, 1\\)"):
            split_holdout(10, fraction, seed=0)
    with pytest.raises(ValueError, match="leave none for training"):
        split_holdout(1, 0.9, seed=0)


def test_take_selects_the_same_rows_of_every_field():
    seqs = SequenceBatch(np.arange(12, dtype=np.int32).reshape(3, 4), np.ones((3, 4), np.int32),
                         np.eye(3, 4, dtype=np.int32))
    picked = take(seqs, np.array([2, 0]))
    assert isinstance(picked, SequenceBatch)
    np.testing.assert_array_equal(picked.ids, [[8, 9, 10, 11], [0, 1, 2, 3]])
    np.testing.assert_array_equal(picked.loss_mask, [[0, 0, 1, 0], [1, 0, 0, 0]])
    pairs = take(PairBatch(seqs, take(seqs, np.array([1, 2, 0])), np.array([0.5, 1.0, 2.0], np.float32)),
                 np.array([1]))
    assert isinstance(pairs, PairBatch) and len(pairs) == 1
    np.testing.assert_array_equal(pairs.rejected.ids, [[8, 9, 10, 11]])
    np.testing.assert_array_equal(pairs.margin, [1.0])
    arrays = take({"ids": seqs.ids, "weight": np.array([1.0, 2.0, 3.0])}, np.array([2]))
    np.testing.assert_array_equal(arrays["weight"], [3.0])


def test_a_truncated_response_gets_no_stop_token(tokenizer, tmp_path):
    """A sampled response cut at max_new_tokens has no stop token in PPO's rollouts either."""
    rows = [{"prompt": "the bus", "response": "was late", "truncated": True},
            {"prompt": "the bus", "chosen": "was late", "rejected": "good", "rejected_truncated": True}]
    (sft,) = sft_examples(rows[:1], tmp_path / "a.jsonl", "sft.data")
    batch, _ = tokenize_sft([sft], tokenizer, **LIMITS)
    assert batch.ids[0].tolist() == PROMPT_THE_BUS + [WAS, LATE]
    assert batch.loss_mask[0].tolist() == [0] * 9 + [1, 1]
    (pair,), _ = preference_pairs(rows[1:], tmp_path / "b.jsonl", "reward_model.data")
    pairs, _ = tokenize_pairs([pair], tokenizer, **LIMITS)
    assert pairs.chosen.ids[0, 9:].tolist() == [WAS, LATE, EOS]
    assert pairs.rejected.ids[0, 9:].tolist() == [GOOD, 0, 0]
    with pytest.raises(ValueError, match=r"record 0 .*'truncated' is str"):
        sft_examples([{"prompt": "x", "response": "y", "truncated": "yes"}], tmp_path / "c.jsonl", "sft.data")
    # eos_after_truncated: every row ends in EOS (what reward.eos_at_end scores)
    batch, _ = tokenize_sft([sft], tokenizer, **LIMITS, eos_after_truncated=True)
    assert batch.ids[0].tolist() == PROMPT_THE_BUS + [WAS, LATE, EOS]
    pairs, _ = tokenize_pairs([pair], tokenizer, **LIMITS, eos_after_truncated=True)
    assert pairs.rejected.ids[0, 9:].tolist() == [GOOD, EOS, 0]


def test_a_message_list_prompt_without_text_is_an_error_naming_the_record():
    rows = [{"prompt": "the bus", "response": "good"},
            {"prompt": [{"role": "system", "content": " "}, {"role": "user", "content": ""}],
             "response": "good"}]
    with pytest.raises(ValueError, match=r"sft.data: record 1 of f.jsonl: 'prompt' has no text"):
        sft_examples(rows, "f.jsonl", "sft.data")
    pair = {"prompt": [{"role": "user", "content": ""}], "chosen": "good", "rejected": "bad"}
    with pytest.raises(ValueError, match=r"record 0 of p.jsonl: 'prompt' has no text"):
        preference_pairs([pair], "p.jsonl", "reward_model.data")
