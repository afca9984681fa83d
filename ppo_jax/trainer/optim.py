"""Optimisers of the trained models: AdamW with a warmup + constant or cosine schedule and
global-norm gradient clipping (optax); optionally a smaller learning rate (or none) for the
backbone than for the head on top of it."""

from __future__ import annotations

from functools import partial
from typing import Any, Literal, Sequence

import jax
import optax

SCHEDULES = ("constant", "cosine")  # optim.schedule (see `lr_schedule`)
Schedule = Literal[SCHEDULES]


def make_schedule(peak_lr: float, *, schedule: str, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """Learning rate of each optimiser update, as a function of optax's update count (0-based).

    With ``W = warmup_steps > 0`` the warmup is linear and counts updates from 1: update ``u``
    (count ``u - 1``) uses ``peak_lr * u / W`` for ``u <= W`` — the first update uses
    ``peak_lr / W`` (never 0: every update moves the params) and update ``W`` the peak.
    Then `constant` stays at ``peak_lr``; `cosine` decays as
    ``0.5 peak_lr (1 + cos(pi (u - W) / (total_steps + 1 - W)))``, positive at the last update
    ``u = total_steps`` and 0 one update later. Without warmup, `constant` is ``peak_lr`` and
    `cosine` is optax's ``cosine_decay`` from ``peak_lr`` at the first update to 0 at count
    ``total_steps`` (unchanged). optax reads a schedule at the count BEFORE its update
    (``scale_by_schedule``), hence the shift by one against ``optax.warmup_*_schedule``, whose
    value at count 0 is ``init_value``.

    Raises:
      ValueError: unknown schedule name.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule={schedule!r} is not one of {list(SCHEDULES)}")
    if warmup_steps <= 0:
        if schedule == "constant":
            return optax.constant_schedule(peak_lr)
        return optax.warmup_cosine_decay_schedule(0.0, peak_lr, 0, max(total_steps, 1), end_value=0.0)
    if schedule == "constant":
        by_update = optax.warmup_constant_schedule(0.0, peak_lr, warmup_steps)
    else:
        by_update = optax.warmup_cosine_decay_schedule(
            0.0, peak_lr, warmup_steps, max(total_steps + 1, warmup_steps + 1), end_value=0.0)
    return lambda count: by_update(count + 1)  # update u = count + 1


def head_labels(params: Any, heads: Sequence[str]) -> Any:
    """`"head"` for every leaf under a top-level key in `heads` (e.g. a reward model's
    `score`), `"backbone"` for the rest: the labels `optax.multi_transform` splits on."""
    def label(path, _):
        return "head" if getattr(path[0], "key", None) in heads else "backbone"

    return jax.tree_util.tree_map_with_path(label, params)


def stop_backbone_gradient(params: Any, heads: Sequence[str] = ("score",)) -> Any:
    """`params` with `jax.lax.stop_gradient` on every leaf outside the top-level keys `heads`:
    a loss of these params has zero backbone gradients, and XLA drops the backward pass through
    the backbone (a frozen backbone then costs one forward pass per step)."""
    labels = head_labels(params, heads)
    return jax.tree.map(lambda x, lab: x if lab == "head" else jax.lax.stop_gradient(x), params, labels)


def make_optimizer(peak_lr: float, *, schedule: str = "constant", warmup_steps: int = 0,
                   total_steps: int = 1, weight_decay: float = 0.0, b1: float = 0.9,
                   b2: float = 0.95, eps: float = 1e-8, max_grad_norm: float | None = 1.0,
                   backbone_lr_scale: float = 1.0,
                   heads: Sequence[str] = ("score",)) -> optax.GradientTransformation:
    """clip_by_global_norm(max_grad_norm) -> AdamW(schedule) (Loshchilov & Hutter 2019).

    With `backbone_lr_scale != 1` the params under the top-level keys `heads` get AdamW at
    `peak_lr` and the rest (the backbone) AdamW at `peak_lr * backbone_lr_scale`; 0 freezes the
    backbone (`optax.set_to_zero`: no update, no Adam moments) and trains the head alone, a
    linear probe of the starting model's features. The gradient clip still sees every gradient.

    Raises:
      ValueError: unknown schedule name; negative `backbone_lr_scale`.
    """
    if backbone_lr_scale < 0:
        raise ValueError(f"backbone_lr_scale={backbone_lr_scale} is negative")
    parts = []
    if max_grad_norm is not None and max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(max_grad_norm))

    def adamw(lr: float) -> optax.GradientTransformation:
        sched = make_schedule(lr, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps)
        return optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)

    if backbone_lr_scale == 1.0:
        parts.append(adamw(peak_lr))
    else:
        backbone = adamw(peak_lr * backbone_lr_scale) if backbone_lr_scale > 0 else optax.set_to_zero()
        parts.append(optax.multi_transform({"head": adamw(peak_lr), "backbone": backbone},
                                           partial(head_labels, heads=tuple(heads))))
    return optax.chain(*parts)


def optimizer_from_config(optim_cfg, peak_lr: float, total_steps: int, *,
                          backbone_lr_scale: float = 1.0,
                          heads: Sequence[str] = ("score",)) -> optax.GradientTransformation:
    """`make_optimizer` with the schedule and AdamW settings of an `OptimConfig` (every stage
    builds its optimisers through this)."""
    o = optim_cfg
    return make_optimizer(peak_lr, schedule=o.schedule, warmup_steps=o.warmup_steps,
                          total_steps=total_steps, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2,
                          eps=o.eps, max_grad_norm=o.max_grad_norm,
                          backbone_lr_scale=backbone_lr_scale, heads=heads)


def actor_optimizer(optim_cfg, total_steps: int, *, shared_critic: bool) -> optax.GradientTransformation:
    """The PPO actor's optimiser: AdamW at `optim.actor_lr`; with `shared_critic` and
    `optim.value_head_lr` set, the params under `value_head` at `value_head_lr` and the
    backbone at `actor_lr` (`backbone_lr_scale = actor_lr / value_head_lr`), so a value head
    that starts from zeros can learn at a critic's rate while the policy moves at the actor's.
    `value_head_lr` null keeps TRL 0.11's one rate for both."""
    o = optim_cfg
    head_lr = o.value_head_lr
    if not shared_critic or head_lr is None:
        return optimizer_from_config(o, o.actor_lr, total_steps)
    return optimizer_from_config(o, head_lr, total_steps, backbone_lr_scale=o.actor_lr / head_lr,
                                 heads=("value_head",))
