"""Stage 1, supervised fine-tuning (DeepSpeed-Chat step 1; TRL `SFTTrainer` with a
completion-only loss): next-token NLL of the response tokens of prompt/response rows, prompt and
padding masked out, an exact token mean per minibatch under gradient accumulation. The trained
actor is written to `<output_dir>/actor_hf`, which stage 3 takes as `model.actor`. With
`sft.packing` the backbone runs over each micro-batch's rows packed several to a row
(`next_token_states`); the log-probs, loss and gradients are the padded pass's.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppo_jax.core import masked_sum, nll_loss, shift_for_next_token
from ppo_jax.parallel import shard_rows
from ppo_jax.rollout.forward import aux_loss_weight, backbone_pass, head_logprobs
from ppo_jax.rollout.packing import PackedRows, packed_rows, unpack
from ppo_jax.trainer.stages.supervised import SupervisedTrainer, resolve_source
from ppo_jax.trainer.data.text import read_records, sft_examples, tokenize_sft


def next_token_states(model, ids: jax.Array, attention_mask: jax.Array, *, mesh=None,
                      packing: PackedRows | None = None) -> tuple[jax.Array, jax.Array]:
    """`(hidden [B, L-1, D], aux_loss)`: the backbone's final states at tokens 0 .. L-2 of
    right-padded rows `ids [B, L]`, the ones that predict tokens 1 .. L-1, and the pass's MoE
    load-balancing loss (`rollout.forward.backbone_pass`).

    `packing` (the rows' `rollout.packing.plan_rows` plan for this micro-batch): the backbone
    runs over the packed rows, attention within each sequence, and the states come back to
    `[B, L-1, D]` (`unpack`): equal to the padded pass's at every position that predicts a real
    token, to float32 rounding; other positions hold another state of the same row.
    """
    if packing is None:
        hidden, aux = backbone_pass(model, ids, attention_mask, mesh=mesh)
        return hidden[:, :-1], aux
    ids, segments = (shard_rows(x, mesh) for x in packed_rows(ids, packing))
    hidden, aux = backbone_pass(model, ids, segments, mesh=mesh)
    return shard_rows(unpack(hidden, packing), mesh), aux


def sft_logprobs(graphdef, params, batch: dict, *, chunk_size: int = 0, mesh=None,
                 packing: PackedRows | None = None):
    """`(logprobs [B, L-1], mask [B, L-1], aux_loss)` of each next token under the CausalLM:
    log-probs float32; the mask is the response (loss) mask of the targets, zero on weight-0
    (padding) rows; aux_loss the MoE load-balancing loss of the pass (float32 scalar, 0 for a
    dense model; `rollout.forward.backbone_pass`).

    `chunk_size` (`model.logprob_chunk_size`, static) > 0: the LM head and log-softmax in blocks
    of that many vocabulary columns (`rollout.forward.head_logprobs`), so no `[B, L, V]` float32
    logits are formed, forward or backward; 0: the full logits. Same values and gradients to
    float32 rounding. `packing`: over packed rows (`next_token_states`), the same values on
    every masked-in target.
    """
    model = nnx.merge(graphdef, params)
    hidden, aux = next_token_states(model, batch["ids"], batch["attention_mask"], mesh=mesh,
                                    packing=packing)
    keep = (batch["loss_mask"] > 0) & (batch["weight"] > 0)[:, None]
    targets, mask = shift_for_next_token(batch["ids"], keep)
    logprobs = head_logprobs(model, hidden, targets, with_entropy=False,
                             chunk_size=chunk_size, mesh=mesh)
    return logprobs, mask, aux


def _as_arrays(seqs) -> dict:
    return {"ids": seqs.ids.astype(np.int32), "attention_mask": seqs.attention_mask.astype(np.int32),
            "loss_mask": seqs.loss_mask.astype(np.int32), "weight": np.ones(len(seqs), np.float32)}


class SFTTrainer(SupervisedTrainer):
    """Stage 1 on `sft.data`; `model.actor` is the model to fine-tune (see module doc)."""

    name = section = "sft"
    model_kind = "causal_lm"

    def model_source(self) -> Path:
        return resolve_source(self.cfg.model.actor, "model.actor")

    def tokenize_file(self, path: str, key: str, tokenizer) -> dict:
        examples = sft_examples(read_records(path, key), path, key)
        try:
            seqs, _ = tokenize_sft(examples, tokenizer, **self.encode_kwargs(tokenizer))
        except ValueError as e:  # name the file: the message names the record
            raise ValueError(f"{key}: {path}: {e}") from None
        return _as_arrays(seqs)

    def batch_fields(self) -> dict:
        return {"ids": (np.int32, True), "attention_mask": (np.int32, True),
                "loss_mask": (np.int32, True), "weight": (np.float32, False)}

    def sequence_lengths(self, batch: dict) -> np.ndarray:
        """Real tokens of each row (right-padded: its attention mask's sum)."""
        return batch["attention_mask"].sum(1)

    def denominator(self, batch: dict) -> jax.Array:
        """Response tokens (targets) of the whole minibatch."""
        _, mask = shift_for_next_token(batch["ids"], batch["loss_mask"])
        return jnp.maximum(jnp.sum(mask * (batch["weight"] > 0)[:, None]).astype(jnp.float32), 1.0)

    def _logprobs(self, graphdef, params, batch: dict, packing=None):
        return sft_logprobs(graphdef, params, batch, chunk_size=self.cfg.model.logprob_chunk_size,
                            mesh=self.place.constraint_mesh, packing=packing)

    def loss(self, graphdef, params, micro: dict, denominator, packing=None):
        """The next-token NLL of the micro-batch's response tokens over the minibatch's
        `denominator`; an MoE model adds `router_aux_loss_coef` x its load-balancing loss,
        weighted by the micro-batch's share of the response tokens (so the accumulated sum
        is a token-weighted mean over micro-batches) and logged as `router_aux_loss`."""
        logprobs, mask, aux = self._logprobs(graphdef, params, micro, packing)
        loss, stats = nll_loss(logprobs, mask, loss_normalizer=denominator)
        out = {"loss": stats["nll"], "tokens": stats["tokens"] * denominator}
        coef = aux_loss_weight(self.model.cfg, self.cfg.model.router_aux_loss_coef)
        if coef:
            aux = aux * stats["tokens"]  # this micro-batch's share of the tokens
            loss, out["router_aux_loss"] = loss + coef * aux, aux
        return loss, out

    def eval_sums(self, graphdef, params, batch: dict, packing=None) -> dict:
        logprobs, mask, _ = self._logprobs(graphdef, params, batch, packing)
        return {"nll": -masked_sum(logprobs, mask), "tokens": jnp.sum(mask).astype(jnp.float32)}

    def finish_eval(self, sums: dict) -> dict:
        loss = sums["nll"] / max(sums["tokens"], 1.0)
        return {"loss": float(loss), "perplexity": float(math.exp(min(loss, 80.0)))}

    def step(self) -> dict:
        metrics = super().step()
        metrics["perplexity"] = math.exp(min(metrics["loss"], 80.0))
        metrics["tokens_per_s"] = metrics["tokens"] / max(metrics["time/step"], 1e-9)
        return metrics

    def export(self) -> Path:
        """The fine-tuned actor as an HF causal-LM directory `<output_dir>/actor_hf` (a LoRA
        model with its adapters merged), and a LoRA model's adapters alone in PEFT's format in
        `<output_dir>/actor_adapter` (`model.lora.adapter` of a LoRA PPO run on the same base)."""
        if self.model.cfg.lora_rank:
            self.write_adapter(self.state["model"].params, self.model.cfg,
                               self.out / "actor_adapter", "causal_lm", self.model_path)
        return self.write_hf(self.model.graphdef, self.params(), self.model.cfg,
                             self.out / "actor_hf")
