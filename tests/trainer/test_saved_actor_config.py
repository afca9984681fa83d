"""`saved_actor.read_run_config` reads the config a run trained under: after a resume with
changed settings, the `config.resume-<step>.json` in effect at the step asked for."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_config_in_effect_at_a_step_is_read(tmp_path):
    from ppo_jax.trainer.config import load_config, to_dict
    from ppo_jax.saved_actor import read_run_config

    first = to_dict(load_config(ROOT / "configs/tiny.yaml", [f"train.output_dir={tmp_path}"]))
    (tmp_path / "config.json").write_text(json.dumps(first))
    changed = json.loads(json.dumps(first))
    changed["train"]["steps"], changed["optim"]["actor_lr"] = 7, 3e-6
    (tmp_path / "config.resume-2.json").write_text(json.dumps(changed))

    assert read_run_config(tmp_path, step=1).train.steps == first["train"]["steps"]
    at_2 = read_run_config(tmp_path, step=2)
    assert (at_2.train.steps, at_2.optim.actor_lr) == (7, 3e-6)
    assert read_run_config(tmp_path).train.steps == 7  # no step: the newest
    assert read_run_config(tmp_path, ["train.steps=9"]).train.steps == 9
