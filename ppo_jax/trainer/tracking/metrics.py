"""Per-step metrics to a JSONL file and TensorBoard event files; sample responses to JSONL; both
to the experiment trackers of `train.loggers` (W&B, MLflow: `trainer.tracking.loggers`).

Only the process that owns logging (process 0) writes. Files are opened in append mode and
flushed after every record, so nothing already written is lost when a run stops on an error,
and a resumed run continues the same files. A tracker that fails is dropped; the files go on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ppo_jax.trainer.tracking.loggers import Trackers


def _plain(value):
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.item() if np.ndim(value) == 0 else value.tolist()
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _is_number(value) -> bool:
    """A record's value that is a number (non-finite ones are the strings "nan", "inf", "-inf")."""
    return isinstance(value, (int, float)) or value in ("nan", "inf", "-inf")


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a `metrics.jsonl` that `MetricsWriter` wrote, in order, with the non-finite
    values it stores as the strings "nan" / "inf" / "-inf" read back as floats.

    Raises:
      FileNotFoundError: no file at `path`.
    """
    def value(v):
        return float(v) if isinstance(v, str) and v in ("nan", "inf", "-inf") else v

    text = Path(path).read_text(encoding="utf-8")
    return [{k: value(v) for k, v in json.loads(line).items()}
            for line in text.splitlines() if line.strip()]


class MetricsWriter:
    """Writes `metrics.jsonl`, `samples.jsonl` and TensorBoard events under `output_dir`, and
    sends the same records to `trackers` (a `loggers.Trackers`; none by default)."""

    def __init__(self, output_dir: str | Path, *, tensorboard: bool = True, enabled: bool = True,
                 trackers: Trackers | None = None):
        self.enabled = enabled
        self.dir = Path(output_dir)
        self._tb = None
        self.trackers = trackers if trackers is not None else Trackers()
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.dir / "metrics.jsonl", "a", encoding="utf-8")
        self._samples = None  # opened at the first samples: a stage without any writes none
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))

    def write(self, step: int, metrics: dict) -> None:
        """Append one record `{"step": step, **metrics}`; its numbers also go to TensorBoard
        and the trackers."""
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        scalars = {k: float(v) for k, v in record.items() if k != "step" and _is_number(v)}
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, int(step))
            self._tb.flush()
        self.trackers.call("log_metrics", int(step), scalars)

    def write_samples(self, step: int, samples: list[dict], tag: str = "samples") -> None:
        """Append decoded samples (dicts with prompt / response / score, and any other keys);
        TensorBoard shows them as text under `tag`, the trackers as a table under `tag`."""
        if not self.enabled:
            return
        if self._samples is None:
            self._samples = open(self.dir / "samples.jsonl", "a", encoding="utf-8")
        rows = [{k: _plain(v) for k, v in sample.items()} for sample in samples]
        for row in rows:
            self._samples.write(json.dumps({"step": int(step), **row}) + "\n")
        self._samples.flush()
        if self._tb is not None:
            text = "\n\n".join(f"**{s.get('score', '')}** {s.get('response', '')}" for s in samples)
            self._tb.add_text(tag, text, int(step))
        if rows:
            self.trackers.call("log_table", int(step), tag, rows)

    def close(self, failed: bool = False) -> None:
        """Close the files and finish the trackers' runs (`failed`: marked failed there)."""
        if not self.enabled:
            return
        self._metrics.close()
        if self._samples is not None:
            self._samples.close()
        if self._tb is not None:
            self._tb.close()
        self.trackers.call("close", failed)
