"""What stages 1 and 2 share: a data set of fixed-width rows, a held-out split, one trained
model, minibatch steps with exact gradient accumulation, and held-out evaluation.

A subclass (`SFTTrainer`, `RewardModelTrainer`) gives: `section` (its config section),
`model_kind` and `model_source()`, `tokenize_file(path, key, tokenizer)` (a dict of numpy
arrays with rows first, one of them `weight [N]`), `loss(params, micro, denominator) -> (loss, stats)` (a sum over
the micro-batch divided by the minibatch's `denominator`), `denominator(batch)`,
`eval_sums(params, batch) -> dict of sums` and `finish_eval(sums) -> metrics`.
"""

from __future__ import annotations

import time
from functools import partial

import jax
import numpy as np
import optax

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


def supervised_update(state: TrainState, frozen: dict, batch: dict, *, graphdef, tx, loss,
                      denominator, micro_batch_size: int, mesh, backbone_frozen: bool):
    """One optimiser step of the SFT or reward-model stage on `batch` (a row-first dict of
    `[B, L]` / `[B]` arrays): gradients of `loss(graphdef, params, micro, n)` summed over
    micro-batches of `micro_batch_size` rows, `n = denominator(batch)` the whole batch's
    normaliser, so the sum is the full-batch gradient. `frozen`: the LoRA base ({} without),
    joined in the forward pass, never differentiated; `backbone_frozen` (`backbone_lr_scale`
    0): no gradient through the backbone at all. Returns `(state, stats)` with `grad_norm`."""
    n = denominator(batch)

    def micro_loss(params, micro):
        params = stop_backbone_gradient(params) if backbone_frozen else params
        return loss(graphdef, params, micro, n)

    grads, stats = accumulate_gradients(loss_of_trained(micro_loss, frozen), state.params, batch,
                                        micro_batch_size=micro_batch_size, mesh=mesh)
    stats["grad_norm"] = optax.global_norm(grads)
    return state.apply_gradients(grads, tx), stats


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
        return [Program("update", self._update, (state, self.frozen, batch)),
                Program("eval", self._eval, (self.params(), batch), every,
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
        self._update = jax.jit(update, in_shardings=(state_sh, base_sh, by_row),
                               out_shardings=(state_sh, rep), donate_argnums=0)
        self._eval = jax.jit(partial(self.eval_sums, graphdef),
                             in_shardings=(full_params(base_sh, state_sh.params), by_row),
                             out_shardings=rep)

    def params(self):
        """The model's whole params: the trained ones and (LoRA) the frozen base."""
        return full_params(self.frozen, self.state["model"].params)

    def _put(self, batch: dict) -> dict:
        """A global batch (every process holds all rows on the host) -> device arrays."""
        lo, hi = self.place.row_range(len(batch["weight"]))
        return {k: self.place.put_rows(v[lo:hi], v.shape) for k, v in batch.items()}

    def step(self) -> dict:
        """One optimiser step on the next `batch_size` rows; returns its metrics (floats)."""
        t0 = time.perf_counter()
        batch = self._put(rows_of(self.train_data, self.prompt_order.next_indices(self.section_cfg.batch_size)))
        state, stats = self._update(self.state["model"], self.frozen, batch)
        stats = {k: float(v) for k, v in jax.device_get(stats).items()}
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
            chunk = self._put(pad_rows(rows_of(data, slice(lo, lo + size)), size))
            out = jax.device_get(self._eval(self.params(), chunk))
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

    def denominator(self, batch: dict) -> jax.Array:  # pragma: no cover - abstract
        raise NotImplementedError

    def loss(self, graphdef, params, micro: dict, denominator):  # pragma: no cover - abstract
        raise NotImplementedError

    def eval_sums(self, graphdef, params, batch: dict) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def finish_eval(self, sums: dict) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError


def resolve_source(source: str | None, key: str):
    """`resolve_model_path` with the config key in the error."""
    if not source:
        raise ConfigError(f"{key} is not set")
    return resolve_model_path(source, key)

