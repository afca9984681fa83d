"""Which attention a full-sequence (no-cache) forward runs, and the cuDNN one.

The training passes (experience, update, evaluation) read each sequence whole, without a KV
cache. `ModelConfig.attention` picks their attention (`sequence_kernel`):
- "reference": `attention.dot_attention` (XLA einsums, scores `[B, H, L, S]` in float32);
- "splash": jax's Pallas splash attention (`models.splash_attention`); off TPU it runs in
  Pallas interpret mode (tests);
- "cudnn": cuDNN's fused attention through `jax.nn.dot_product_attention(implementation=
  "cudnn")` (`cudnn_attention`);
- "auto" (default): splash on TPU and cuDNN on GPU where the shapes allow (`unsupported_reason`
  of each), else the reference; the reference on CPU, and on a CPU host compiling for GPUs
  (cuDNN is looked up when the call is traced, and that host has none).
Calls with a cache (prefill, decode) always take the reference or the paged kernels.

cuDNN through jax 0.10.2's public API takes per-row lengths (`query_seq_lengths`,
`key_value_seq_lengths`: real tokens a prefix of the row), not segment ids; packed rows and
left-padded prompts are neither, so the pattern goes in as jax's boolean `mask` `[B, 1, L, S]`
(causal & same segment & window), which jax turns into an additive bias (a large negative
number, `get_large_negative_number`) of cuDNN's flash attention; `is_causal` lets it skip the
blocks above the diagonal. Its limits (jax `fused_attention_stablehlo.check_layout`,
`check_is_flash_attention`): float16 / bfloat16 only, head_dim a multiple of 8 up to 128 (256
on Hopper), and with a bias an even L when training. Scores and softmax are float32 inside the
kernel and the probabilities are rounded to v's dtype before the value product, as in
`dot_attention`. Not yet run on a GPU here; `jax.nn.dot_product_attention(implementation="xla")`
with the same arguments is tested against `dot_attention`.
"""

from __future__ import annotations

from typing import Literal, Optional

import jax
import jax.numpy as jnp

from ppo_jax.models.attention import windowed
from ppo_jax.models.grouped_matmul import platform_of
from ppo_jax.models import splash_attention as splash

ATTENTION_KERNELS = ("auto", "reference", "splash", "cudnn")
AttentionKernel = Literal[ATTENTION_KERNELS]  # the type of `ModelConfig.attention`
CUDNN_DTYPES = ("float16", "bfloat16")
CUDNN_MAX_HEAD_DIM = 128  # 256 on Hopper and later; 128 holds on every chip cuDNN takes


def cudnn_unsupported_reason(head_dim: int, length: int, dtype) -> Optional[str]:
    """Why cuDNN's fused attention does not take this call (None: it does): the module
    docstring's limits."""
    name = jnp.dtype(dtype).name
    if name not in CUDNN_DTYPES:
        return f"cuDNN attention takes {CUDNN_DTYPES}, not {name}"
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        return f"head_dim={head_dim}: cuDNN attention is used for multiples of 8 up to 128"
    if length % 2:
        return f"L={length}: cuDNN attention with a mask needs an even length"
    return None


def _one_program(mesh) -> bool:
    """Whether a Mosaic kernel may run without a shard_map: no mesh and one device (a jit over
    several devices would need XLA to partition it, which it cannot)."""
    return mesh is None and jax.device_count() == 1


def sequence_kernel(choice: str, mesh, *, rows: int, length: int, num_heads: int,
                    num_kv_heads: int, head_dim: int, dtype) -> str:
    """The attention of a no-cache forward: "reference", "splash" or "cudnn" (module
    docstring). choice: `ModelConfig.attention`; mesh: the run's mesh or None; rows, length:
    the call's `[B, L]`; the rest the model's attention shapes and compute dtype.

    Raises:
      ValueError: choice "cudnn" off GPU, or an unknown choice.
    """
    if choice not in ATTENTION_KERNELS:
        raise ValueError(f"attention={choice!r}; expected one of {ATTENTION_KERNELS}")
    platform = platform_of(mesh)
    if choice == "cudnn" and platform not in ("gpu", "cuda"):
        raise ValueError(f"attention='cudnn' (model.attention) needs a GPU; this program "
                         f"targets {platform}: set model.attention to auto or reference")
    if choice != "auto":
        return choice
    if platform == "tpu":
        fits = _one_program(mesh) or (mesh is not None and splash.splits_rows(mesh, rows))
        if fits and splash.unsupported_reason(num_heads, num_kv_heads, head_dim, dtype) is None:
            return "splash"
    # cuDNN is looked up when the call is traced (jax `check_cudnn_version`): a CPU host
    # compiling for GPUs (`aot.topology`) has none, so there the reference is compiled
    on_gpu = jax.default_backend() in ("gpu", "cuda")
    if (platform in ("gpu", "cuda") and on_gpu
            and cudnn_unsupported_reason(head_dim, length, dtype) is None):
        return "cudnn"
    return "reference"


def cudnn_attention(q, k, v, allowed, window=None, q_slots=None, k_slots=None, *,
                    scale: float | None = None, implementation: str = "cudnn") -> jax.Array:
    """`dot_attention`'s arguments through `jax.nn.dot_product_attention`: q `[B, L, H, hd]`,
    k / v `[B, S, KVH, hd]`, allowed `[B, L, S]` bool (causal), window / q_slots / k_slots as
    `dot_attention`'s; returns `[B, L, H * hd]` in v.dtype. implementation: "cudnn", or "xla"
    (the same semantics in XLA, for tests off GPU). Source: jax `dot_product_attention`."""
    b, n, h, hd = q.shape
    mask = windowed(allowed, window, q_slots, k_slots)[:, None]
    out = jax.nn.dot_product_attention(
        q, k.astype(q.dtype), v.astype(q.dtype), mask=mask, is_causal=True,
        scale=float(hd) ** -0.5 if scale is None else float(scale), implementation=implementation)
    return out.reshape(b, n, h * hd).astype(v.dtype)
