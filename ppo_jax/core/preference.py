"""Stage 2 (reward model): the Bradley-Terry pairwise loss on sequence scores.

`loss = -log sigmoid(r_chosen - r_rejected - margin)`, the loss of InstructGPT (Ouyang et al.
2022, eq. 1), DeepSpeed-Chat step 2 and TRL's `RewardTrainer`. The margin term is Llama 2's
(Touvron et al. 2023, eq. 2). The functions return per-pair values and the caller reduces them,
as in optax.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ppo_jax.core import validation as V


def bradley_terry_loss(chosen_scores: jax.Array, rejected_scores: jax.Array,
                       margin: Any = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-pair Bradley-Terry loss and statistics.

    `d = r_c - r_r - margin`; `loss = -log sigmoid(d) = softplus(-d)` (stable for any `d`);
    `d loss / d r_c = -sigmoid(-d)` (e.g. r_c = 1, r_r = 0: loss 0.3133, gradient -0.2689).

    Args:
      chosen_scores, rejected_scores: `[B]` float, the reward model's scores of each pair.
      margin: None, a scalar or `[B]` float: how much the chosen should win by.

    Returns:
      `(loss [B], stats)` with per-pair `stats`: `accuracy` (1.0 where r_c > r_r, else 0.0),
      `margin` (r_c - r_r), all `[B]` float32 (the caller averages).

    Raises:
      ValueError: not rank-1 float arrays of one shape, or a margin of another shape.
    """
    rc = V.as_float("chosen_scores", chosen_scores, ndim=1)
    rr = V.as_float("rejected_scores", rejected_scores, ndim=1)
    if rc.shape != rr.shape:
        raise ValueError(f"chosen_scores has shape {tuple(rc.shape)} but rejected_scores has "
                         f"shape {tuple(rr.shape)}; expected one score per pair for both")
    m = jnp.zeros((), rc.dtype) if margin is None else V.as_float("margin", margin)
    if m.ndim and m.shape != rc.shape:
        raise ValueError(f"margin has shape {tuple(m.shape)}; expected a scalar or {tuple(rc.shape)}")
    diff = rc - rr
    loss = jax.nn.softplus(-(diff - m))
    stats = {"accuracy": (diff > 0).astype(jnp.float32),
             "margin": jax.lax.stop_gradient(diff).astype(jnp.float32)}
    return loss, stats
