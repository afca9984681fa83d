"""LoRA: low-rank adapters on the decoders' projections (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models"), with PEFT's semantics and names.

A projection `y = x W (+ b)` with `W [in, out]` that `ModelConfig.lora_on(name)` selects becomes

    y = x W (+ b) + scale * (x A) B,    A [in, r], B [r, out],    scale = lora_alpha / r

This is PEFT's `LoraLayer` without dropout, which is off in every model here. The adapters sit
beside the kernel in the params tree, with the layer axis first like every stacked param:
`backbone/layers/attn/q_proj/{kernel [N, in, out], lora_a [N, in, r], lora_b [N, r, out]}`.
The init is PEFT's default, `init_lora_weights=True`: A ~ U(-1/sqrt(in), 1/sqrt(in)), PEFT's
`kaiming_uniform_(a=sqrt(5))`, and B = 0, so a fresh adapter changes nothing.

Why not qwix: `qwix.apply_lora_to_model` (qwix 0.1.8) creates its adapters on the model's first
call; on our decoders, whose layers are stacked with `nnx.vmap` and run by `jax.lax.scan` over
the split layer state, that first call fails inside the scan (`IndexError: tuple index out of
range`), and adapters made inside a scan body would not have the layer axis. The layer is ~20
lines here, and the adapters then follow the sharding rules of their kernel
(`parallel.rules`).

The params helpers below work on the nested dicts the trainer holds (`nnx.to_pure_dict`):
`split_params` separates the trained part (adapters and heads) from the frozen base, `join`
puts them back together inside a jitted function, `merge_adapters` folds the adapters into the
kernels (the merged export) and `base_params` is the base with adapters dropped (the reference
model of a LoRA run).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppo_jax.models.config import ModelConfig

ADAPTERS = ("lora_a", "lora_b")
INITS = ("default", "gaussian")  # PEFT's init_lora_weights=True / "gaussian"
LoraInit = Literal[INITS]  # the trainer config's type of model.lora.init


@dataclass(frozen=True)
class LoraSettings:
    """The adapters a model is loaded with (the trainer's `model.lora`): `rank` (0 = none),
    `alpha`, `target_modules` (PEFT's names), `init` ("default" | "gaussian")."""

    rank: int = 0
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ()
    init: str = "default"

    def config_fields(self) -> dict:
        """The `ModelConfig` fields of these adapters (none when rank is 0)."""
        if not self.rank:
            return {}
        return dict(lora_rank=self.rank, lora_alpha=float(self.alpha),
                    lora_targets=tuple(self.target_modules))


class LoraLinear(nnx.Linear):
    """`nnx.Linear` plus a rank-`rank` adapter: `x W + b + scale * (x A) B` (module docstring).

    `lora_a [in, rank]` and `lora_b [rank, out]` are stored in float32 whatever the kernel's
    `param_dtype` (PEFT's `autocast_adapter_dtype`: a bfloat16 base, float32 adapters) and used
    in the compute dtype, like the kernel.
    """

    def __init__(self, din: int, dout: int, *, rank: int, scale: float, rngs: nnx.Rngs, **kw):
        super().__init__(din, dout, rngs=rngs, **kw)
        bound = 1.0 / np.sqrt(din)
        self.lora_a = nnx.Param(jax.random.uniform(rngs.params(), (din, rank), jnp.float32,
                                                   -bound, bound))
        self.lora_b = nnx.Param(jnp.zeros((rank, dout), jnp.float32))
        self.lora_scale = scale

    def __call__(self, x: jax.Array) -> jax.Array:
        y = super().__call__(x)
        dt = self.dtype or x.dtype
        a, b = self.lora_a[...].astype(dt), self.lora_b[...].astype(dt)
        low = jnp.dot(jnp.dot(x.astype(dt), a), b)
        return y + low * jnp.asarray(self.lora_scale, dt)


def linear(cfg: ModelConfig, name: str, din: int, dout: int, *, bias: bool,
           rngs: nnx.Rngs) -> nnx.Linear:
    """The projection `name` (PEFT's module name) of a decoder layer: `LoraLinear` when
    `cfg.lora_on(name)`, else `nnx.Linear`; N(0, 0.02) kernel, the config's dtypes."""
    kw = dict(use_bias=bias, dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype,
              kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
    if cfg.lora_on(name):
        return LoraLinear(din, dout, rank=cfg.lora_rank, scale=cfg.lora_scale, **kw)
    return nnx.Linear(din, dout, **kw)


# --- params ---------------------------------------------------------------------------------
def is_adapter(path: str) -> bool:
    """`path` (e.g. "backbone/layers/attn/q_proj/lora_a") is a LoRA adapter matrix."""
    return path.rsplit("/", 1)[-1] in ADAPTERS


def fresh_adapter(path: str, shape, dtype, seed: int, init: str = "default") -> np.ndarray:
    """A new adapter matrix for the param `path` of `shape`, `[N, in, r]` or `[N, r, out]`.

    `lora_b` is zeros. `lora_a` is drawn from U(-1/sqrt(in), 1/sqrt(in)) for "default", PEFT's
    kaiming-uniform with a=sqrt(5), or from N(0, 1/r^2) for "gaussian", PEFT's
    `init_lora_weights="gaussian"`. The draw depends only on `seed` and the path, so a seed
    gives the same adapter whatever else the model holds.

    Raises ValueError: an unknown `init`.
    """
    if init not in INITS:
        raise ValueError(f"model.lora.init={init!r} is not one of {list(INITS)}")
    if path.endswith("lora_b"):
        return np.zeros(shape, dtype)
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(path.encode()))
    fan_in, rank = shape[-2], shape[-1]
    if init == "gaussian":
        a = jax.random.normal(key, shape, jnp.float32) / rank
    else:
        bound = 1.0 / np.sqrt(fan_in)
        a = jax.random.uniform(key, shape, jnp.float32, -bound, bound)
    return np.asarray(a).astype(dtype)


def _walk(tree: Any, fn: Callable[[str, Any], Any], prefix: str = "") -> Any:
    """Map `fn(path, leaf)` over a nested dict; a None result drops the leaf (and empty dicts)."""
    out = {}
    for k, v in tree.items():
        p = f"{prefix}{k}"
        if isinstance(v, dict):
            sub = _walk(v, fn, p + "/")
            if sub:
                out[k] = sub
        else:
            r = fn(p, v)
            if r is not None:
                out[k] = r
    return out


def split_params(params: dict, trained: Callable[[str], bool]) -> tuple[dict, dict]:
    """`(trained, frozen)`: the leaves of a nested params dict whose path `trained(path)`
    accepts, and the rest; the same arrays, no copy. `join(frozen, trained)` undoes it."""
    return (_walk(params, lambda p, x: x if trained(p) else None),
            _walk(params, lambda p, x: None if trained(p) else x))


def join(*trees: dict) -> dict:
    """The union of nested params dicts with disjoint leaves (`split_params`'s inverse); the
    identity for one tree and empty others. Cheap: call it inside jitted functions.

    Raises ValueError: a leaf in two trees.
    """
    out: dict = {}
    for tree in trees:
        for k, v in tree.items():
            if k not in out:
                out[k] = v
            elif isinstance(v, dict) and isinstance(out[k], dict):
                out[k] = join(out[k], v)
            else:
                raise ValueError(f"param {k!r} is in two of the trees being joined")
    return out


def base_params(params: dict) -> dict:
    """The params without their adapters (same arrays): the base model's, for the graph of
    `cfg.without_lora()`."""
    return _walk(params, lambda p, x: None if is_adapter(p) else x)


def adapter_params(params: dict) -> dict:
    """Only the adapter matrices of `params` (same arrays)."""
    return _walk(params, lambda p, x: x if is_adapter(p) else None)


def merge_adapters(params: dict, scale: float) -> dict:
    """The base params with every adapter folded into its kernel, `W + scale * A B` (computed in
    float32, stored in the kernel's dtype), adapters dropped: the weights of the merged export
    (PEFT `merge_and_unload`). jit-able.
    """
    def merge(tree):
        if not isinstance(tree, dict):
            return tree
        if "lora_a" in tree:
            w, a, b = tree["kernel"], tree["lora_a"], tree["lora_b"]
            delta = jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32))
            rest = {k: v for k, v in tree.items() if k not in ADAPTERS}
            return {**rest, "kernel": (w.astype(jnp.float32) + scale * delta).astype(w.dtype)}
        return {k: merge(v) for k, v in tree.items()}

    return merge(params)

