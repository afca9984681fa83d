"""Shared fixtures: a tiny random Llama checkpoint (built locally, no download)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Path of a tiny random Llama HF directory with a word-level tokenizer."""
    from ppo_jax.models.tiny_random import ensure_tiny_random

    return ensure_tiny_random(tmp_path_factory.mktemp("ckpt") / "tiny-random-llama")
