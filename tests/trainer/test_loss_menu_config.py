"""Issue 59: the loss menu's hyper-parameters come from `ppo.policy_loss_kwargs` and icepop's band
from `ppo.rollout_correction_band_*`; a key a loss does not take and a bad value are refused
when the config loads, naming the key; the band reaches the update and weights `pg_loss`; each
recipe loads on rlvr/dapo.yaml and its loss runs with the recipe's arguments."""

from __future__ import annotations

import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from ppo_jax import core
from ppo_jax.trainer.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/tiny.yaml"


@pytest.mark.parametrize("overrides, match", [
    (["ppo.policy_loss=sapo", "ppo.policy_loss_kwargs.tau_pos=-1.0"],
     r"^ppo.policy_loss_kwargs.tau_pos=-1.0 must be > 0 \(ppo.policy_loss='sapo'\)"),
    (["ppo.policy_loss=sapo", "ppo.policy_loss_kwargs.tau_neg=0"],
     r"^ppo.policy_loss_kwargs.tau_neg=0 must be > 0"),
    (["ppo.policy_loss=sapo", "ppo.policy_loss_kwargs.tau_neg=warm"],
     r"^ppo.policy_loss_kwargs.tau_neg='warm' must be a number"),
    (["ppo.policy_loss=clip_cov", "ppo.policy_loss_kwargs.clip_cov_lb=6.0"],
     r"^ppo.policy_loss_kwargs.clip_cov_lb=6.0 must be <= clip_cov_ub=5.0"),
    (["ppo.policy_loss=clip_cov", "ppo.policy_loss_kwargs.clip_cov_ratio=1.5"],
     r"^ppo.policy_loss_kwargs.clip_cov_ratio=1.5 must lie in \(0, 1\]"),
    (["ppo.policy_loss=kl_cov", "ppo.policy_loss_kwargs.kl_cov_ratio=0"],
     r"^ppo.policy_loss_kwargs.kl_cov_ratio=0 must lie in \(0, 1\]"),
    (["ppo.policy_loss=kl_cov", "ppo.policy_loss_kwargs.kl_cov_coef=-1"],
     r"^ppo.policy_loss_kwargs.kl_cov_coef=-1 must be >= 0"),
    # a key the loss does not take, named with the loss and the keys it does take
    (["ppo.policy_loss=sapo", "ppo.policy_loss_kwargs.tau=1.0"],
     r"^ppo.policy_loss_kwargs.tau=1.0: ppo.policy_loss='sapo' takes no tau \(its "
     r"ppo.policy_loss_kwargs: tau_neg, tau_pos\)"),
    (["ppo.policy_loss_kwargs.tau_pos=1.0"],
     r"^ppo.policy_loss_kwargs.tau_pos=1.0: ppo.policy_loss='ppo_clip' takes no tau_pos \(its "
     r"ppo.policy_loss_kwargs: none\)"),
    (["ppo.policy_loss=cispo", "ppo.policy_loss_kwargs.clip_cov_ratio=0.1"],
     r"^ppo.policy_loss_kwargs.clip_cov_ratio=0.1: ppo.policy_loss='cispo' takes no"),
    (["ppo.policy_loss=sapo", "ppo.cliprange_high=0.28"],
     r"^ppo.cliprange_high=0.28: ppo.policy_loss='sapo' takes no cliprange_high \(it reads "
     r"none of ppo.cliprange, ppo.cliprange_high, ppo.dual_clip\)"),
    (["ppo.policy_loss=cispo", "ppo.dual_clip=3.0"],
     r"^ppo.dual_clip=3.0: ppo.policy_loss='cispo' takes no dual_clip \(it reads "
     r"ppo.cliprange and ppo.cliprange_high\)"),
    (["ppo.policy_loss_kwargs.cliprange_high=0.3"],
     r"^ppo.policy_loss_kwargs.cliprange_high: the trainer passes cliprange_high itself"),
    # icepop's band
    (["ppo.rollout_correction=icepop", "ppo.rollout_correction_band_low=0.9",
      "ppo.rollout_correction_band_high=0.6"], r"ppo.rollout_correction_band_low=0.9, "
     r"ppo.rollout_correction_band_high=0.6: .*low must be >= 0 and <= high"),
    (["ppo.rollout_correction=icepop", "ppo.rollout_correction_band_low=-0.5"],
     r"ppo.rollout_correction_band_low=-0.5.*low must be >= 0"),
    (["ppo.rollout_correction=icepop", "ppo.rollout_correction_band_high=0.9"],
     r"ppo.rollout_correction_band_high=0.9: .*must hold 1"),
    (["ppo.rollout_correction=tis", "ppo.rollout_correction_band_low=0.3"],
     r"^ppo.rollout_correction_band_low=0.3 has no effect: ppo.rollout_correction='tis'"),
    (["ppo.rollout_correction=icepop", "ppo.rollout_correction_cap=3.0"],
     r"^ppo.rollout_correction_cap=3.0 has no effect: ppo.rollout_correction='icepop'"),
    (["ppo.policy_loss=kl_cov", "ppo.cliprange=0.3"],
     r"^ppo.cliprange=0.3 has no effect: ppo.policy_loss='kl_cov' clips no ratio"),
])
def test_bad_hyper_parameters_are_refused_at_load_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, overrides)


def test_good_hyper_parameters_load_and_a_forks_open_loss_takes_any_key():
    cfg = load_config(TINY, ["ppo.policy_loss=sapo", "ppo.policy_loss_kwargs.tau_neg=2.0"])
    assert cfg.ppo.policy_loss_kwargs == {"tau_neg": 2.0}
    load_config(TINY, ["ppo.policy_loss=cispo", "ppo.cliprange=1.0", "ppo.cliprange_high=4.0"])

    @core.register_policy_loss("open_fork_loss")
    def open_fork_loss(batch, *, cliprange, **unused):
        return batch.advantages, {}

    try:  # `**unused` takes anything; a name not registered yet is left to the start-up check
        load_config(TINY, ["ppo.policy_loss=open_fork_loss", "ppo.policy_loss_kwargs.zeta=1"])
        load_config(TINY, ["ppo.policy_loss=not_registered_yet", "ppo.policy_loss_kwargs.q=1"])
    finally:
        core.unregister("policy loss", "open_fork_loss")


def test_the_icepop_band_reaches_the_update_and_weights_pg_loss():
    """policy_objective with icepop [0.5, 2]: token ratios pi_old / pi_rollout of 3 (dropped),
    0.5 (kept, the low edge), e^0.4 and 1 (kept); on the first minibatch (lp = old) ppo_clip's
    per-token loss is -A, so pg_loss is the token mean of -w A."""
    from ppo_jax.trainer.stages.ppo.settings import update_settings
    from ppo_jax.trainer.stages.ppo.update import policy_objective

    cfg = load_config(TINY, ["ppo.rollout_correction=icepop", "ppo.rollout_correction_band_low=0.5",
                             "ppo.rollout_correction_band_high=2.0"])
    s = update_settings(cfg, shared_critic=False)
    assert (s.rollout_correction, s.rollout_correction_band) == ("icepop", (0.5, 2.0))
    mask = jnp.asarray([[1, 1, 0], [1, 1, 1]])
    d = np.array([[math.log(3.0), -math.log(2.0), 0.0], [0.4, 0.4, 0.0]])
    adv = np.array([[1.0, -2.0, 0.0], [0.5, 1.5, -1.0]])
    lp = jnp.full((2, 3), -1.0)
    batch = core.LossInputs(mask=mask, logprobs=lp, old_logprobs=lp, entropy=jnp.ones((2, 3)),
                            advantages=jnp.asarray(adv, jnp.float32),
                            rollout_logprobs=lp - jnp.asarray(d, jnp.float32))
    loss, stats = policy_objective(batch, core.loss_normalizers(mask), s)
    w = np.array([[0.0, 0.5, 0.0], [math.exp(0.4), math.exp(0.4), 1.0]])
    np.testing.assert_allclose(loss, (-w * adv).sum() / 5, rtol=1e-6)
    np.testing.assert_allclose(stats["rollout_correction/truncated_fraction"], 1 / 5, rtol=1e-6)


RECIPES = {  # name -> (policy loss, the paper's settings the recipe takes)
    "cispo": ("cispo", dict(cliprange=1.0, cliprange_high=4.0)),
    "sapo": ("sapo", dict(cliprange_high=None, policy_loss_kwargs={"tau_pos": 1.0, "tau_neg": 1.05})),
    "gmpo": ("gmpo", dict(cliprange=0.4, cliprange_high=None, loss_aggregation="seq-mean-token-mean")),
    "gspo_token": ("gspo_token", dict(cliprange=0.2, cliprange_high=0.28)),
    "clip_cov": ("clip_cov", dict(policy_loss_kwargs={"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0,
                                                      "clip_cov_ub": 5.0})),
    "kl_cov": ("kl_cov", dict(policy_loss_kwargs={"kl_cov_ratio": 2e-3, "kl_cov_coef": 1.0})),
    "icepop": ("ppo_clip", dict(rollout_correction="icepop", rollout_correction_band_low=0.5,
                                rollout_correction_band_high=5.0)),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_loads_on_dapo_and_its_loss_runs_with_its_arguments(name):
    from ppo_jax.trainer.config.loss_checks import policy_call_kwargs
    from ppo_jax.trainer.stages.ppo.load_checks import check_names

    cfg = load_config(ROOT / f"configs/rlvr/{name}.yaml")
    dapo = load_config(ROOT / "configs/rlvr/dapo.yaml")
    loss, settings = RECIPES[name]
    assert cfg.ppo.policy_loss == loss and cfg.train.output_dir == f"runs/rlvr_{name}"
    for key, value in settings.items():
        assert getattr(cfg.ppo, key) == value, key
    assert cfg.ppo.dynamic_sampling == dapo.ppo.dynamic_sampling is True
    assert cfg.ppo.overlong_buffer == dapo.ppo.overlong_buffer and cfg.data == dapo.data
    mask = jnp.asarray([[1, 1, 0], [1, 1, 1]])
    x = jnp.asarray([[-1.0, -0.5, 0.0], [-2.0, -0.1, -0.3]])
    batch = core.LossInputs(mask=mask, logprobs=x, old_logprobs=x - 0.1,
                            advantages=jnp.asarray([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]))
    per_token, stats = core.get_policy_loss(loss)(batch, **policy_call_kwargs(cfg.ppo))
    assert per_token.shape == (2, 3) and bool(jnp.all(jnp.isfinite(per_token)))
    check_names(cfg)  # and the trainer's start-up check takes it
