"""Stage 2, a reward model on preference pairs (InstructGPT; DeepSpeed-Chat step 2; TRL
`RewardTrainer`): Bradley-Terry loss `-log sigmoid(r_chosen - r_rejected - margin)` with each
score read at the last real token of prompt + response by the same `RewardModel` head PPO uses.
Chosen and rejected of a pair go through one forward pass together, in the same micro-batch;
with `reward_model.packing` packed several to a row, each pair's two sequences on one device
(`pair_scores`), the scores the padded pass's.

The model starts from `model.reward_model`: a causal LM (SmolLM2, an SFT output) gets a fresh
score head, N(0, 0.02^2) (transformers' `initializer_range`, what TRL's RewardTrainer starts
from; the other initialisations tried are in docs/history.md). A reward model goes on training.
The result is written to `<output_dir>/reward_model_hf` as an HF `*ForSequenceClassification`
directory with the tokenizer's pad id set and the mean / std of its scores on the held-out pairs (`score_mean`, `score_std` in config.json; OpenRLHF keeps the
same pair for its `normalize_reward`), which stage 3's `reward.normalize` reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppo_jax.core import bradley_terry_loss
from ppo_jax.parallel import shard_rows
from ppo_jax.rollout.packing import PackedRows, packed_rows, unpack_last
from ppo_jax.trainer.config import ConfigError
from ppo_jax.trainer.stages.supervised import SupervisedTrainer, resolve_source
from ppo_jax.trainer.data.text import preference_pairs, read_records, tokenize_pairs


def pair_scores(graphdef, params, batch: dict, packing: PackedRows | None = None,
                mesh=None) -> tuple[jax.Array, jax.Array]:
    """`(chosen [B], rejected [B])` float32 scores, from one pass over the 2B sequences.

    `packing`: the `rollout.packing.plan_rows` plan of the sequences interleaved, pair i's
    chosen at 2i and rejected at 2i + 1 (`RewardModelTrainer.sequence_lengths`), so a device's
    pairs stay on it; the backbone runs over the packed rows and each score is read at its
    sequence's last real token (`unpack_last`): the padded pass's scores to float32 rounding.
    """
    model = nnx.merge(graphdef, params)
    n = batch["chosen_ids"].shape[0]
    if packing is None:
        ids = jnp.concatenate([batch["chosen_ids"], batch["rejected_ids"]])
        mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
        scores, _ = model(ids, mask)
        return scores[:n], scores[n:]
    both = jnp.stack([batch["chosen_ids"], batch["rejected_ids"]], axis=1)  # [B, 2, L]
    ids, segments = (shard_rows(x, mesh) for x in packed_rows(both.reshape(2 * n, -1), packing))
    hidden, _ = model.backbone(ids, segments)
    last = shard_rows(unpack_last(hidden, packing, both.shape[2]), mesh)  # [2B, D]
    scores = model.scores_from_hidden(last).reshape(n, 2)
    return scores[:, 0], scores[:, 1]


def score_pad_token(tokenizer, eos_token_ids) -> str:
    """The pad token an exported reward model declares: the tokenizer's own, unless it is an
    EOS token, then its unk, bos or another special token that is not an EOS.

    HF `*ForSequenceClassification` reads the score at the last token that is not
    `pad_token_id` (transformers `LlamaForSequenceClassification.forward`). Our score is read at
    the last real token, which is the EOS every response ends with; a pad id equal to the EOS id
    (SmolLM2's tokenizer) would make transformers read the token before it. Raises ValueError
    when every special token of the tokenizer is an EOS token.
    """
    eos = {int(i) for i in eos_token_ids} | {int(tokenizer.eos_token_id)}
    pad = tokenizer.pad_token
    candidates = [pad, tokenizer.unk_token, tokenizer.bos_token, *tokenizer.all_special_tokens]
    for token in candidates:
        if token is not None and int(tokenizer.convert_tokens_to_ids(token)) not in eos:
            return token
    raise ValueError(f"the tokenizer's pad token {pad!r} is its EOS token and it has no other "
                     "special token to pad with: transformers would read the reward model's "
                     "score before the EOS; add a pad token to the tokenizer")


def _pair_sums(graphdef, params, batch: dict, packing=None, mesh=None
               ) -> tuple[jax.Array, dict, tuple]:
    """The weighted sum of the per-pair losses, the weighted sums of the pair statistics, and
    the scores `(chosen [B], rejected [B])`."""
    rc, rr = pair_scores(graphdef, params, batch, packing, mesh)
    loss, stats = bradley_terry_loss(rc, rr, batch["margin"])
    w = batch["weight"]
    sums = {"loss": jnp.sum(loss * w), "accuracy": jnp.sum(stats["accuracy"] * w),
            "margin": jnp.sum(stats["margin"] * w), "chosen_score": jnp.sum(rc * w),
            "rejected_score": jnp.sum(rr * w)}
    return jnp.sum(loss * w), sums, (rc, rr)


def _as_arrays(pairs) -> dict:
    c, r = pairs.chosen, pairs.rejected
    return {"chosen_ids": c.ids.astype(np.int32), "chosen_mask": c.attention_mask.astype(np.int32),
            "rejected_ids": r.ids.astype(np.int32), "rejected_mask": r.attention_mask.astype(np.int32),
            "margin": np.asarray(pairs.margin, np.float32), "weight": np.ones(len(pairs), np.float32)}


class RewardModelTrainer(SupervisedTrainer):
    """Stage 2 on `reward_model.data` (see module doc)."""

    name = section = "reward_model"
    model_kind = "reward"

    def model_source(self) -> Path:
        return resolve_source(self.cfg.model.reward_model, "model.reward_model")

    def _check_inputs(self) -> None:
        super()._check_inputs()
        try:  # the export needs a pad token that is not an EOS: refuse now, not after training
            score_pad_token(self.tokenizer, ())
        except ValueError as e:
            raise ConfigError(f"model.reward_model={str(self.model_path)!r}: {e}") from None

    def load_kwargs(self) -> dict:
        return {"fresh_score_head": True, "head_init_std": 0.02}

    def tokenize_file(self, path: str, key: str, tokenizer) -> dict:
        pairs, _ = preference_pairs(read_records(path, key), path, key)
        try:
            batch, _ = tokenize_pairs(pairs, tokenizer, **self.encode_kwargs(tokenizer))
        except ValueError as e:  # name the file: the message names the record
            raise ValueError(f"{key}: {path}: {e}") from None
        return _as_arrays(batch)

    def batch_fields(self) -> dict:
        return {"chosen_ids": (np.int32, True), "chosen_mask": (np.int32, True),
                "rejected_ids": (np.int32, True), "rejected_mask": (np.int32, True),
                "margin": (np.float32, False), "weight": (np.float32, False)}

    sequences_per_row = 2  # a pair: chosen and rejected

    def sequence_lengths(self, batch: dict) -> np.ndarray:
        """`[2B]` real tokens of the chosen and rejected sequences, interleaved as
        `pair_scores` packs them."""
        return np.stack([batch["chosen_mask"].sum(1), batch["rejected_mask"].sum(1)], 1).reshape(-1)

    def denominator(self, batch: dict) -> jax.Array:
        """Pairs in the whole minibatch."""
        return jnp.maximum(jnp.sum(batch["weight"]), 1.0)

    def loss(self, graphdef, params, micro: dict, denominator, packing=None):
        loss, sums, _ = _pair_sums(graphdef, params, micro, packing, self.place.constraint_mesh)
        return loss / denominator, {k: jax.lax.stop_gradient(v) / denominator for k, v in sums.items()}

    def eval_sums(self, graphdef, params, batch: dict, packing=None) -> dict:
        _, sums, (rc, rr) = _pair_sums(graphdef, params, batch, packing,
                                       self.place.constraint_mesh)
        w = batch["weight"]
        both = jnp.concatenate([rc, rr])
        w2 = jnp.concatenate([w, w])
        return {**sums, "pairs": jnp.sum(w), "score_sum": jnp.sum(both * w2),
                "score_sq": jnp.sum(jnp.square(both) * w2)}

    def finish_eval(self, sums: dict) -> dict:
        n = max(sums["pairs"], 1.0)
        out = {k: float(sums[k] / n) for k in ("loss", "accuracy", "margin", "chosen_score",
                                                 "rejected_score")}
        mean = sums["score_sum"] / (2 * n)
        out["score_mean"] = float(mean)
        out["score_std"] = float(math.sqrt(max(sums["score_sq"] / (2 * n) - mean ** 2, 0.0)))
        out["pairs"] = int(round(float(sums["pairs"])))
        return out

    def progress_postfix(self, metrics: dict) -> dict:
        return {"loss": f"{metrics['loss']:.4f}", "acc": f"{metrics['accuracy']:.2f}"}

    def export(self) -> Path:
        """`<output_dir>/reward_model_hf`: HF `*ForSequenceClassification` (num_labels 1, a
        pad id that is not an EOS: `score_pad_token`) + `score_mean` / `score_std` of the
        held-out pairs (the training pairs when there is no held-out split) and their count
        `score_pairs` in config.json. A LoRA model is exported merged, and its adapters and
        score head alone in PEFT's format to `<output_dir>/reward_model_adapter`."""
        stats = self.evaluate(self.eval_data if len(self.eval_data["weight"]) else self.train_data)
        pad_token = score_pad_token(self.tokenizer, self.model.cfg.eos_token_ids)
        pad_id = int(self.tokenizer.convert_tokens_to_ids(pad_token))
        cfg = dataclasses.replace(self.model.cfg, pad_token_id=pad_id)
        if cfg.lora_rank:  # the adapters and score head alone, in PEFT's format
            self.write_adapter(self.state["model"].params, cfg, self.out / "reward_model_adapter",
                               "reward", self.model_path)
        out_dir = self.write_hf(self.model.graphdef, self.params(), cfg,
                                self.out / "reward_model_hf")
        if self.process_index == 0:
            if pad_token != self.tokenizer.pad_token:  # the exported tokenizer pads with it too
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(out_dir))
                tok.pad_token = pad_token
                tok.save_pretrained(str(out_dir))
            config = json.loads((out_dir / "config.json").read_text())
            config.update(score_mean=stats["score_mean"], score_std=stats["score_std"],
                          score_pairs=int(stats["pairs"]))
            (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        return out_dir
