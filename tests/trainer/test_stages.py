"""Stages 1 (SFT) and 2 (reward model) on the tiny random Llama: exact losses against
transformers, micro-batching, separability, padding independence, HF exports, resume, and the
three-stage pipeline sft -> reward_model -> ppo through train.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import train  # noqa: E402
from ppo_jax.trainer.config import load_config  # noqa: E402

torch = pytest.importorskip("torch")
TINY = ROOT / "configs/tiny.yaml"
GOOD = ["good", "great", "nice", "happy", "wonderful", "excellent", "lovely", "fun"]
BAD = ["bad", "terrible", "awful", "sad", "horrible", "boring", "ugly", "angry"]
TOPICS = ["the bus", "a train", "the coffee", "my week", "the party", "the garden", "a film",
          "the market", "the weather", "dinner", "the music", "the school"]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """SFT rows (prompt/response and chat messages) and separable pairs (good vs bad words)."""
    d = tmp_path_factory.mktemp("data")
    sft = [{"prompt": f"tell me about {t}", "response": f"{t} was {GOOD[i % 8]} and {GOOD[(i + 3) % 8]}"}
           for i, t in enumerate(TOPICS)]
    sft[1] = {"messages": [{"role": "user", "content": "tell me about a train"},
                           {"role": "assistant", "content": "a train was great"}]}
    pairs = [{"prompt": f"what do you think of {t} ?", "chosen": f"it was {GOOD[i % 8]}",
              "rejected": f"it was {BAD[(i + 1) % 8]}"} for i, t in enumerate(TOPICS * 2)]
    return {"sft": write_jsonl(d / "sft.jsonl", sft), "pairs": write_jsonl(d / "pairs.jsonl", pairs)}


def sft_cfg(tiny_checkpoint, data_dir, out, *extra):
    return load_config(TINY, ["stage=sft", f"model.actor={tiny_checkpoint}", f"sft.data={data_dir['sft']}",
                              "sft.batch_size=4", "sft.micro_batch_size=2", "sft.max_length=40",
                              "sft.lr=1e-2", "train.steps=2", f"train.output_dir={out}",
                              "train.progress=false", "train.save_every=0", *extra])


def rm_cfg(source, data_dir, out, *extra):
    return load_config(TINY, ["stage=reward_model", f"model.reward_model={source}",
                              f"reward_model.data={data_dir['pairs']}", "reward_model.batch_size=4",
                              "reward_model.micro_batch_size=2", "reward_model.max_length=40",
                              "reward_model.lr=3e-3", "reward_model.eval_fraction=0.25",
                              "train.steps=2", f"train.output_dir={out}", "train.progress=false",
                              "train.save_every=0", *extra])


def params_of(trainer):
    return jax.tree.map(np.asarray, trainer.state["model"].params)


# --- stage 1 ----------------------------------------------------------------------------------

def test_sft_loss_equals_transformers_cross_entropy_with_masked_labels(tiny_checkpoint, data_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from ppo_jax.core import nll_loss
    from ppo_jax.trainer.stages.sft import SFTTrainer, sft_logprobs

    trainer = SFTTrainer(sft_cfg(tiny_checkpoint, data_dir, tmp_path / "run", "train.export_hf=false"))
    # larger weights than the N(0, 0.02) init, so the logits (and the loss) are far from uniform
    params = jax.tree.map(lambda x: x * 8.0 if x.ndim == 2 else x, trainer.state["model"].params)
    trainer.state["model"] = trainer.state["model"].replace(params=params)
    batch = {k: v[:6] for k, v in trainer.train_data.items()}
    lp, mask, _ = sft_logprobs(trainer.model.graphdef, params, jax.tree.map(jnp.asarray, batch))
    ours = float(nll_loss(lp, mask)[0])
    out = trainer.export()
    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    labels = np.where(batch["loss_mask"] > 0, batch["ids"], -100)
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(batch["ids"], dtype=torch.long),
                    attention_mask=torch.tensor(batch["attention_mask"]),
                    labels=torch.tensor(labels, dtype=torch.long)).loss.item()
    assert ours > 1.0  # not a trivial value
    assert abs(ours - theirs) < 1e-5
    # the export's logits equal ours
    with torch.no_grad():
        hf_logits = hf(input_ids=torch.tensor(batch["ids"], dtype=torch.long),
                       attention_mask=torch.tensor(batch["attention_mask"])).logits.numpy()
    from flax import nnx

    logits, _ = nnx.merge(trainer.model.graphdef, params)(jnp.asarray(batch["ids"]),
                                                          jnp.asarray(batch["attention_mask"]))
    real = batch["attention_mask"] > 0
    np.testing.assert_allclose(np.asarray(logits)[real], hf_logits[real], atol=1e-4)


@pytest.mark.parametrize("chunk_size", [5, pytest.param(64, marks=pytest.mark.slow)])
def test_sft_loss_in_vocabulary_chunks_equals_the_full_logits(chunk_size, tiny_checkpoint, data_dir, tmp_path):
    # model.logprob_chunk_size: the loss and its gradient from blocks of the LM head (5 does not
    # divide the tiny vocabulary) equal those of the full [B, L, V] logits
    from ppo_jax.trainer.stages.sft import SFTTrainer

    full = SFTTrainer(sft_cfg(tiny_checkpoint, data_dir, tmp_path / "a"))
    chunked = SFTTrainer(sft_cfg(tiny_checkpoint, data_dir, tmp_path / "b",
                                 f"model.logprob_chunk_size={chunk_size}"))
    assert full.model.cfg.vocab_size % 5
    params = jax.tree.map(lambda x: x * 8.0 if x.ndim == 2 else x, full.state["model"].params)
    batch = jax.tree.map(jnp.asarray, {k: v[:6] for k, v in full.train_data.items()})
    n = full.denominator(batch)

    def grad_of(trainer):
        return jax.value_and_grad(lambda p: trainer.loss(full.model.graphdef, p, batch, n)[0])(params)

    (lf, gf), (lc, gc) = grad_of(full), grad_of(chunked)
    assert float(lf) > 1.0 and abs(float(lf) - float(lc)) < 1e-5
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), gf, gc)
    ef, ec = (t.eval_sums(full.model.graphdef, params, batch) for t in (full, chunked))
    np.testing.assert_allclose(float(ef["nll"]), float(ec["nll"]), rtol=1e-6)


def test_sft_micro_batched_step_equals_whole_minibatch_step(tiny_checkpoint, data_dir, tmp_path):
    from ppo_jax.trainer.stages.sft import SFTTrainer

    # lr 1e-4: Adam's first step is about lr * sign(grad), so float32 summation-order noise in
    # a near-zero gradient moves a param by at most ~2 lr; the gradients themselves must agree
    whole = SFTTrainer(sft_cfg(tiny_checkpoint, data_dir, tmp_path / "a", "sft.micro_batch_size=4", "sft.lr=1e-4"))
    micro = SFTTrainer(sft_cfg(tiny_checkpoint, data_dir, tmp_path / "b", "sft.micro_batch_size=1", "sft.lr=1e-4"))
    mw, mm = whole.step(), micro.step()
    assert mw["loss"] == pytest.approx(mm["loss"], abs=1e-6)
    assert mw["grad_norm"] == pytest.approx(mm["grad_norm"], rel=1e-5)
    assert mw["tokens"] == mm["tokens"] > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), params_of(whole), params_of(micro))


def test_sft_learns_and_evaluates_the_held_out_split(tiny_checkpoint, data_dir, tmp_path):
    from ppo_jax.trainer.stages.sft import SFTTrainer

    trainer = SFTTrainer(sft_cfg(tiny_checkpoint, data_dir, tmp_path / "run", "train.steps=6",
                                 "sft.eval_fraction=0.25"))
    assert len(trainer.eval_data["weight"]) == 3 and len(trainer.train_data["weight"]) == 9
    before = trainer.evaluate()
    history = trainer.train(progress=False)
    assert history[-1]["eval/loss"] < before["loss"] - 0.5
    assert history[-1]["eval/perplexity"] == pytest.approx(np.exp(history[-1]["eval/loss"]), rel=1e-6)
    assert history[-1]["loss"] < history[0]["loss"]


# --- stage 2 ----------------------------------------------------------------------------------

def test_reward_model_separates_a_separable_set(tiny_checkpoint, data_dir, tmp_path):
    from ppo_jax.trainer.stages.reward_model import RewardModelTrainer

    trainer = RewardModelTrainer(rm_cfg(tiny_checkpoint, data_dir, tmp_path / "run", "train.steps=24", "reward_model.lr=1e-2",
                                        "train.export_hf=false"))
    start = trainer.evaluate(trainer.train_data)
    assert start["loss"] == pytest.approx(np.log(2), abs=0.05)  # a fresh head: near-equal scores
    history = trainer.train(progress=False)
    assert trainer.evaluate(trainer.train_data)["accuracy"] == 1.0
    assert history[-1]["eval/accuracy"] == 1.0
    assert history[-1]["eval/chosen_score"] > history[-1]["eval/rejected_score"]
    for key in ("loss", "accuracy", "margin", "chosen_score", "rejected_score", "grad_norm"):
        assert np.isfinite(history[-1][key]), key


def test_reward_model_with_a_frozen_backbone_trains_the_score_head_alone(tiny_checkpoint, data_dir, tmp_path):
    from ppo_jax.trainer.stages.reward_model import RewardModelTrainer

    trainer = RewardModelTrainer(rm_cfg(tiny_checkpoint, data_dir, tmp_path / "run", "train.steps=3",
                                        "reward_model.backbone_lr_scale=0", "train.export_hf=false"))
    before = jax.tree.map(np.asarray, trainer.state["model"].params)
    history = trainer.train(progress=False)
    after = jax.tree.map(np.asarray, trainer.state["model"].params)
    assert not np.allclose(after["score"]["kernel"], before["score"]["kernel"])
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), after["backbone"], before["backbone"]))
    assert moved and not any(moved)
    assert all(np.isfinite(h["grad_norm"]) and h["grad_norm"] > 0 for h in history)


def test_pair_scores_do_not_depend_on_padding_or_neighbours(tiny_checkpoint, data_dir, tmp_path):
    from ppo_jax.trainer.stages.reward_model import RewardModelTrainer, pair_scores

    trainer = RewardModelTrainer(rm_cfg(tiny_checkpoint, data_dir, tmp_path / "run"))
    params = jax.tree.map(lambda x: x * 8.0 if x.ndim == 2 else x, trainer.state["model"].params)
    data = trainer.train_data
    full = pair_scores(trainer.model.graphdef, params, jax.tree.map(jnp.asarray, data))
    for i in (0, 3):
        row = {k: v[i:i + 1] for k, v in data.items()}
        n = int(max(row["chosen_mask"].sum(), row["rejected_mask"].sum()))
        row.update({k: row[k][:, :n] for k in ("chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")})
        alone = pair_scores(trainer.model.graphdef, params, jax.tree.map(jnp.asarray, row))
        np.testing.assert_allclose(alone[0][0], full[0][i], atol=1e-5)
        np.testing.assert_allclose(alone[1][0], full[1][i], atol=1e-5)


def test_reward_model_export_scores_equal_transformers(tiny_checkpoint, data_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from ppo_jax.trainer.stages.reward_model import RewardModelTrainer, pair_scores

    trainer = RewardModelTrainer(rm_cfg(tiny_checkpoint, data_dir, tmp_path / "run"))
    trainer.train(progress=False)
    out = tmp_path / "run" / "reward_model_hf"
    config = json.loads((out / "config.json").read_text())
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out).num_labels == 1 and config["pad_token_id"] == 0
    assert config["score_std"] > 0 and np.isfinite(config["score_mean"])
    assert config["score_pairs"] == len(trainer.eval_data["weight"]) == 6
    assert not (tmp_path / "run" / "samples.jsonl").exists()  # nothing to sample in stage 2
    hf = AutoModelForSequenceClassification.from_pretrained(out, torch_dtype=torch.float32).eval()
    data = trainer.train_data
    ours = pair_scores(trainer.model.graphdef, trainer.state["model"].params, jax.tree.map(jnp.asarray, data))
    for side, want in (("chosen", ours[0]), ("rejected", ours[1])):
        with torch.no_grad():  # right-padded with the pad id: HF reads the last non-pad token
            theirs = hf(input_ids=torch.tensor(data[f"{side}_ids"], dtype=torch.long),
                        attention_mask=torch.tensor(data[f"{side}_mask"])).logits[:, 0].numpy()
        np.testing.assert_allclose(theirs, np.asarray(want), atol=1e-4)


def test_reward_model_export_with_pad_equal_to_eos_scores_the_eos_in_transformers(tiny_checkpoint, data_dir, tmp_path):
    """SmolLM2's tokenizer pads with its EOS; transformers reads a sequence-classification
    score at the last token != pad_token_id, so the export must declare another pad token."""
    import shutil

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from ppo_jax.trainer.stages.reward_model import RewardModelTrainer, pair_scores

    src = Path(shutil.copytree(tiny_checkpoint, tmp_path / "pad_is_eos"))
    tok = AutoTokenizer.from_pretrained(src)
    tok.pad_token = tok.eos_token
    tok.save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "pad_token_id": tok.eos_token_id}))
    trainer = RewardModelTrainer(rm_cfg(src, data_dir, tmp_path / "run"))
    assert trainer.pad_id == tok.eos_token_id  # we pad with it: our scores use the mask
    trainer.train(progress=False)
    out = tmp_path / "run" / "reward_model_hf"
    exported = AutoTokenizer.from_pretrained(out)
    pad = json.loads((out / "config.json").read_text())["pad_token_id"]
    assert pad == exported.pad_token_id == exported.unk_token_id != exported.eos_token_id
    hf = AutoModelForSequenceClassification.from_pretrained(out, torch_dtype=torch.float32).eval()
    data = trainer.train_data
    ours = pair_scores(trainer.model.graphdef, trainer.state["model"].params, jax.tree.map(jnp.asarray, data))
    for side, want in (("chosen", ours[0]), ("rejected", ours[1])):
        ids = np.where(data[f"{side}_mask"] > 0, data[f"{side}_ids"], pad)  # as HF users pad
        assert (ids[np.arange(len(ids)), data[f"{side}_mask"].sum(1) - 1] == tok.eos_token_id).all()
        with torch.no_grad():
            theirs = hf(input_ids=torch.tensor(ids, dtype=torch.long),
                        attention_mask=torch.tensor(data[f"{side}_mask"])).logits[:, 0].numpy()
        np.testing.assert_allclose(theirs, np.asarray(want), atol=1e-4)


@pytest.mark.slow
def test_smollm2_reward_model_export_scores_equal_transformers(data_dir, tmp_path):
    """SmolLM2 pads with its EOS (<|im_end|>): the export pads with <|endoftext|> instead, and
    transformers then reads the score at the EOS, as we do."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from ppo_jax.trainer.stages.reward_model import RewardModelTrainer, pair_scores

    trainer = RewardModelTrainer(rm_cfg("smollm2", data_dir, tmp_path / "run", "train.steps=1",
                                        "reward_model.backbone_lr_scale=0"))
    assert trainer.pad_id == trainer.tokenizer.eos_token_id
    trainer.train(progress=False)
    out = tmp_path / "run" / "reward_model_hf"
    exported = AutoTokenizer.from_pretrained(out)
    pad = json.loads((out / "config.json").read_text())["pad_token_id"]
    assert pad == exported.pad_token_id != exported.eos_token_id
    hf = AutoModelForSequenceClassification.from_pretrained(out, torch_dtype=torch.float32).eval()
    data = {k: v[:4] for k, v in trainer.train_data.items()}
    ours = pair_scores(trainer.model.graphdef, trainer.state["model"].params, jax.tree.map(jnp.asarray, data))
    for side, want in (("chosen", ours[0]), ("rejected", ours[1])):
        ids = np.where(data[f"{side}_mask"] > 0, data[f"{side}_ids"], pad)
        with torch.no_grad():
            theirs = hf(input_ids=torch.tensor(ids, dtype=torch.long),
                        attention_mask=torch.tensor(data[f"{side}_mask"])).logits[:, 0].numpy()
        np.testing.assert_allclose(theirs, np.asarray(want), atol=1e-4)


def test_score_pad_token_avoids_every_eos():
    from ppo_jax.models.tiny_random import tiny_tokenizer
    from ppo_jax.trainer.stages.reward_model import score_pad_token

    tok = tiny_tokenizer()
    assert score_pad_token(tok, ()) == tok.pad_token  # not an EOS: kept
    tok.pad_token = tok.eos_token
    assert score_pad_token(tok, ()) == tok.unk_token
    assert score_pad_token(tok, (tok.unk_token_id,)) == tok.bos_token  # config.json's EOS list too
    from types import SimpleNamespace

    only_eos = SimpleNamespace(eos_token_id=1, pad_token="<eos>", unk_token=None, bos_token=None,
                               all_special_tokens=["<eos>"], convert_tokens_to_ids=lambda t: 1)
    with pytest.raises(ValueError, match="add a pad token"):
        score_pad_token(only_eos, ())


# --- resume -----------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", ["sft", pytest.param("reward_model", marks=pytest.mark.slow)])
def test_resume_after_interruption_equals_an_uninterrupted_run(stage, tiny_checkpoint, data_dir, tmp_path):
    from ppo_jax.trainer.stages import trainer_class

    make = sft_cfg if stage == "sft" else rm_cfg
    cls = trainer_class(stage)
    common = ("train.save_every=2", "train.export_hf=false", f"{stage}.eval_every=2")
    straight = cls(make(tiny_checkpoint, data_dir, tmp_path / "a", "train.steps=4", *common))
    straight.train(progress=False)
    cls(make(tiny_checkpoint, data_dir, tmp_path / "b", "train.steps=2", *common)).train(progress=False)
    resumed = cls(make(tiny_checkpoint, data_dir, tmp_path / "b", "train.steps=4", *common), resume=True)
    assert resumed.step_count == 2
    resumed.train(progress=False)
    jax.tree.map(np.testing.assert_array_equal, params_of(straight), params_of(resumed))
    rows = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in "ab"]
    assert [r["step"] for r in rows[1]] == [1, 2, 3, 4]
    for a, b in zip(*rows):
        assert a["loss"] == b["loss"] and a.get("eval/loss") == b.get("eval/loss")


# --- the pipeline -----------------------------------------------------------------------------

@pytest.mark.slow  # about 2 minutes: three train.py runs
def test_three_stage_pipeline_through_train_py(tiny_checkpoint, data_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    common = ["--set", "train.progress=false", "--set", "train.steps=2"]
    sft_out, rm_out, ppo_out = tmp_path / "sft", tmp_path / "rm", tmp_path / "ppo"
    assert train.main(["--config", str(TINY), "--set", "stage=sft", "--set", f"model.actor={tiny_checkpoint}",
                       "--set", f"sft.data={data_dir['sft']}", "--set", "sft.batch_size=4",
                       "--set", "sft.micro_batch_size=2", "--set", f"train.output_dir={sft_out}", *common]) == 0
    actor = sft_out / "actor_hf"
    assert train.main(["--config", str(TINY), "--set", "stage=reward_model",
                       "--set", f"model.reward_model={actor}", "--set", f"reward_model.data={data_dir['pairs']}",
                       "--set", "reward_model.batch_size=4", "--set", "reward_model.micro_batch_size=2",
                       "--set", f"train.output_dir={rm_out}", *common]) == 0
    rm = rm_out / "reward_model_hf"
    assert train.main(["--config", str(TINY), "--set", f"model.actor={actor}", "--set", f"model.reward_model={rm}",
                       "--set", "reward.kind=model", "--set", "reward.normalize=true",
                       "--set", "ppo.critic_warmup_steps=1", "--set", f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}",
                       "--set", f"train.output_dir={ppo_out}", *common]) == 0
    rows = [json.loads(x) for x in (ppo_out / "metrics.jsonl").read_text().splitlines()]
    assert np.isfinite(rows[0]["eval/reward_mean"])  # step 0: the held-out eval, reward-model scored
    rows = rows[1:]
    assert [r["critic_warmup"] for r in rows] == [1.0, 0.0]
    assert "pg_loss" not in rows[0] and np.isfinite(rows[1]["pg_loss"]) and np.isfinite(rows[0]["vf_loss"])
    for stage_out in (sft_out, rm_out):
        assert (stage_out / "metrics.jsonl").is_file() and list((stage_out / "checkpoints").iterdir())


@pytest.mark.slow  # default-run budget (15 min on 2 cores)
def test_critic_warmup_leaves_the_actor_unchanged(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("PPO_JAX_CACHE", str(tmp_path / "cache"))
    from ppo_jax.trainer.stages.ppo.trainer import PPOTrainer

    cfg = load_config(TINY, [f"model.actor={tiny_checkpoint}", "ppo.critic_warmup_steps=1",
                             f"data.prompts={ROOT / 'configs/prompts/reviews.jsonl'}",
                             f"train.output_dir={tmp_path / 'run'}", "train.progress=false"])
    trainer = PPOTrainer(cfg)
    actor0 = jax.tree.map(np.asarray, trainer.state["actor"].params)
    critic0 = jax.tree.map(np.asarray, trainer.state["critic"].params)
    trainer.step()
    jax.tree.map(np.testing.assert_array_equal, actor0, jax.tree.map(np.asarray, trainer.state["actor"].params))
    assert int(trainer.state["actor"].step) == 0 and int(trainer.state["critic"].step) > 0
    moved = jax.tree.map(lambda a, b: float(np.abs(a - np.asarray(b)).max()), critic0, trainer.state["critic"].params)
    assert max(jax.tree.leaves(moved)) > 0
    trainer.step()
    assert int(trainer.state["actor"].step) > 0
