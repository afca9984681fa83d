"""The `generation` section of the config: how the actor samples responses, with which engine
(the static batch or the paged engine) and with which copy of its weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ppo_jax.models.config import Dtype
from ppo_jax.rollout.engine_layout import AttentionKernel, RolloutEngine
from ppo_jax.rollout.stream import KvOnSwitch
from ppo_jax.rollout.weights import RolloutLayout, RolloutPlacement
from ppo_jax.trainer.config.fields import opt


@dataclass
class GenerationConfig:
    """Sampling of responses by the actor."""

    max_new_tokens: int = opt(40, "tokens sampled per response at most")
    temperature: float = opt(1.0, "sampling temperature (log-probs are taken at it too)")
    top_k: int = opt(0, "keep the k most likely tokens; 0 = off")
    top_p: float = opt(1.0, "nucleus sampling mass; 1.0 = off")
    greedy: bool = opt(False, "argmax decoding")
    stop_token_ids: list[int] = opt(help="token ids that end a response; empty: the "
                                    "tokenizer's EOS", factory=list)
    ignore_eos: bool = opt(False, "never stop: every response is max_new_tokens long "
                           "(benchmarks)")
    response_buckets: int = opt(4, "experience making and the update run on the batch's longest response, "
                                "rounded up to one of this many evenly spaced widths up to "
                                "max_new_tokens (trainer.stages.ppo.step_data); 1 = always max_new_tokens")
    samples_per_prompt: int = opt(1, "responses per prompt (GRPO / RLOO groups): a PPO batch "
                                  "holds ppo.batch_size / n prompts x n")
    share_prompt_prefill: bool = opt(True, "with samples_per_prompt = n > 1, run each distinct "
                                     "prompt through the model once and give its KV cache to "
                                     "its n samples (rollout.prefill); the same tokens as n "
                                     "prefills")
    engine: RolloutEngine = opt("static", "static: one batch, a [B, P + N] KV cache, every row "
                                "until the longest stops (rollout.static_batch); paged: KV pages, "
                                "decode slots refilled as rows finish (rollout.engine, "
                                "docs/rollout_engine.md); the same tokens under one key")
    page_size: int = opt(16, "paged: tokens per KV page; must divide data.max_prompt_length + "
                         "max_new_tokens")
    num_pages: int = opt(0, "paged: KV pages in all replicas' pools together (one replica per "
                         "mesh data x fsdp block); 0: the static sampler's KV memory")
    max_concurrent: int = opt(0, "paged: decode slots (sequences decoded at once) over all "
                              "replicas; 0: the batch size")
    decode_chunk: int = opt(8, "paged: tokens decoded between two scheduling rounds (finished "
                            "rows leave and new ones enter at chunk ends)")
    decode_buckets: int = opt(4, "paged: page-table widths the decode chunk compiles for; "
                              "attention reads the longest live sequence's width bucket")
    attention: AttentionKernel = opt("reference", "paged: attention over the pages: reference "
                                     "(gather the pages; CPU, GPU) or pallas (jax's ragged "
                                     "paged attention kernel; TPU)")
    param_dtype: Optional[Dtype] = opt(None, "dtype of the rollout copy of the actor's weights "
                                       "(e.g. bfloat16); null: the training params' dtype")
    rollout_layout: RolloutLayout = opt("auto", "layout of the rollout weights: tensor (split "
                                        "over tensor only, copied once per step when fsdp > 1: "
                                        "no weight gathers while decoding), train (the "
                                        "training layout, gathered at every decode step) or "
                                        "auto (tensor for the paged engine, train for static)")
    placement: RolloutPlacement = opt(
        "colocated", "colocated: the sampler runs on the trainer's devices and mesh; split: "
        "generation.rollout_devices devices (the last ones of each process) form a rollout "
        "group with its own mesh (data = rollout_devices / mesh.tensor, tensor = mesh.tensor) "
        "that holds the sampler and the rollout copy of the actor's weights, sent there once per "
        "update; the trainer's mesh (mesh.*) takes the other devices (docs/async_rl.md)")
    rollout_devices: int = opt(0, "split: the rollout group's devices, over all processes (a "
                               "multiple of mesh.tensor and of the process count, fewer than "
                               "all devices)")
    partial_rollouts: bool = opt(True, "with ppo.max_staleness > 0: the weights of each update "
                                 "reach the responses already decoding at the paged engine's "
                                 "next chunk boundary, so a response may span policy versions "
                                 "(AReaL, slime); false: the live responses finish under the "
                                 "old weights first, no admission meanwhile (rollout.stream, "
                                 "docs/async_rl.md)")
    kv_on_switch: KvOnSwitch = opt("recompute", "with partial_rollouts: at a weight switch, "
                                   "recompute the live responses' KV cache under the new "
                                   "weights (one prefill of the live slots; AReaL) or keep the "
                                   "old weights' keys and values")
