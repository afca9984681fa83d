"""The settings dataclasses of the default config (`load_config(None)`), some fields replaced:
how tests build them, since they have no defaults of their own. Fields with no config key keep
the neutral values a unit test wants: no mesh, no score normaliser or EOS override, the
response width as the length constant, the actor trained."""

from __future__ import annotations

from dataclasses import replace

from ppo_jax.trainer.config import load_config
from ppo_jax.trainer.stages.ppo import settings

CONFIG = load_config(None)


def forward_settings(**fields):
    return replace(settings.forward_settings(CONFIG), **fields)


def experience_settings(forward=None, **fields):
    base = settings.experience_settings(CONFIG, forward_settings(), shared_critic=False)
    base = replace(base, max_response_length=None)
    return replace(base, forward=forward or forward_settings(), **fields)


def update_settings(**fields):
    base = replace(settings.update_settings(CONFIG, shared_critic=False),
                   max_response_length=None)
    return replace(base, **fields)
