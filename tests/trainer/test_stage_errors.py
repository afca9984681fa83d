"""Bad input to stages 1-3 of the pipeline: a clear error naming the file, record and field (or
the config key), raised before anything is written to the run directory."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402

TINY = ROOT / "configs/tiny.yaml"
PROMPTS = f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}"


def run(tmp_path, *sets) -> int:
    args = ["--config", str(TINY), "--set", "train.progress=false"]
    for s in sets:
        args += ["--set", s]
    return train.main(args)


@pytest.mark.parametrize("row, match", [
    ({"prompt": "the bus", "rejected": "bad"}, r"record 1.*'chosen'"),
    ({"prompt": "the bus", "chosen": 3, "rejected": "bad"}, r"record 1.*'chosen'"),
    ({"prompt": "the bus", "chosen": "good", "rejected": {"a": 1}}, r"record 1.*'rejected'"),
])
def test_bad_pair_rows_name_file_record_and_field_and_write_nothing(row, match, tiny_checkpoint, tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "a train", "chosen": "good", "rejected": "bad"}) + "\n"
                    + json.dumps(row) + "\n")
    out = tmp_path / "run"
    assert run(tmp_path, "stage=reward_model", f"model.reward_model={tiny_checkpoint}",
               f"reward_model.data={data}", f"train.output_dir={out}") == 2
    err = capsys.readouterr().err
    assert str(data) in err and __import__("re").search(match, err), err
    assert not out.exists()


def test_empty_sft_response_is_an_error_naming_the_record(tiny_checkpoint, tmp_path, capsys):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "the bus", "response": "it was good"}) + "\n"
                    + json.dumps({"prompt": "a train", "response": "  "}) + "\n")
    out = tmp_path / "run"
    assert run(tmp_path, "stage=sft", f"model.actor={tiny_checkpoint}", f"sft.data={data}",
               f"train.output_dir={out}") == 2
    err = capsys.readouterr().err
    assert str(data) in err and "record 1" in err and "response" in err
    assert not out.exists()


def test_identical_pairs_are_skipped_and_counted_and_long_prompts_truncated(tiny_checkpoint, tmp_path):
    from ppo_jax.trainer.config import load_config
    from ppo_jax.trainer.stages.reward_model import RewardModelTrainer

    long_prompt = " ".join(["the bus was late"] * 20)
    rows = [{"prompt": "a train", "chosen": "good", "rejected": "good"},
            {"prompt": long_prompt, "chosen": "it was good", "rejected": "it was bad"},
            {"prompt": "the coffee", "chosen": "nice", "rejected": "awful"}]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(TINY, ["stage=reward_model", f"model.reward_model={tiny_checkpoint}",
                             f"reward_model.data={data}", "reward_model.eval_fraction=0",
                             "reward_model.batch_size=2", "reward_model.micro_batch_size=1",
                             "data.max_prompt_length=16", "reward_model.max_length=24",
                             f"train.output_dir={tmp_path / 'run'}"])
    with pytest.warns(UserWarning) as caught:
        trainer = RewardModelTrainer(cfg)
    text = " ".join(str(w.message) for w in caught)
    assert "1" in text and "identical" in text and "truncated" in text
    assert len(trainer.train_data["weight"]) == 2  # the identical pair is gone
    assert int(trainer.train_data["chosen_mask"][0].sum()) <= 24


def test_a_reward_model_without_a_score_head_is_refused(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "run"
    assert run(tmp_path, f"model.actor={tiny_checkpoint}", f"model.reward_model={tiny_checkpoint}",
               "reward.kind=model", PROMPTS, f"train.output_dir={out}") == 2
    err = capsys.readouterr().err
    assert "model.reward_model" in err and "no score head" in err
    assert not out.exists()  # the run directory and its lock, made before the check, are gone


def test_a_refused_start_keeps_a_directory_that_existed_and_what_is_in_it(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    assert run(tmp_path, f"model.actor={tiny_checkpoint}", f"model.reward_model={tiny_checkpoint}",
               "reward.kind=model", PROMPTS, f"train.output_dir={out}") == 2
    assert out.is_dir() and not any(out.iterdir())  # it was there before: kept, left empty
    (out / "notes.txt").write_text("mine")
    assert run(tmp_path, f"model.actor={tiny_checkpoint}", f"model.reward_model={tiny_checkpoint}",
               "reward.kind=model", PROMPTS, f"train.output_dir={out}") == 2
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_rows_longer_than_the_model_context_are_refused(tiny_checkpoint, tmp_path, capsys):
    data = tmp_path / "sft.jsonl"
    long = " ".join(["the bus was late and"] * 120)  # 600 words, the tiny model has 512 positions
    data.write_text(json.dumps({"prompt": "the bus", "response": long}) + "\n")
    out = tmp_path / "run"
    assert run(tmp_path, "stage=sft", f"model.actor={tiny_checkpoint}", f"sft.data={data}",
               "sft.eval_fraction=0", "sft.batch_size=1", "sft.micro_batch_size=1",
               "sft.max_length=800", f"train.output_dir={out}") == 2
    err = capsys.readouterr().err
    assert "sft.max_length=800" in err and "exceed the model context 512" in err, err
    assert not out.exists()


@pytest.mark.parametrize("stage", ["sft", "reward_model"])
def test_truncation_error_refuses_a_long_prompt_naming_file_and_record(stage, tiny_checkpoint, tmp_path, capsys):
    long = " ".join(["the bus was late"] * 10)
    rows = [{"prompt": "a train", "response": "good", "chosen": "good", "rejected": "bad"},
            {"prompt": long, "response": "good", "chosen": "good", "rejected": "bad"}]
    keep = ("prompt", "response") if stage == "sft" else ("prompt", "chosen", "rejected")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({k: r[k] for k in keep}) + "\n" for r in rows))
    source = "model.actor" if stage == "sft" else "model.reward_model"
    out = tmp_path / "run"
    assert run(tmp_path, f"stage={stage}", f"{source}={tiny_checkpoint}", f"{stage}.data={data}",
               f"{stage}.eval_fraction=0", f"{stage}.batch_size=2", f"{stage}.micro_batch_size=1",
               "data.max_prompt_length=16", "data.truncation=error", f"train.output_dir={out}") == 2
    err = capsys.readouterr().err
    assert f"{stage}.data" in err and str(data) in err and "record 1" in err, err
    assert "data.truncation='error'" in err
    assert not out.exists()


def test_a_reward_model_given_without_reward_kind_model_is_an_error():
    from ppo_jax.trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.reward_model='rm' is read only with reward.kind='model'"):
        load_config(TINY, ["model.reward_model=rm"])
    load_config(TINY, ["stage=reward_model", "model.reward_model=rm", "reward_model.data=x.jsonl"])


def _reward_model_with(tokenizer, directory: Path) -> Path:
    from ppo_jax.models import init_model, save_pretrained
    from ppo_jax.models.tiny_random import tiny_config

    cfg = tiny_config(len(tokenizer))
    return save_pretrained(init_model(cfg, "reward"), cfg, directory, tokenizer)


def test_a_reward_model_with_another_vocabulary_is_refused(tiny_checkpoint, tmp_path, capsys):
    from ppo_jax.models.tiny_random import tiny_tokenizer

    bigger = tiny_tokenizer()
    bigger.add_tokens(["zebra"])
    rm = _reward_model_with(bigger, tmp_path / "rm")
    assert run(tmp_path, f"model.actor={tiny_checkpoint}", f"model.reward_model={rm}",
               "reward.kind=model", PROMPTS, f"train.output_dir={tmp_path / 'run'}") == 2
    err = capsys.readouterr().err
    assert "model.reward_model" in err and "vocab_size" in err


def test_a_reward_model_with_the_same_size_but_other_token_ids_is_refused(tiny_checkpoint, tmp_path, capsys):
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from ppo_jax.models.tiny_random import tiny_vocab

    words = tiny_vocab()
    words[10], words[11] = words[11], words[10]  # same size, two ids swapped
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")
    rm = _reward_model_with(fast, tmp_path / "rm")
    assert run(tmp_path, f"model.actor={tiny_checkpoint}", f"model.reward_model={rm}",
               "reward.kind=model", PROMPTS, f"train.output_dir={tmp_path / 'run'}") == 2
    err = capsys.readouterr().err
    assert "tokenizer differs" in err and words[10] in err


def test_normalize_needs_the_reward_models_score_statistics(tiny_checkpoint, tmp_path, capsys):
    from ppo_jax.models import load_tokenizer

    rm = _reward_model_with(load_tokenizer(tiny_checkpoint), tmp_path / "rm")
    assert run(tmp_path, f"model.actor={tiny_checkpoint}", f"model.reward_model={rm}",
               "reward.kind=model", "reward.normalize=true", PROMPTS,
               f"train.output_dir={tmp_path / 'run'}") == 2
    assert "score_mean" in capsys.readouterr().err


@pytest.mark.parametrize("sets, match", [
    (["stage=sft"], "sft.data"),
    (["stage=reward_model", "reward_model.data=x.jsonl"], "model.reward_model"),
    (["stage=rm"], "'stage': Invalid value 'rm', expected one of \\['sft', 'reward_model', 'ppo'\\]"),
    (["stage=sft", "sft.data=x.jsonl", "sft.batch_size=6", "sft.micro_batch_size=4"], "sft.batch_size=6"),
    (["stage=sft", "sft.data=x.jsonl", "sft.max_length=32", "data.max_prompt_length=32"], "no room"),
    (["ppo.critic_warmup_steps=2", "model.shared_critic=true"], "separate critic"),
    (["model.shared_critic=true", "model.critic=tiny-random"],
     "model.critic='tiny-random' cannot be used with model.shared_critic=true"),
])
def test_stage_settings_are_checked_by_the_config(sets, match):
    from ppo_jax.trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config(TINY, sets)


def test_missing_sft_file_is_named(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "run"
    assert run(tmp_path, "stage=sft", f"model.actor={tiny_checkpoint}", f"sft.data={tmp_path / 'no.jsonl'}",
               f"train.output_dir={out}") == 2
    err = capsys.readouterr().err
    assert "sft.data" in err and "no.jsonl" in err
    assert not out.exists()


def test_normalising_with_statistics_of_few_pairs_warns(tmp_path):
    from ppo_jax.trainer.loading.models import score_normalizer

    (tmp_path / "config.json").write_text(json.dumps({"score_mean": 0.5, "score_std": 0.02,
                                                      "score_pairs": 6}))
    with pytest.warns(UserWarning, match="from 6 pair\\(s\\) only"):
        assert score_normalizer(tmp_path) == (0.5, 0.02)
    (tmp_path / "config.json").write_text(json.dumps({"score_mean": 0.5, "score_std": 1.5,
                                                      "score_pairs": 35}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert score_normalizer(tmp_path) == (0.5, 1.5)
