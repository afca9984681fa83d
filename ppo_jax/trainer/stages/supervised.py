"""What stages 1 and 2 share: a data set of fixed-width rows, a held-out split, one trained
model, minibatch steps with exact gradient accumulation, and held-out evaluation.

A subclass (`SFTTrainer`, `RewardModelTrainer`) gives: `section` (its config section),
`model_kind` and `model_source()`, `tokenize_file(path, key, tokenizer)` (a dict of numpy
arrays with rows first, one of them `weight [N]`), `loss(params, micro, denominator[, packing])
-> (loss, stats)` (a sum over the micro-batch divided by the minibatch's `denominator`),
`denominator(batch)`, `eval_sums(params, batch[, packing]) -> dict of sums`, `finish_eval(sums)
-> metrics` and, to pack, `sequence_lengths(batch)` (the plan is passed only when packing).

With `<section>.packing` each micro-batch's sequences run packed several to a row (segment ids,
`rollout.packing.plan_rows`), planned here on the host from the batch's row lengths and passed
to the update and the evaluation as one more argument (`packing`, None when off): the losses,
their normalisers and the metrics are the padded pass's.
"""

from __future__ import annotations

import time
from functools import partial

import jax
import numpy as np
import optax

from ppo_jax.rollout.packing import PackedRows, balanced_order, fill_figures, plan_rows
from ppo_jax.trainer.accumulate import accumulate_gradients
from ppo_jax.trainer.config import ConfigError
from ppo_jax.trainer.data.order import DataOrder
from ppo_jax.trainer.data.text import split_holdout
from ppo_jax.trainer.loading.lora import adapters_from, check_targets, lora_settings
from ppo_jax.trainer.loading.models import (
    LoadedModel, abstract_split, load_split, pad_token_id, resolve_model_path,
)
from ppo_jax.trainer.loop import StageTrainer
from ppo_jax.trainer.optim import optimizer_from_config, stop_backbone_gradient
from ppo_jax.trainer.programs import Program, batch_shape
from ppo_jax.trainer.stages.packing import check_packing, packing_shards
from ppo_jax.trainer.state import TrainState, full_params, loss_of_trained


def rows_of(batch: dict, idx) -> dict:
    """The rows `idx` of every array of a row-first dict."""
    return {k: v[idx] for k, v in batch.items()}


def pad_rows(batch: dict, rows: int) -> dict:
    """`batch` padded to `rows` rows by repeating its first row with `weight` 0."""
    n = len(batch["weight"])
    if n == rows:
        return batch
    out = {k: np.concatenate([v, np.repeat(v[:1], rows - n, axis=0)]) for k, v in batch.items()}
    out["weight"][n:] = 0
    return out


def supervised_update(state: TrainState, frozen: dict, batch: dict,
                      packing: PackedRows | None = None, *, graphdef, tx, loss, denominator,
                      micro_batch_size: int, mesh, backbone_frozen: bool):
    """One optimiser step of the SFT or reward-model stage on `batch` (a row-first dict of
    `[B, L]` / `[B]` arrays): gradients of `loss(graphdef, params, micro, n[, plan])` summed over
    micro-batches of `micro_batch_size` rows, `n = denominator(batch)` the whole batch's
    normaliser, so the sum is the full-batch gradient. `packing`: None, or the micro-batches'
    `rollout.packing.PackedRows` (leaves `[B / micro_batch_size, ...]`), each micro-batch's
    plan handed to `loss`. `frozen`: the LoRA base ({} without), joined in the forward pass,
    never differentiated; `backbone_frozen` (`backbone_lr_scale` 0): no gradient through the
    backbone at all. Returns `(state, stats)` with `grad_norm`."""
    n = denominator(batch)

    def micro_loss(params, micro):
        params = stop_backbone_gradient(params) if backbone_frozen else params
        if packing is None:  # a loss that never packs need not take a plan
            return loss(graphdef, params, micro, n)
        micro, plan = micro
        return loss(graphdef, params, micro, n, plan)

    grads, stats = accumulate_gradients(loss_of_trained(micro_loss, frozen), state.params, batch,
                                        micro_batch_size=micro_batch_size, mesh=mesh,
                                        per_micro=packing)
    stats["grad_norm"] = optax.global_norm(grads)
    return state.apply_gradients(grads, tx), stats


def supervised_eval(params, batch: dict, packing: PackedRows | None = None, *, graphdef,
                    eval_sums) -> dict:
    """`eval_sums(graphdef, params, batch[, plan])` of a held-out chunk in one pass; `packing`:
    None, or the chunk's plan as one micro-batch (leaves `[1, ...]`, `packing_plan`)."""
    if packing is None:
        return eval_sums(graphdef, params, batch)
    return eval_sums(graphdef, params, batch, jax.tree.map(lambda x: x[0], packing))


class SupervisedTrainer(StageTrainer):
    """Shared machinery of the SFT and reward-model stages (see the module docstring)."""

    section = ""  # "sft" | "reward_model"
    model_kind = ""  # "causal_lm" | "reward"

    @property
    def section_cfg(self):
        """This stage's config section (`cfg.sft` or `cfg.reward_model`)."""
        return getattr(self.cfg, self.section)

    def _check_inputs(self) -> None:
        """Model source, tokenizer and the whole data set, before the run directory is touched."""
        from ppo_jax.models import load_tokenizer

        self.model_path = self.model_source()
        check_targets(self.cfg, self.model_path, "model.actor" if self.section == "sft"
                      else "model.reward_model")
        self.tokenizer = load_tokenizer(self.model_path)
        if self.tokenizer.eos_token_id is None:
            raise ConfigError(f"the tokenizer of {self.model_path} has no EOS token")
        self.pad_id = pad_token_id(self.tokenizer)
        self.train_data, self.eval_data = self.load_data(self.tokenizer)

    def _build(self) -> None:
        cfg, place, sec = self.cfg, self.place, self.section_cfg
        place.check_batch(f"{self.section}.batch_size", sec.batch_size)
        check_packing(self.section, sec, self.sequences_per_row, place.batch_shards)
        place.check_attention(cfg.model.attention)
        model = self.abstract_model() if self.is_abstract else self.load_model()
        if not self.is_abstract:
            self._check_ids(model.cfg.vocab_size)
        self._check_context(model.cfg.max_position_embeddings)
        self.model = LoadedModel(model.graphdef, None, model.cfg)
        self.frozen = model.frozen  # LoRA: the frozen base ({} without), never trained or saved
        self.tx = optimizer_from_config(cfg.optim, sec.lr, cfg.train.steps,
                                        backbone_lr_scale=sec.backbone_lr_scale)
        self.state = {"model": place.create_state(model.params, self.tx)}
        if not self.is_abstract:
            self.prompt_order = DataOrder(len(self.train_data["weight"]), cfg.train.seed,
                                         cfg.data.shuffle)
        self._jit()

    def load_model(self) -> LoadedModel:
        """The model to train (with `model.lora`: fresh adapters, or `model.lora.adapter`'s)."""
        m, lora = self.cfg.model, lora_settings(self.cfg)
        dtype = m.frozen_param_dtype if lora else m.param_dtype  # a LoRA model's frozen base
        return load_split(self.model_path, self.model_kind, param_dtype=dtype, dtype=m.dtype,
                          remat=m.remat, attention=m.attention, seed=self.cfg.train.seed,
                          sharding_fn=self.place.sharding_fn,
                          lora=lora,
                          adapters=adapters_from(self.cfg, self.model_path, self.model_kind),
                          **self.load_kwargs())

    def load_kwargs(self) -> dict:
        return {}

    def abstract_model(self) -> LoadedModel:
        """The model with shapes in place of params (`StageTrainer.abstract`)."""
        m, key = self.cfg.model, f"model.{'actor' if self.section == 'sft' else 'reward_model'}"
        source = m.actor if self.section == "sft" else m.reward_model
        if not source:
            raise ConfigError(f"{key} is not set")
        lora = lora_settings(self.cfg)
        return abstract_split(source, key, self.model_kind,
                              param_dtype=m.frozen_param_dtype if lora else m.param_dtype,
                              dtype=m.dtype, remat=m.remat, attention=m.attention,
                              sharding_fn=self.place.sharding_fn,
                              **(lora.config_fields() if lora else {}))

    def batch_fields(self) -> dict:  # pragma: no cover - abstract
        """`{name: (dtype, per token)}` of a batch row dict (`tokenize_file`'s arrays): per-token
        fields are `[B, max_length]`, the others `[B]`."""
        raise NotImplementedError

    def programs(self) -> list:
        """The update and the held-out evaluation (`trainer.programs`) on a batch of
        `batch_size` rows of `max_length` tokens (the widest a batch can be)."""
        sec, place = self.section_cfg, self.place
        batch = {k: batch_shape(place, (sec.batch_size, sec.max_length) if per_token
                                else (sec.batch_size,), dtype)
                 for k, (dtype, per_token) in self.batch_fields().items()}
        state = self.state["model"]
        every = 1.0 / sec.eval_every if sec.eval_every else 0.0
        # packed: the plan of rows max_length long each, one a packed row, is the widest
        full = {k: np.full(v.shape, 1, np.int32) for k, v in batch.items()}
        update_plan = self.packing_plan(full, sec.micro_batch_size)[1]
        eval_plan = self.packing_plan(full, sec.batch_size)[1]
        return [Program("update", self._update, (state, self.frozen, batch, update_plan)),
                Program("eval", self._eval, (self.params(), batch, eval_plan), every,
                        f"every {sec.eval_every} steps" if sec.eval_every else "at the end")]

    def _check_ids(self, vocab_size: int) -> None:
        for split, data in (("train", self.train_data), ("eval", self.eval_data)):
            for key, ids in data.items():
                if key.endswith("ids") and ids.size and int(ids.max()) >= vocab_size:
                    raise ConfigError(f"{self.section}.data ({split} split): token id "
                                      f"{int(ids.max())} >= the model vocab_size {vocab_size}: "
                                      "tokenizer and model do not match")

    def _check_context(self, context: int) -> None:
        """Rows no wider than the model's context (a learned position table has no more)."""
        width = self.section_cfg.max_length if self.is_abstract else max(
            ids.shape[1] for data in (self.train_data, self.eval_data)
            for key, ids in data.items() if key.endswith("ids"))
        if width > context:
            raise ConfigError(f"{self.section}.max_length={self.section_cfg.max_length}: rows of "
                              f"{width} tokens exceed the model context {context} "
                              "(max_position_embeddings); lower it")

    def _jit(self) -> None:
        place, sec = self.place, self.section_cfg
        graphdef = self.model.graphdef
        state_sh, by_row, rep = place.shardings(self.state["model"]), place.by_row, place.replicated
        base_sh = place.shardings(self.frozen)
        update = partial(supervised_update, graphdef=graphdef, tx=self.tx, loss=self.loss,
                         denominator=self.denominator, micro_batch_size=sec.micro_batch_size,
                         mesh=place.constraint_mesh,
                         # no backbone gradient at all, not just no update
                         backbone_frozen=sec.backbone_lr_scale == 0)
        self._update = jax.jit(update, in_shardings=(state_sh, base_sh, by_row, rep),
                               out_shardings=(state_sh, rep), donate_argnums=0)
        self._eval = jax.jit(partial(supervised_eval, graphdef=graphdef, eval_sums=self.eval_sums),
                             in_shardings=(full_params(base_sh, state_sh.params), by_row, rep),
                             out_shardings=rep)

    def params(self):
        """The model's whole params: the trained ones and (LoRA) the frozen base."""
        return full_params(self.frozen, self.state["model"].params)

    def _put(self, batch: dict) -> dict:
        """A global batch (every process holds all rows on the host) -> device arrays."""
        lo, hi = self.place.row_range(len(batch["weight"]))
        return {k: self.place.put_rows(v[lo:hi], v.shape) for k, v in batch.items()}

    def packing_plan(self, batch: dict, micro: int) -> tuple[dict, PackedRows | None, dict]:
        """`(batch, plan, figures)` of a host batch (row dict of numpy arrays, one optimiser
        step or one evaluation pass) in micro-batches of `micro` rows: its rows reordered so
        that every device's block of each micro-batch holds near-equal tokens
        (`rollout.packing.balanced_order`; a batch's micro-batches only add up its sums, so
        the order changes no value), the replicated `rollout.packing.PackedRows` of their
        sequences (`sequence_lengths`), leaves `[B / micro, ...]`, and `packing_figures`.
        Without `<section>.packing`: `(batch, None, {})`."""
        if not self.section_cfg.packing:
            return batch, None, {}
        shards = packing_shards(micro, self.place.batch_shards)
        lengths = self.sequence_lengths(batch).reshape(len(batch["weight"]), -1)
        batch = rows_of(batch, balanced_order(lengths.sum(1), micro // shards))
        lengths = self.sequence_lengths(batch)  # a row's sequences stay together
        width = max(v.shape[1] for k, v in batch.items() if k.endswith("ids"))
        plan = plan_rows(lengths, length=width, micro_batch_size=micro * self.sequences_per_row,
                         shards=shards)
        return batch, self.place.replicate(plan), fill_figures(plan, lengths, width)

    def step(self) -> dict:
        """One optimiser step on the next `batch_size` rows; returns its metrics (floats)."""
        t0 = time.perf_counter()
        rows = rows_of(self.train_data, self.prompt_order.next_indices(self.section_cfg.batch_size))
        rows, plan, figures = self.packing_plan(rows, self.section_cfg.micro_batch_size)
        state, stats = self._update(self.state["model"], self.frozen, self._put(rows), plan)
        stats = {**{k: float(v) for k, v in jax.device_get(stats).items()}, **figures}
        self.state = {"model": state}
        self.step_count += 1
        dt = time.perf_counter() - t0
        stats.update({"time/step": dt, "data_position": self.prompt_order.position,
                      "epoch": self.prompt_order.position / len(self.train_data["weight"])})
        return stats

    def evaluate(self, data: dict | None = None) -> dict:
        """Metrics of the current model on `data` (default: the held-out split), computed in
        chunks of `batch_size` rows (the last padded with weight-0 rows) and summed exactly."""
        data = self.eval_data if data is None else data
        n, size = len(data["weight"]), self.section_cfg.batch_size
        sums: dict = {}
        for lo in range(0, n, size):
            chunk = pad_rows(rows_of(data, slice(lo, lo + size)), size)
            chunk, plan, _ = self.packing_plan(chunk, size)  # the chunk in one pass
            out = jax.device_get(self._eval(self.params(), self._put(chunk), plan))
            for k, v in out.items():
                sums[k] = sums.get(k, 0.0) + np.float64(v)
        return self.finish_eval(sums) if sums else {}

    def periodic_metrics(self, step: int) -> dict:
        every, last = self.section_cfg.eval_every, self.is_last_step(step)
        if not len(self.eval_data["weight"]) or not (last or (every and step % every == 0)):
            return {}
        return {f"eval/{k}": v for k, v in self.evaluate().items()}

    # --- per stage ------------------------------------------------------------------------
    def model_source(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def load_data(self, tokenizer) -> tuple[dict, dict]:
        """(train, eval) row dicts: `<section>.data`, and `<section>.eval_data` or a seeded
        `<section>.eval_fraction` of the data held out."""
        sec, key = self.section_cfg, self.section
        data = self.tokenize_file(sec.data, f"{key}.data", tokenizer)
        if sec.eval_data:
            return data, self.tokenize_file(sec.eval_data, f"{key}.eval_data", tokenizer)
        train_idx, eval_idx = split_holdout(len(data["weight"]), sec.eval_fraction, self.cfg.train.seed)
        return rows_of(data, train_idx), rows_of(data, eval_idx)

    def encode_kwargs(self, tokenizer) -> dict:
        """Tokenisation settings of both stages: PPO's prompt template, lengths and
        `data.truncation`, the tokenizer's EOS after each response, right padding with its pad
        id."""
        d, sec = self.cfg.data, self.section_cfg
        return dict(max_prompt_length=d.max_prompt_length, max_length=sec.max_length,
                    use_chat_template=d.use_chat_template, system_prompt=d.system_prompt,
                    eos_id=tokenizer.eos_token_id, pad_id=self.pad_id,
                    eos_after_truncated=sec.eos_after_truncated, truncation=d.truncation)

    def tokenize_file(self, path: str, key: str, tokenizer) -> dict:  # pragma: no cover - abstract
        """Read, check and tokenise one data file (config key `key`) into a row dict."""
        raise NotImplementedError

    sequences_per_row = 1  # sequences a batch row holds (a preference pair: 2)

    def sequence_lengths(self, batch: dict) -> np.ndarray:  # pragma: no cover - abstract
        """`[B * sequences_per_row]` real tokens of each sequence of a host batch, in the order
        its loss packs them (`packing_plan`)."""
        raise NotImplementedError

    def denominator(self, batch: dict) -> jax.Array:  # pragma: no cover - abstract
        raise NotImplementedError

    def loss(self, graphdef, params, micro: dict, denominator,
             packing=None):  # pragma: no cover - abstract
        raise NotImplementedError

    def eval_sums(self, graphdef, params, batch: dict,
                  packing=None) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def finish_eval(self, sums: dict) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError


def resolve_source(source: str | None, key: str):
    """`resolve_model_path` with the config key in the error."""
    if not source:
        raise ConfigError(f"{key} is not set")
    return resolve_model_path(source, key)

