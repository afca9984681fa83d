"""Named partition rules: which mesh axis shards which dim of each parameter.

A rule maps a regex on the param path (`ppo_jax.models.param_paths`, e.g.
"backbone/layers/attn/q_proj/kernel") to mesh axes for the param's TRAILING dims; leading dims
not covered by the rule -- the scanned layer axis of every `layers/...` param -- are never
sharded. Kernels are `[in, out]` (`x @ W`):

| param (path ends with)                         | dims        | spec                 |
| ---------------------------------------------- | ----------- | -------------------- |
| embed_tokens/embedding, wte/embedding          | [V, D]      | (tensor, fsdp)       |
| wpe/embedding                                  | [T, D]      | (None, fsdp)         |
| unembed/kernel (untied LM head)                | [D, V]      | (fsdp, tensor)       |
| attn/{q,k,v}_proj/kernel  (column-parallel)    | [D, H*hd]   | (fsdp, tensor)       |
| attn/{q,k,v}_proj/bias                         | [H*hd]      | (tensor,)            |
| attn/o_proj/kernel  (row-parallel)             | [H*hd, D]   | (tensor, fsdp)       |
| attn/{c_attn,c_proj}/kernel (GPT-2)            | [D, 3D/D]   | (fsdp, None)         |
| mlp/{gate,up}_proj/kernel, mlp/c_fc/kernel     | [D, F]      | (fsdp, tensor)       |
| mlp/c_fc/bias                                  | [F]         | (tensor,)            |
| mlp/{down_proj,c_proj}/kernel  (row-parallel)  | [F, D]      | (tensor, fsdp)       |
| mlp/experts/{gate_proj,up_proj} (MoE experts)  | [E, D, F]   | (fsdp, None, tensor) |
| mlp/experts/down_proj (MoE experts)            | [E, F, D]   | (fsdp, tensor, None) |
| mlp/gate/kernel (MoE router)                   | [D, E]      | replicated           |
| anything else: norms, row-parallel biases, value / score heads | replicated      |
| attn/{q,k}_norm/scale (Qwen3, per-head norm)   | [hd]        | replicated           |
| .../lora_a, .../lora_b of a kernel ruled (i, o)             | [in, r] / [r, out] | (i, None) / (None, o) |

Column-parallel then row-parallel (Megatron-LM, Shoeybi et al. 2019): q/k/v and gate/up split
their output features (heads, MLP columns) over `tensor`, o/down split their input features the
same way, so each attention / MLP block needs one reduction over `tensor`. `fsdp` shards the
other dim of every matrix (ZeRO-3 / FSDP: gathered per layer inside the layer scan). The
vocabulary of the embedding and the LM head goes over `tensor` (Megatron's vocab-parallel
embedding), so `[B, T, V]` logits come out split over `tensor`. GPT-2's fused `c_attn` is not
split over `tensor` (its output concatenates q|k|v, so column blocks would not align with
heads), and neither is its attention output projection.

Mixture-of-experts layers (`models.moe`) put the experts on the existing `fsdp` axis rather than
a new `expert` axis: each device holds E / fsdp whole experts, each expert's FFN columns
split over `tensor` as a dense MLP's. This is tunix's choice for Qwen3-MoE
(`tunix/models/qwen3/model.py`, `ShardingConfig.exp_weight_cdf = ('fsdp', None, 'tp')`,
`exp_weight_cfd = ('fsdp', 'tp', None)`): a mesh keeps its three axes, the expert
weights are sharded as finely as the dense ones, and the grouped matmul sees whole experts
(the partitioner gathers them per layer, as fsdp does for every weight). The router is tiny and
replicated.

A dim that the mesh axis size does not divide falls back to replication (e.g. 2 KV heads
under tensor=4), so any model runs under any mesh; only memory and speed change.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ppo_jax.models.functional import path_str

Rule = tuple[str, tuple[Optional[str], ...]]

RULES: tuple[Rule, ...] = (
    (r"(embed_tokens|wte)/embedding$", ("tensor", "fsdp")),
    (r"wpe/embedding$", (None, "fsdp")),
    (r"unembed/kernel$", ("fsdp", "tensor")),
    (r"attn/(q_proj|k_proj|v_proj)/kernel$", ("fsdp", "tensor")),
    (r"attn/(q_proj|k_proj|v_proj)/bias$", ("tensor",)),
    (r"attn/o_proj/kernel$", ("tensor", "fsdp")),
    (r"attn/(c_attn|c_proj)/kernel$", ("fsdp", None)),
    (r"mlp/(gate_proj|up_proj|c_fc)/kernel$", ("fsdp", "tensor")),
    (r"mlp/c_fc/bias$", ("tensor",)),
    (r"mlp/(down_proj|c_proj)/kernel$", ("tensor", "fsdp")),
    (r"mlp/experts/(gate_proj|up_proj)$", ("fsdp", None, "tensor")),
    (r"mlp/experts/down_proj$", ("fsdp", "tensor", None)),
)


def _adapter_rules(rules) -> tuple[Rule, ...]:
    """LoRA's `lora_a [in, r]` / `lora_b [r, out]` of a kernel `[in, out]` ruled `(i, o)`:
    `(i, None)` / `(None, o)`: A's input rows and B's output columns split as the kernel's, the
    rank never split (`models.lora`)."""
    out = []
    for pattern, axes in rules:
        if pattern.endswith("/kernel$") and len(axes) == 2:
            stem = pattern[: -len("kernel$")]
            out += [(stem + "lora_a$", (axes[0], None)), (stem + "lora_b$", (None, axes[1]))]
    return tuple(out)


RULES = RULES + _adapter_rules(RULES)


def _without_fsdp(rules) -> tuple[Rule, ...]:
    return tuple((pattern, tuple(None if a == "fsdp" else a for a in axes))
                 for pattern, axes in rules)


# The rollout copy of the actor (`generation.rollout_layout: tensor`): the same tensor splits,
# replicated over data and fsdp, so a decode step gathers no weights (verl's resharding of the
# actor into the inference engine's layout, once per step).
ROLLOUT_RULES: tuple[Rule, ...] = _without_fsdp(RULES)


def param_spec(path: str, shape: Sequence[int], mesh: Mesh,
               rules: Sequence[Rule] = RULES) -> P:
    """The PartitionSpec of one array by the first rule whose regex matches `path`.

    The rule's axes apply to the last `len(axes)` dims; leading dims (the layer axis) and dims
    that the axis size does not divide are replicated; unmatched paths and arrays of lower
    rank than the rule (scalars, e.g. optimiser step counts) are replicated.
    """
    for pattern, axes in rules:
        if re.search(pattern, path):
            break
    else:
        return P()
    ndim = len(shape)
    if ndim < len(axes):
        return P()
    spec: list[Optional[str]] = [None] * ndim
    for i, name in enumerate(axes):
        d = ndim - len(axes) + i
        if name is not None and mesh.shape[name] > 1 and shape[d] % mesh.shape[name] == 0:
            spec[d] = name
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def vocab_shards(mesh: Optional[Mesh], vocab: int) -> int:
    """How many devices `RULES` split the LM head's (and embedding's) vocabulary axis over: the
    `tensor` axis size when it divides `vocab`, else 1 (replicated); 1 without a mesh."""
    if mesh is None:
        return 1
    size = mesh.shape["tensor"]
    return size if size > 1 and vocab % size == 0 else 1


def tree_shardings(tree: Any, mesh: Mesh, rules: Sequence[Rule] = RULES) -> Any:
    """Same-structure pytree of `NamedSharding`s for params or any pytree that contains them.

    Rules match on path suffixes, so a `TrainState` ("params/backbone/..."), its optax state
    ("opt_state/1/0/mu/backbone/...": Adam moments follow their params) and a bare params
    tree all get the param's sharding; other leaves (step counts) are replicated. Leaves may be
    arrays or `jax.ShapeDtypeStruct`s (use with `jax.eval_shape` to lay out a state before it
    exists).
    """
    def one(key_path, leaf):
        return NamedSharding(mesh, param_spec(path_str(key_path), getattr(leaf, "shape", ()), mesh, rules))

    return jax.tree_util.tree_map_with_path(one, tree)


def shard_like_params(tree: Any, mesh: Optional[Mesh]) -> Any:
    """Inside jit: constrain every leaf of `tree` (params, gradients, accumulators) to its
    param sharding. The identity when `mesh` is None."""
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, tree_shardings(tree, mesh))


def describe(tree: Any, mesh: Mesh) -> dict[str, str]:
    """`{path: "shape -> spec"}` (for logs and docs)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_str(kp): f"{tuple(x.shape)} -> {param_spec(path_str(kp), x.shape, mesh)}"
            for kp, x in flat}
