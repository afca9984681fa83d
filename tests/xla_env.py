"""XLA_FLAGS for a test's subprocess that needs `n` CPU devices: this process's flags (the
test session's, tests/conftest.py) plus the device count."""

from __future__ import annotations

import os


def xla_flags(devices: int) -> str:
    """`$XLA_FLAGS --xla_force_host_platform_device_count=<devices>`."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
