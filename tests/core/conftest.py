"""Fixtures of the core tests."""

import jax
import pytest


@pytest.fixture
def x64():
    """float64 enabled for the test (float64 numpy references), restored after it."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)
