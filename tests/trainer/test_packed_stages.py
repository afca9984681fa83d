"""`sft.packing` and `reward_model.packing`: a step over packed rows equals the padded step on
the tiny random Llama in float32 — the SFT loss, token count, gradient norm and params after an
SGD step; the reward model's loss, accuracy, margin, scores and params — with two micro-batches
a step, and the held-out evaluation; the trainers' own steps log the same metrics and the
packing figures; packing that would leave one sequence a row is refused."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ppo_jax.trainer.config import ConfigError, load_config
from ppo_jax.trainer.stages.packing import check_packing
from ppo_jax.trainer.stages.supervised import rows_of, supervised_update
from ppo_jax.trainer.state import TrainState

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/tiny.yaml"
WORDS = ["good", "great", "nice", "happy", "wonderful", "excellent", "lovely", "fun"]
BAD = ["bad", "terrible", "awful", "sad", "horrible", "boring", "ugly", "angry"]
TOPICS = ["the bus", "a train", "the coffee", "my week", "the party", "the garden", "a film",
          "the market"]
B, MICRO = 8, 4


def _said(i: int, words) -> str:
    """Heavy-tailed lengths: most responses are three words, every third one eighteen."""
    return " ".join(["it", "was"] + (words * 2 if i % 3 == 0 else [words[i % 8]]))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("packed")
    sft = [{"prompt": t, "response": _said(i, WORDS)} for i, t in enumerate(TOPICS)]
    pairs = [{"prompt": t, "chosen": _said(i, WORDS), "rejected": _said(i + 1, BAD)}
             for i, t in enumerate(TOPICS)]
    for name, rows in (("sft", sft), ("pairs", pairs)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def config(stage: str, source, data, out, *extra):
    key = "model.actor" if stage == "sft" else "model.reward_model"
    file = data / ("sft.jsonl" if stage == "sft" else "pairs.jsonl")
    return load_config(TINY, [f"stage={stage}", f"{key}={source}", f"{stage}.data={file}",
                              f"{stage}.batch_size={B}", f"{stage}.micro_batch_size={MICRO}",
                              f"{stage}.max_length=40", f"{stage}.eval_fraction=0",
                              f"{stage}.lr=1e-4", "train.steps=1", f"train.output_dir={out}",
                              "train.progress=false", "train.save_every=0",
                              "train.export_hf=false", "data.use_chat_template=false", *extra])


def trainer_of(stage: str, tiny_checkpoint, data, out, *extra):
    from ppo_jax.trainer.stages import trainer_class

    return trainer_class(stage)(config(stage, tiny_checkpoint, data, out, *extra))


def sgd_steps(trainer, batch: dict, plan):
    """`(stats, params)` after one SGD step of `supervised_update`, padded (plan None) or
    packed; the params scaled up first so that attention is far from uniform."""
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, trainer.state["model"].params)
    tx = optax.sgd(0.5)
    update = jax.jit(partial(supervised_update, graphdef=trainer.model.graphdef, tx=tx,
                             loss=trainer.loss, denominator=trainer.denominator,
                             micro_batch_size=MICRO, mesh=None, backbone_frozen=False))
    state, stats = update(TrainState.create(params, tx), {}, jax.tree.map(jnp.asarray, batch),
                          plan)
    return jax.device_get(stats), jax.device_get(state.params), params


def assert_same_step(trainer, stat_keys):
    batch = rows_of(trainer.train_data, np.arange(B))
    packed_batch, plan, figures = trainer.packing_plan(batch, MICRO)
    for key, rows in batch.items():  # the same rows, reordered
        assert sorted(packed_batch[key].tolist()) == sorted(rows.tolist()), key
    assert figures["packing/rows"] < MICRO * trainer.sequences_per_row  # rows were shared
    assert figures["packing/fill"] > figures["packing/padded_fill"]
    (padded, p_padded, start), (packed, p_packed, _) = (sgd_steps(trainer, b, p) for b, p in
                                                        ((batch, None), (packed_batch, plan)))
    for key in (*stat_keys, "grad_norm"):
        np.testing.assert_allclose(packed[key], padded[key], rtol=1e-5, err_msg=key)
    assert padded["grad_norm"] > 0.1
    moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), p_padded, start)
    assert max(jax.tree.leaves(moved)) > 1e-3  # the step moved the params
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 p_packed, p_padded)
    # the held-out evaluation: the whole batch in one pass
    sums = [jax.device_get(trainer._eval(start, jax.tree.map(jnp.asarray, b), p))
            for b, p in ((batch, None), trainer.packing_plan(batch, B)[:2])]
    for key in sums[0]:
        np.testing.assert_allclose(sums[1][key], sums[0][key], rtol=1e-5, err_msg=key)
    return padded


def test_packed_sft_step_equals_the_padded_step(tiny_checkpoint, data, tmp_path):
    trainer = trainer_of("sft", tiny_checkpoint, data, tmp_path / "run", "sft.packing=true")
    lengths = trainer.train_data["attention_mask"].sum(1)
    assert lengths.max() >= 3 * lengths.min()  # heavy-tailed
    padded = assert_same_step(trainer, ("loss", "tokens"))
    targets = trainer.train_data["loss_mask"][:B, 1:].sum()  # next-token targets
    assert padded["loss"] > 1.0 and padded["tokens"] == targets


@pytest.mark.slow  # the trainer's reward-model step is compared in the default run
def test_packed_reward_model_step_equals_the_padded_step(tiny_checkpoint, data, tmp_path):
    trainer = trainer_of("reward_model", tiny_checkpoint, data, tmp_path / "run",
                         "reward_model.packing=true")
    padded = assert_same_step(trainer, ("loss", "accuracy", "margin", "chosen_score",
                                        "rejected_score"))
    assert abs(padded["margin"]) > 1e-3  # the scores differ: the comparison reads real values


@pytest.mark.parametrize("stage", [pytest.param("sft", marks=pytest.mark.slow), "reward_model"])
def test_the_trainer_logs_the_padded_metrics_and_the_packing_figures(stage, tiny_checkpoint,
                                                                     data, tmp_path):
    # Adam's eps 1e-3: a gradient entry near 0 takes a step near 0, not lr x its sign, so
    # float32 rounding in it cannot move a param by 2 lr
    padded = trainer_of(stage, tiny_checkpoint, data, tmp_path / "a", "optim.eps=1e-3")
    packed = trainer_of(stage, tiny_checkpoint, data, tmp_path / "b", "optim.eps=1e-3",
                        f"{stage}.packing=true")
    a, b = padded.step(), packed.step()
    assert b["packing/rows"] < MICRO * packed.sequences_per_row and "packing/rows" not in a
    for key in a:
        if not key.startswith("time/") and key != "tokens_per_s":
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6),
                 jax.device_get(packed.state["model"].params),
                 jax.device_get(padded.state["model"].params))
    ea, eb = padded.evaluate(padded.train_data), packed.evaluate(packed.train_data)
    assert eb == pytest.approx(ea, rel=1e-5)


def test_packing_one_sequence_a_device_is_refused_by_name():
    sec = SimpleNamespace(packing=True, micro_batch_size=4)
    with pytest.raises(ConfigError, match=r"sft.packing=true has no effect: "
                                          r"sft.micro_batch_size=4 over the mesh's 4 batch"):
        check_packing("sft", sec, 1, 4)
    check_packing("sft", sec, 1, 2)  # two sequences a device
    check_packing("reward_model", sec, 2, 4)  # a pair a device: its two sequences
    check_packing("sft", sec, 1, 3)  # 3 shards do not split 4 rows: one plan over all of them
    check_packing("sft", SimpleNamespace(packing=False, micro_batch_size=4), 1, 4)
    with pytest.raises(ConfigError, match=r"sft.packing=True has no effect: "
                                          r"sft.micro_batch_size=1 runs one sequence a forward"):
        load_config(TINY, ["stage=sft", "sft.data=x.jsonl", "sft.micro_batch_size=1",
                           "sft.packing=true"])
