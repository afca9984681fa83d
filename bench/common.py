"""Helpers shared by the benchmark scripts (standard library only: `ppo_step_trl.py` imports it
from the TRL-only environment too)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path


def stats(values) -> dict:
    """`{median, min, max, n}` of a sequence of numbers (as floats)."""
    values = [float(v) for v in values]
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def machine_load() -> dict:
    """Logical CPU count and the 1-minute load average now (other load inflates timings)."""
    return {"cpus": os.cpu_count(), "load_average": os.getloadavg()[0]}


def write_json(path: Path, data: dict) -> None:
    """Write `data` as indented JSON to `path` (parents created) and say so on stdout."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")
