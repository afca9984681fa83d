"""Which decoder layers of a mixture-of-experts model are sparse, and how they are grouped.

transformers' `Qwen3MoeDecoderLayer` gives layer i the sparse MLP block iff i is not in
`mlp_only_layers`, `num_experts > 0` and `(i + 1) % decoder_sparse_step == 0`; every other
layer has the dense MLP of width `intermediate_size`. `ModelConfig.sparse_layers` keeps that
pattern as one flag per layer; the decoder stacks each run of consecutive same-kind layers as
one module scanned with `jax.lax.scan` (`layer_runs`), so an all-sparse model (Qwen3-30B-A3B)
is one scan, as a dense model is.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple


class LayerRun(NamedTuple):
    """Consecutive decoder layers `[first, stop)` of one kind, stacked as the module `name`."""

    name: str
    first: int
    stop: int
    sparse: bool


def check_moe(cfg) -> None:
    """Validate a `ModelConfig`'s expert fields. Raises ValueError naming the field: a
    sparse_layers of the wrong length, sparse layers without experts, experts on a model type
    without them, a non-positive size, or num_experts_per_tok > num_experts."""
    if cfg.sparse_layers and len(cfg.sparse_layers) != cfg.num_layers:
        raise ValueError(f"sparse_layers has {len(cfg.sparse_layers)} entries; expected one "
                         f"per layer ({cfg.num_layers})")
    if not cfg.num_experts:
        if any(cfg.sparse_layers):
            raise ValueError("sparse_layers marks sparse layers but num_experts is 0")
        return
    if cfg.model_type != "qwen3_moe":
        raise ValueError(f"num_experts={cfg.num_experts}: model_type {cfg.model_type!r} "
                         "has no experts (qwen3_moe does)")
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds "
                         f"num_experts={cfg.num_experts}")
    if len(cfg.sparse_layers) != cfg.num_layers:
        raise ValueError("a model with experts needs sparse_layers, one flag per layer")


def sparse_pattern(num_layers: int, num_experts: int, decoder_sparse_step: int,
                   mlp_only_layers) -> tuple[bool, ...]:
    """Per-layer flag of transformers' `Qwen3MoeDecoderLayer`: layer i is sparse iff i is not
    in mlp_only_layers, num_experts > 0 and (i + 1) % decoder_sparse_step == 0.
    Raises ValueError: decoder_sparse_step < 1."""
    if isinstance(decoder_sparse_step, bool) or not isinstance(decoder_sparse_step, int) \
            or decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step={decoder_sparse_step!r} must be a positive int")
    dense = set(mlp_only_layers or ())
    return tuple(i not in dense and num_experts > 0 and (i + 1) % decoder_sparse_step == 0
                 for i in range(num_layers))


def sparse_step_and_dense_layers(pattern: tuple[bool, ...]) -> tuple[int, list[int]]:
    """`(decoder_sparse_step, mlp_only_layers)` giving `pattern` back through `sparse_pattern`:
    the step whose pattern needs the fewest mlp-only layers (the smallest such step)."""
    best = None
    for step in range(1, len(pattern) + 1):
        base = [(i + 1) % step == 0 for i in range(len(pattern))]
        if all(b or not p for b, p in zip(base, pattern)):
            dense = [i for i, (b, p) in enumerate(zip(base, pattern)) if b and not p]
            if best is None or len(dense) < len(best[1]):
                best = (step, dense)
    return best


def layer_runs(sparse: tuple[bool, ...]) -> tuple[LayerRun, ...]:
    """The runs of consecutive same-kind layers of a per-layer `sparse` pattern, in order. One
    run is named "layers" (the param paths of a model with one kind of layer); several are
    named `layers_{first}`."""
    n = len(sparse)
    starts = [i for i in range(n) if i == 0 or sparse[i] != sparse[i - 1]]
    stops = starts[1:] + [n]
    single = len(starts) == 1
    return tuple(LayerRun("layers" if single else f"layers_{a}", a, b, sparse[a])
                 for a, b in zip(starts, stops))


def moe_fields(d: Mapping, n_layers: int) -> dict:
    """Qwen3MoeConfig's expert fields; its config.json names num_experts `num_local_experts`."""
    experts = d.get("num_experts")
    experts = d.get("num_local_experts", 128) if experts is None else experts
    if not experts:
        return dict(num_experts=0)
    return dict(
        num_experts=experts, num_experts_per_tok=d.get("num_experts_per_tok", 8),
        moe_intermediate_size=d.get("moe_intermediate_size", 768),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
        sparse_layers=sparse_pattern(n_layers, experts, d.get("decoder_sparse_step", 1),
                                     d.get("mlp_only_layers")),
    )


def moe_hf_fields(cfg) -> dict:
    """`moe_fields`' inverse: the Qwen3MoeConfig keyword arguments of a `ModelConfig`."""
    step, dense = sparse_step_and_dense_layers(cfg.sparse_layers or (False,) * cfg.num_layers)
    return dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                moe_intermediate_size=cfg.moe_intermediate_size,
                norm_topk_prob=cfg.norm_topk_prob, router_aux_loss_coef=cfg.router_aux_loss_coef,
                decoder_sparse_step=step, mlp_only_layers=dense)
