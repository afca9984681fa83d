"""Optimisers of the trained models: AdamW with a warmup + constant or cosine schedule and
global-norm gradient clipping (optax)."""

from __future__ import annotations

import optax


def make_schedule(peak_lr: float, *, schedule: str, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """Learning rate per optimiser step.

    `constant`: linear warmup from 0 over `warmup_steps`, then `peak_lr`.
    `cosine`: linear warmup, then cosine decay to 0 at `total_steps`.

    Raises:
      ValueError: unknown schedule name.
    """
    if schedule == "constant":
        if warmup_steps <= 0:
            return optax.constant_schedule(peak_lr)
        return optax.warmup_constant_schedule(0.0, peak_lr, warmup_steps)
    if schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, peak_lr, warmup_steps, max(total_steps, warmup_steps + 1), end_value=0.0)
    raise ValueError(f"optim.schedule={schedule!r} is not one of ['constant', 'cosine']")


def make_optimizer(peak_lr: float, *, schedule: str = "constant", warmup_steps: int = 0,
                   total_steps: int = 1, weight_decay: float = 0.0, b1: float = 0.9,
                   b2: float = 0.95, eps: float = 1e-8,
                   max_grad_norm: float | None = 1.0) -> optax.GradientTransformation:
    """clip_by_global_norm(max_grad_norm) -> AdamW(schedule) (Loshchilov & Hutter 2019)."""
    parts = []
    if max_grad_norm is not None and max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(max_grad_norm))
    lr = make_schedule(peak_lr, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps)
    parts.append(optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return optax.chain(*parts)


def optimizer_from_config(optim_cfg, peak_lr: float, total_steps: int) -> optax.GradientTransformation:
    """`make_optimizer` with the schedule and AdamW settings of an `OptimConfig` (every stage
    builds its optimisers through this)."""
    o = optim_cfg
    return make_optimizer(peak_lr, schedule=o.schedule, warmup_steps=o.warmup_steps,
                          total_steps=total_steps, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2,
                          eps=o.eps, max_grad_norm=o.max_grad_norm)
